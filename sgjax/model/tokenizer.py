"""Tokenizer and chat template, from a GGUF file or an HF model directory.

Built on `tokenizers` only (no transformers at run time). For GGUF files the BPE model is
rebuilt from the metadata; SmolLM2's `smollm` pre-tokenizer splits digits one by one before the
GPT-2 regex, as llama.cpp does (transformers' GGUF converter drops that split).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from sgjax.model import gguf_meta
from sgjax.model.paths import resolve_model_path

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


@dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template the runtime needs."""

    hf: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool = False
    chat_template: str | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_str(self.bos_token_id),
            eos_token=self._token_str(self.eos_token_id),
            **kwargs,
        )

    def _token_str(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")


def load_tokenizer(model_path: str | None = None) -> Tokenizer:
    """Tokenizer of a GGUF file or HF directory; None means the default SmolLM2."""
    path = resolve_model_path(model_path)
    return _load_cached(os.path.realpath(path))


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> Tokenizer:
    if path.endswith(".gguf"):
        return _from_gguf(path)
    return _from_hf_dir(path)


def _from_gguf(path: str) -> Tokenizer:
    meta = gguf_meta.read_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if model == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
        hf.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        hf.decoder = decoders.ByteLevel()
    elif model == "llama" and meta.get("general.architecture") in ("gemma", "gemma2", "gemma3"):
        hf = _gemma_bpe(tokens)
    else:
        raise ValueError(
            f"{path}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2', and Gemma's "
            f"SentencePiece BPE 'llama')"
        )
    hf.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, y in zip(tokens, types) if y == _TOKEN_TYPE_CONTROL]
    )
    # user-defined tokens are matched whole, as llama.cpp does; one the model spells differently (Gemma's runs of
    # spaces, respelled in _gemma_bpe) stays the model's own token rather than becoming a new id
    vocab = hf.get_vocab(with_added_tokens=False)
    hf.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, y in zip(tokens, types)
            if y == _TOKEN_TYPE_USER_DEFINED and t in vocab
        ]
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
        eos_ids.append(eot)
    return Tokenizer(
        hf=hf,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        special_ids=frozenset(i for i, y in enumerate(types) if y == _TOKEN_TYPE_CONTROL),
    )


def _gemma_bpe(tokens: list[str]) -> HFTokenizer:
    """Gemma's SentencePiece BPE from the GGUF vocabulary (what HF's GemmaTokenizer is): byte fallback, spaces as
    U+2581 with no prefix space, pieces split after each space.

    The file has no merges: they are the vocabulary's pairs, the standard SentencePiece-to-BPE recovery: every
    token that is two tokens joined gives a merge, ranked by the token's position in the file (Gemma's scores do not
    follow its merge order; the file order does), ties broken towards the longer left part. llama.cpp's converter
    stores tokens of 2+ spaces with real spaces; they are respelled as U+2581 first so that they merge."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges.extend((left, right, -rank) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    hf = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for left, right, _ in merges],
            fuse_unk=True,
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return hf


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre == "qwen2":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    if pre in ("default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, qwen2, llama-bpe, gpt2)")


def _from_hf_dir(path: str) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    hf = HFTokenizer.from_file(tok_file)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    model_cfg = _read_json(os.path.join(path, "config.json"))
    gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
    template = cfg.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(template_file):
        with open(template_file) as f:
            template = f.read()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    def tid(key):
        tok = cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        return hf.token_to_id(tok) if isinstance(tok, str) else None

    eos_ids: list[int] = []
    for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id"), tid("eos_token")):
        for e in source if isinstance(source, list) else [source]:
            if e is not None and int(e) not in eos_ids:
                eos_ids.append(int(e))
    bos = tid("bos_token")
    if bos is None:
        bos = model_cfg.get("bos_token_id")
    added = cfg.get("added_tokens_decoder", {})
    special = frozenset(int(k) for k, v in added.items() if v.get("special"))
    # A tokenizer.json post-processor may already add BOS; add_bos only covers the case where it does not.
    add_bos = bool(cfg.get("add_bos_token", False)) and hf.post_processor is None
    return Tokenizer(
        hf=hf,
        bos_token_id=bos,
        eos_token_ids=tuple(eos_ids),
        add_bos=add_bos,
        chat_template=template,
        special_ids=special,
    )


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # The same environment settings transformers uses, so templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    return env.from_string(source)


def save_hf_dir(tok: Tokenizer, path: str, config: dict | None = None) -> None:
    """Write `tok` as an HF directory (tokenizer.json, tokenizer_config.json) that load_tokenizer reads back, with
    `config` as config.json (default: a stub naming only the model type and EOS ids, so the directory resolves
    as a model path). Machines without the gguf package and dummy-weight servers use such directories."""
    os.makedirs(path, exist_ok=True)
    tok.hf.save(os.path.join(path, "tokenizer.json"))
    token = tok.hf.id_to_token
    cfg = {"eos_token": token(tok.eos_token_id), "chat_template": tok.chat_template, "add_bos_token": tok.add_bos}
    if tok.bos_token_id is not None:
        cfg["bos_token"] = token(tok.bos_token_id)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or {"model_type": "llama", "eos_token_id": list(tok.eos_token_ids)}, f)
