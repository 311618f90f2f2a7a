"""A request's images on a vision-language engine (LLaVA): decoded, preprocessed and encoded when the request is
made, then handed to the steps as feature rows at the prompt positions that hold them.

- The prompt marks each image with one image token (the placeholder); it is expanded to the tower's
  `num_image_tokens` rows, as LLaVA's processor does. A prompt that is already expanded is taken as it is.
- The placeholder ids are then replaced by pad ids drawn from the image's hash (SGLang's pad-value trick): the
  radix cache matches token ids, so two prompts share KV pages up to an image only when the image is the same
  (N ids all equal by chance is out of reach). The embedding of a pad id is never used: the step puts the image
  feature rows there (`Runner`, `forward(input_embeds=...)`).
- The features are computed when the request is made on the host side of the engine (a jitted tower call; the
  last 16 images' features are kept by hash, so the same image is encoded once) and travel with the request, so
  retraction, chunked prefill and cache hits need nothing more: a step asks for the rows of
  the positions its chunk covers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass

import jax
import numpy as np

from sgjax.errors import RequestError
from sgjax.model.vision import VisionConfig, VisionWeights, encode_images, preprocess


class ImageDataError(RequestError):
    """An image argument refused. `prompt` (the prompt's index in a batch; None for one prompt) and `image` (the
    image's index in its prompt's list; None when the prompt's images as a whole are wrong) let an API layer name
    its own field (the server: `image_data.1.0`, or the chat message part the image came from)."""

    def __init__(self, reason: str, prompt: int | None = None, image: int | None = None):
        where = "image_data" + "".join(f"[{i}]" for i in (prompt, image) if i is not None)
        super().__init__(f"{where}: {reason}", "image_data")
        self._reason, self.prompt, self.image = reason, prompt, image

    @property
    def reason(self) -> str:
        return self._reason


@dataclass(frozen=True)
class RequestImages:
    positions: np.ndarray  # i32[P]: prompt positions of image rows, ascending
    features: np.ndarray  # f32[P, D]: their input embeddings, in the same order

    def rows_in(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, feature rows) of the image rows in prompt positions [start, end)."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        return self.positions[lo:hi], self.features[lo:hi]


class ImageEncoder:
    def __init__(self, cfg: VisionConfig, weights: VisionWeights, cache_size: int = 16):
        self.cfg, self.weights = cfg, weights
        self._encode = jax.jit(lambda w, pixels: encode_images(w, cfg, pixels))
        # Features by image hash, least recently used first: a select scores every choice with the same image and a
        # chat sends it again each turn, so the tower should not run again. Requests prepare in worker threads.
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.encoded = 0  # images that went through the tower (the rest came from the cache)

    def _features(self, raw: list[bytes], digests: list[bytes], prompt: int | None) -> np.ndarray:
        """[n, num_image_tokens, D] features of the images, from the cache or one tower call for the others."""
        with self._lock:
            found = {d: self._cache[d] for d in digests if d in self._cache}
            for d in found:
                self._cache.move_to_end(d)
        todo = {d: i for i, d in enumerate(digests) if d not in found}  # one tower row per distinct new image
        if todo:
            pixels = np.stack([preprocess(_open(raw[i], prompt, i), self.cfg) for i in todo.values()])
            new = np.asarray(self._encode(self.weights, pixels), np.float32)
            self.encoded += len(todo)
            found.update(zip(todo, new))
            with self._lock:
                self._cache.update((d, found[d]) for d in todo)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return np.stack([found[d] for d in digests])

    def prepare(
        self, ids: list[int], image_data, vocab: int, prompt: int | None = None
    ) -> tuple[list[int], RequestImages]:
        """The prompt with placeholders expanded and replaced by pad ids, and the images' feature rows. `prompt`:
        the prompt's index in a batch, for error messages."""
        if not isinstance(image_data, (str, list, tuple)):
            raise ImageDataError(f"expected a base64 string or a list of them, got {type(image_data).__name__}", prompt)
        images = [image_data] if isinstance(image_data, str) else list(image_data)
        if not images:
            raise ImageDataError("an empty list (leave it out for a text prompt)", prompt)
        raw = [_decode(d, prompt, i) for i, d in enumerate(images)]
        n, per = len(raw), self.cfg.num_image_tokens
        token = self.cfg.image_token_index
        ids = np.asarray(ids, np.int64)
        marks = int(np.sum(ids == token))
        if marks == n:  # one placeholder per image: expand
            ids = np.concatenate([np.full(per, token) if t == token else [t] for t in ids]).astype(np.int64)
        elif marks != n * per:
            raise ImageDataError(
                f"{n} image(s) but the prompt has {marks} image tokens (id {token}); give one per "
                f"image, or {per} per image already expanded",
                prompt,
            )
        digests = [hashlib.sha256(r).digest() for r in raw]
        features = self._features(raw, digests, prompt)  # [n, per, D]
        positions = np.flatnonzero(ids == token).astype(np.int32)
        for k, digest in enumerate(digests):
            seed = int.from_bytes(digest[:8], "little")
            ids[positions[k * per : (k + 1) * per]] = np.random.default_rng(seed).integers(0, vocab, per)
        return ids.tolist(), RequestImages(positions, features.reshape(n * per, -1))


def _decode(data, prompt: int | None, i: int) -> bytes:
    if not isinstance(data, str):
        raise ImageDataError(f"expected a base64 string, got {type(data).__name__}", prompt, i)
    if data.startswith(("http://", "https://")):
        raise ImageDataError("URLs are not fetched here (no network); send the image's bytes in base64", prompt, i)
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageDataError("not valid base64", prompt, i) from None


# The most pixels an image may decode to (8k x 8k; LLaVA resizes to 336 x 336 anyway): checked from the header
# before decoding, so a small file that inflates to gigabytes (a decompression bomb) is a 400, not a 500.
MAX_IMAGE_PIXELS = 8192 * 8192


def _open(raw: bytes, prompt: int | None, i: int):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageDataError(f"{width} x {height} pixels is more than {MAX_IMAGE_PIXELS} pixels", prompt, i)
        image.load()
        return image
    except Image.DecompressionBombError:
        raise ImageDataError(f"more than {MAX_IMAGE_PIXELS} pixels", prompt, i) from None
    except (UnidentifiedImageError, OSError):
        raise ImageDataError(f"not an image file PIL can read ({len(raw)} bytes)", prompt, i) from None
