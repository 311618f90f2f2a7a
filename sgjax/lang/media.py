"""Images and video frames for `sgl.image` / `sgl.video`, in the form every backend takes: a base64 string of the
encoded image (SGLang's `image_data`), or an http(s) URL kept as it is.

A file or bytes keep their encoding (no re-encode: the model's processor sees the bytes the user gave); decoded
pixels (a PIL image, a uint8 array [H, W, 3]) are encoded as PNG, which is lossless. A video becomes `num_frames`
evenly spaced frames, each such an image, as SGLang samples a video for LLaVA-style models.
"""

from __future__ import annotations

import base64
import io
import os

import numpy as np

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
)


def is_url(data: str) -> bool:
    return data.startswith(("http://", "https://"))


def encode_image(image) -> str:
    """base64 (or an http(s) URL) of a path, bytes, data URI, PIL image or uint8 array [H, W, 3|4]."""
    if isinstance(image, str):
        if is_url(image):
            return image
        if image.startswith("data:"):
            head, _, payload = image.partition(",")
            if ";base64" not in head:
                raise ValueError(f"image: a data URI must be base64 ({head[:40]!r})")
            return payload
        if not os.path.isfile(image):
            raise ValueError(f"image: no such file {image!r} (give a path, bytes, a PIL image or a uint8 array)")
        with open(image, "rb") as f:
            return _b64(f.read())
    if isinstance(image, (bytes, bytearray)):
        if not mime_type(bytes(image[:16])):
            raise ValueError("image: the bytes are not a PNG, JPEG, GIF, WebP or BMP image")
        return _b64(bytes(image))
    if isinstance(image, np.ndarray):
        return _b64(_png(_pil_from_array(image)))
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image, without importing PIL to check
        return _b64(_png(image))
    raise TypeError(f"image: expected a path, URL, bytes, PIL image or uint8 array, not {type(image).__name__}")


def mime_type(head: bytes) -> str | None:
    for magic, mime in _MAGIC:
        if head.startswith(magic):
            return mime
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return None


def data_url(data: str) -> str:
    """What OpenAI's `image_url` takes: the URL itself, or a data URI with the bytes' MIME type."""
    if is_url(data):
        return data
    mime = mime_type(base64.b64decode(data[:24] + "=" * (-len(data[:24]) % 4))) or "image/png"
    return f"data:{mime};base64,{data}"


def sample_frames(video, num_frames: int) -> list[str]:
    """`num_frames` evenly spaced frames of a video, each encoded as by `encode_image`. video: a uint8 array
    [F, H, W, 3], a list of images (anything `encode_image` takes), or a video file (read with imageio, which
    must then be installed)."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"video: num_frames must be a positive int, got {num_frames!r}")
    if isinstance(video, str):
        frames = _read_video(video)
    elif isinstance(video, np.ndarray):
        if video.ndim != 4:
            raise ValueError(f"video: an array must be [frames, height, width, channels], got shape {video.shape}")
        frames = list(video)
    elif isinstance(video, (list, tuple)):
        frames = list(video)
    else:
        raise TypeError(
            f"video: expected a file path, a [F, H, W, 3] array or a list of frames, not {type(video).__name__}"
        )
    if not frames:
        raise ValueError("video: no frames")
    picks = np.linspace(0, len(frames) - 1, min(num_frames, len(frames))).round().astype(int)
    return [encode_image(frames[i]) for i in picks]


def _read_video(path: str) -> list:
    if not os.path.isfile(path):
        raise ValueError(f"video: no such file {path!r}")
    try:
        import imageio.v3 as iio
    except ImportError:
        raise ValueError(
            f"video: reading {path!r} needs imageio (pip install imageio[ffmpeg]); or pass the "
            f"frames as a [F, H, W, 3] array or a list of images"
        ) from None
    return list(iio.imread(path))


def _pil_from_array(a: np.ndarray):
    from PIL import Image

    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] not in (3, 4):
        raise ValueError(f"image: an array must be uint8 [height, width, 3 or 4], got {a.dtype} {a.shape}")
    return Image.fromarray(a)


def _png(pil) -> bytes:
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
