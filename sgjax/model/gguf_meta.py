"""GGUF reading that needs only `gguf` and numpy (no torch, no transformers)."""

from __future__ import annotations

import functools


class GGUFError(ValueError):
    """A GGUF file that cannot be read or holds something we do not support."""


@functools.lru_cache(maxsize=4)
def open_gguf(path: str):
    from gguf import GGUFReader  # imported here: serving HF checkpoints or dummy weights needs no gguf

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises a variety of errors on truncated or corrupt files
        raise GGUFError(f"cannot read GGUF file {path!r}: {type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=4)
def read_metadata(path: str) -> dict:
    reader = open_gguf(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise GGUFError(f"{path}: metadata field {key!r} is unreadable: {e}") from e
    return meta
