"""An image part's URL -> its bytes and decoded image, within the engine's limits.

``data:`` URLs are always read. Anything else (a local path, ``file://``, ``s3://``, ``https://``, any
fsspec URL) only under a prefix the worker was started with (``EngineConfig.image_url_prefixes``):
a line must not make a worker read arbitrary files. A local path is resolved first (``..`` and links
cannot step out of an allowed folder). Every failure is a ValueError of one line naming the image, so
it fails its request alone.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any

from sluice.engine.config import EngineConfig


def load_image(url: str, config: EngineConfig) -> tuple[bytes, Any]:
    """(the image's bytes, the decoded RGB PIL image)."""
    data = _read(url, config)
    return data, decode_image(data, config, _name(url))


def _name(url: str) -> str:
    return "a data: URL image" if url.startswith("data:") else f"image {url[:200]!r}"


def _read(url: str, config: EngineConfig) -> bytes:
    if url.startswith("data:"):
        return _data_url(url, config)
    target = _allowed(url, config)
    limit = config.max_image_bytes
    try:
        import fsspec

        with fsspec.open(target, "rb") as f:
            data = f.read(limit + 1)
    except Exception as e:  # any store's error (missing file, no network, denied) fails this image alone
        raise ValueError(f"{_name(url)} could not be read: {type(e).__name__}: {str(e)[:200]}") from None
    if len(data) > limit:
        raise ValueError(f"{_name(url)} is over max_image_bytes ({limit} bytes)")
    return bytes(data)


def _allowed(url: str, config: EngineConfig) -> str:
    """The URL to open, if it lies under an allowed prefix; a local path becomes its resolved file:// URL."""
    target = url
    if "://" not in url:
        target = "file://" + os.path.realpath(url)
    elif url.startswith("file://"):
        target = "file://" + os.path.realpath(url.removeprefix("file://"))
    if not any(target.startswith(p) for p in config.image_url_prefixes):
        allowed = ", ".join(config.image_url_prefixes) or "none: data: URLs only"
        raise ValueError(f"{_name(url)} is not under an allowed image URL prefix ({allowed}; the worker's "
                         "--image-url-prefix)")
    return target


def _data_url(url: str, config: EngineConfig) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ValueError("an image data: URL must be base64 (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > config.max_image_bytes:
        raise ValueError(f"a data: URL image is over max_image_bytes ({config.max_image_bytes} bytes)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image data: URL is not valid base64") from None


def decode_image(data: bytes, config: EngineConfig, name: str = "the image") -> Any:
    """The RGB image; its pixel count is checked from the header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > config.max_image_pixels:
            raise ValueError(f"{name} is {w}x{h} = {w * h} pixels, over max_image_pixels ({config.max_image_pixels})")
        img.load()
        return img.convert("RGB")
    except ValueError:
        raise
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"{name} cannot be decoded: {type(e).__name__}: {str(e)[:200]}") from None
