"""A tokenizer's vocabulary as raw bytes, the only view of the tokenizer the FSM compiler needs.

Byte-level BPE tokenizers (GPT-2 alphabet: SmolLM2, Qwen2, Llama-3) spell every byte as one
printable character; we undo that mapping so a token that holds half of a UTF-8 character is
still matched byte by byte against the regex automaton. SentencePiece-style vocabularies (Gemma,
Llama-2, Mistral) write a space as U+2581 and bytes outside their pieces as `<0xNN>` tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """token id -> the bytes it decodes to (None for special tokens, which never match text).

    `encode` (text -> ids, no special tokens) is optional: it is needed only for the canonical
    forced-token rule and jump-forward, which must know how the tokenizer splits forced text.
    """

    tokens: tuple[bytes | None, ...]
    eos_ids: frozenset[int]
    encode: Callable[[str], list[int]] | None = field(default=None, repr=False)
    name: str = ""

    @property
    def size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the tokenizer for the grammar cache: token bytes, EOS ids and the name."""
        h = hashlib.sha256(self.name.encode())
        h.update(repr(sorted(self.eos_ids)).encode())
        for t in self.tokens:
            h.update(b"\xff" if t is None else len(t).to_bytes(2, "little") + t)
        return h.hexdigest()[:32]

    @functools.cached_property
    def byte_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(uint8[V, L] zero-padded token bytes, int32[V] lengths; -1 for special tokens)."""
        width = max((len(t) for t in self.tokens if t), default=1)
        mat = np.zeros((self.size, width), dtype=np.uint8)
        lens = np.full(self.size, -1, dtype=np.int32)
        for i, t in enumerate(self.tokens):
            if t is not None:
                mat[i, : len(t)] = np.frombuffer(t, dtype=np.uint8)
                lens[i] = len(t)
        return mat, lens

    @functools.cached_property
    def sorted_index(self) -> tuple[list[bytes], np.ndarray]:
        """Token bytes sorted, with their ids: tokens that extend a prefix form a contiguous run."""
        pairs = sorted((t, i) for i, t in enumerate(self.tokens) if t)
        return [p[0] for p in pairs], np.array([p[1] for p in pairs], dtype=np.int32)

    def extensions(self, prefix: bytes) -> np.ndarray:
        """Ids of tokens that start with `prefix` and are strictly longer."""
        import bisect

        keys, ids = self.sorted_index
        lo = bisect.bisect_right(keys, prefix)
        hi = bisect.bisect_left(keys, prefix + b"\xff" * (len(keys[-1]) + 1), lo)
        return ids[lo:hi]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _metaspace(hf) -> bool:
    """Whether the tokenizer's decoder turns U+2581 into spaces (SentencePiece style) rather than undoing GPT-2's
    byte alphabet."""
    decoder = json.dumps(json.loads(hf.to_str()).get("decoder") or {})
    return "ByteLevel" not in decoder and ("\\u2581" in decoder or "Metaspace" in decoder or "ByteFallback" in decoder)


def _sentencepiece_bytes(piece: str) -> bytes:
    m = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()


def from_hf_tokenizer(hf, eos_ids, special_ids=(), name: str = "") -> Vocabulary:
    """Vocabulary of a byte-level BPE or SentencePiece-style `tokenizers.Tokenizer`; added/special tokens map to
    None."""
    decoder = _byte_decoder()
    metaspace = _metaspace(hf)
    size = hf.get_vocab_size(with_added_tokens=True)
    special = set(special_ids) | set(eos_ids)
    added = {i: t for i, t in hf.get_added_tokens_decoder().items()}
    tokens: list[bytes | None] = []
    for i in range(size):
        piece = hf.id_to_token(i)
        if i in special or piece is None or (i in added and added[i].special):
            tokens.append(None)
        elif i in added:  # user-defined added tokens are plain text, not byte-level spelled
            tokens.append(piece.encode())
        elif metaspace:
            tokens.append(_sentencepiece_bytes(piece))
        else:
            try:
                tokens.append(bytes(decoder[ch] for ch in piece))
            except KeyError:
                raise ValueError(f"token {i} {piece!r} is not byte-level BPE") from None

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    return Vocabulary(
        tokens=tuple(tokens), eos_ids=frozenset(int(e) for e in eos_ids), encode=encode, name=name or "hf"
    )


def from_tokenizer(tok) -> Vocabulary:
    """Vocabulary of an `sgjax.model.tokenizer.Tokenizer` (anything with .hf, .eos_token_ids, .special_ids)."""
    # The serialized tokenizer names the pre-tokenizer and merges too, which decide `encode`.
    name = "hf:" + hashlib.sha256(tok.hf.to_str().encode()).hexdigest()[:16]
    return from_hf_tokenizer(tok.hf, tok.eos_token_ids, getattr(tok, "special_ids", ()), name=name)


@functools.lru_cache(maxsize=4)
def load_vocabulary(model_path: str | None = None) -> Vocabulary:
    """Vocabulary of a model's tokenizer (default: SmolLM2), cached per path."""
    from sgjax.model.tokenizer import load_tokenizer

    return from_tokenizer(load_tokenizer(model_path))
