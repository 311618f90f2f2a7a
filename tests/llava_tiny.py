"""The tiny random LLaVA checkpoint the vision tests share (model, engine, server, frontend): a CLIP 32 px tower and
a 2-layer Llama with 320 tokens, written with transformers' `save_pretrained`, plus a byte-level BPE tokenizer of
exactly those 320 ids whose `<image>` is the model's `image_token_index`, so that text prompts work end to end.

No LLaVA tokenizer installs offline, and SmolLM2's 49k-token vocabulary would not fit the tiny model; a BPE trained
here on a fixed paragraph has the right size, and its ids are renumbered so that `<image>` sits at IMAGE_TOKEN
(a token already in the model's vocabulary keeps its id when it is added as a special token).
"""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np

IMAGE_TOKEN = 300
VOCAB = 320
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: transformers' Llama bos 1 / eos 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A picture shows a cat on a red mat, and the sky is blue. "
    "What is in this image? Describe the colours, the shapes and the light. Please answer in one line. "
)


def write_checkpoint(path: str):
    """The tiny random LLaVA and its tokenizer in `path`; returns the HF model (the numerical reference)."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vc = CLIPVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        projection_dim=16,
    )
    tc = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    hf = LlavaForConditionalGeneration(LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN))
    hf.eval()
    with torch.no_grad():  # random norms/biases, unit-gain matrices: every parameter and the image matter
        for n, p in hf.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias") or "class_embedding" in n or "position_embedding" in n:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in n:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p[0].numel() ** -0.5)
    hf.save_pretrained(path)
    write_tokenizer(path)
    return hf


def write_tokenizer(path: str) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template, `<image>` special at IMAGE_TOKEN) in `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    def fresh(model):
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok

    trained = fresh(models.BPE())
    trained.train_from_iterator(
        [_CORPUS * 3],
        trainers.BpeTrainer(
            vocab_size=VOCAB - 1,
            special_tokens=list(SPECIALS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    vocab = trained.get_vocab()
    assert len(vocab) == VOCAB - 1, f"the corpus gave {len(vocab)} tokens, not {VOCAB - 1}"
    vocab = {t: i + (i >= IMAGE_TOKEN) for t, i in vocab.items()}
    vocab["<image>"] = IMAGE_TOKEN
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tok = fresh(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, "<image>")])
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<image>") == IMAGE_TOKEN
    tok.save(os.path.join(path, "tokenizer.json"))
    special = {str(tok.token_to_id(t)): {"content": t, "special": True} for t in (*SPECIALS, "<image>")}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "added_tokens_decoder": special,
            },
            f,
        )


def png(pixels: np.ndarray) -> str:
    """base64 of a lossless PNG of a uint8 [H, W, 3] array (what `sgl.image` sends for an array)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def picture(seed: int) -> np.ndarray:
    """A random 41 x 57 picture: not square, so preprocessing resizes and crops it."""
    return np.random.default_rng(seed).integers(0, 256, (41, 57, 3), dtype=np.uint8)


def hf_greedy(llava, ids: list[int], pictures: list[np.ndarray], new: int) -> list[int]:
    """HF LlavaForConditionalGeneration's greedy tokens for a prompt with one IMAGE_TOKEN per picture (expanded
    here to the tower's rows, as LLaVA's processor does), EOS ignored."""
    import torch

    from sgjax.model import vision as V

    _, hf, (_, _, vcfg, _) = llava
    full = [x for t in ids for x in ([t] * vcfg.num_image_tokens if t == IMAGE_TOKEN else [t])]
    px = torch.from_numpy(np.stack([V.preprocess(p, vcfg) for p in pictures]))
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([full]),
            pixel_values=px,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(full) :].tolist()
