"""The baseline: HF transformers (torch) running each call of a program on its own, as the paper's HF baseline did.

Every gen prefills its whole prompt and decodes with HF's own KV cache for that call only; nothing is shared
between calls, select scores each choice with a full forward, and programs run one at a time. Text handling is
the engine's own (same tokenizer, chat template, incremental detokenizer, stop strings and regex FSM), so under
greedy decoding the outputs must agree with sgjax's; a difference is a bug to find, not noise.
"""

from __future__ import annotations

import numpy as np
import torch

from sgjax.engine.detokenize import IncrementalDecoder, StopMatcher
from sgjax.engine.params import SamplingParams
from sgjax.fsm.grammar import GrammarCache
from sgjax.fsm.vocab import from_tokenizer as vocabulary_of
from sgjax.lang.backend.base import Backend
from sgjax.lang.backend.engine import _split
from sgjax.lang.chat_template import from_tokenizer


def load_hf_model(model_path: str, device: str = "cpu", dtype=torch.float32):
    """HF's model from the same GGUF file the engine reads (dequantized), or from an HF directory."""
    import os

    from transformers import AutoModelForCausalLM, GgufConfig

    if model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def hf_model_from_weights(cfg, weights, device: str = "cpu", dtype=torch.bfloat16):
    """HF's own model of the config's family holding sgjax's weights (e.g. the dummy Llama-3-8B of a GPU run), copied
    one tensor at a time (on a GPU, straight from jax's buffer through DLPack), so the baseline computes the same
    function."""
    import transformers

    from sgjax.model.families import hf_config_dict
    from sgjax.model.weights import to_hf_state_dict

    d = hf_config_dict(cfg)
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model_cls = getattr(transformers, d["architectures"][0])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: an fp32 8B would need 32 GB first
    try:
        with torch.device(device):
            model = model_cls(hf_cfg)
    finally:
        torch.set_default_dtype(default)

    def convert(a):
        return torch.from_dlpack(a) if device != "cpu" else torch.from_numpy(np.array(a, np.float32))

    params = dict(model.named_parameters())
    for name, tensor in to_hf_state_dict(cfg, weights, convert).items():
        params[name].data.copy_(tensor)
    return model.eval()


class HFBackend(Backend):
    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.chat_template = from_tokenizer(tokenizer)
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self._grammars = GrammarCache()
        self._vocabulary = None
        self.prompt_tokens = 0  # every call recomputes its whole prompt: the baseline's cost

    def tokenize(self, text):
        return self.tokenizer.encode(text)

    def _grammar(self, p: SamplingParams):
        if p.regex is None and p.json_schema is None:
            return None
        if self._vocabulary is None:
            self._vocabulary = vocabulary_of(self.tokenizer)
        if p.regex is not None:
            return self._grammars.get_regex(p.regex, self._vocabulary)
        return self._grammars.get_json_schema(p.json_schema, self._vocabulary)

    @torch.inference_mode()
    def generate(self, text, params):
        sampling, _, _ = _split(params)
        p = SamplingParams.from_dict(sampling)
        ids = self.tokenizer.encode(text)
        self.prompt_tokens += len(ids)
        grammar, state = self._grammar(p), 0
        decoder = IncrementalDecoder(self.tokenizer)
        stops = StopMatcher(p.stop or [], p.no_stop_trim)
        rng = torch.Generator().manual_seed(p.seed32 if p.seed is not None else 0)
        x, past, out, pieces, reason, matched = torch.tensor([ids], device=self.device), None, [], [], None, None
        while len(out) < p.max_new_tokens:
            o = self.model(input_ids=x, past_key_values=past, use_cache=True)
            past, logits = o.past_key_values, o.logits[0, -1].float().cpu()
            if grammar is not None:
                allowed = torch.as_tensor(grammar.allowed_tokens(state), dtype=torch.long)
                logits = torch.full_like(logits, -float("inf")).index_copy_(0, allowed, logits[allowed])
            token = _pick(logits, p, rng)
            out.append(token)
            if grammar is not None:
                state = grammar.next_state(state, token)
            may_stop = len(out) >= p.min_new_tokens
            safe, matched = stops.feed(decoder.push([token]))
            pieces.append(safe)
            if may_stop and not p.ignore_eos and token in self.eos_ids:
                reason = {"type": "stop", "matched": token}
            elif may_stop and token in p.stop_token_ids:
                reason = {"type": "stop", "matched": token}
            elif matched is not None and may_stop:
                reason = {"type": "stop", "matched": matched}
            elif grammar is not None and grammar.is_finished(state):
                reason = {"type": "stop", "matched": None}
            if reason is not None:
                break
            x = torch.tensor([[token]], device=self.device)
        if matched is None:  # as the engine: a matched stop string ends the text, anything else flushes the tail
            tail, late = stops.feed(decoder.flush())
            pieces.append(tail + ("" if late is not None else stops.finish()))
        reason = reason or {"type": "length", "length": p.max_new_tokens}
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0, "finish_reason": reason}
        return "".join(pieces), meta

    @torch.inference_mode()
    def prompt_logprobs(self, input_ids, starts):
        rows = []
        for ids, start in zip(input_ids, starts):
            self.prompt_tokens += len(ids)
            logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0].float()
            lp = torch.log_softmax(logits, -1).cpu()
            rows.append([None if t == 0 else float(lp[t - 1, ids[t]]) for t in range(start, len(ids))])
        return rows


def _pick(logits: torch.Tensor, p: SamplingParams, rng: torch.Generator) -> int:
    if p.is_greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if p.top_k and p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > p.top_p
        probs = probs.index_fill(0, order[drop], 0.0)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))
