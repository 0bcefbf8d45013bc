"""Images from the OpenAI API's `image_url` content parts (issue 65): a base64 data URL
(`data:image/png;base64,...`), or a `file://` URL under the folder the server allows
(`--allowed-local-media-path`, vLLM's flag). Nothing is fetched over the network.
Every refusal is a ValueError saying what is wrong with the URL; the caller names the
part.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

MAX_IMAGE_BYTES = 20 * 2**20  # an image's encoded bytes at most
MAX_IMAGE_PIXELS = 64 * 2**20  # width x height at most (a decompression bomb is refused)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what Pillow decodes of the formats clients send


def load_image_url(url: str, allowed_local_media_path: str | None = None) -> Image.Image:
    """The image an `image_url` part's URL holds, decoded (ValueError otherwise)."""
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url: must be a non-empty string")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return decode_image(data_url_bytes(url))
    if scheme == "file":
        return decode_image(local_file_bytes(url, allowed_local_media_path))
    if scheme in ("http", "https"):
        raise ValueError("image_url.url: this server fetches no images over the network; send the image as a "
                         "base64 data URL (data:image/png;base64,...)")
    raise ValueError(f"image_url.url: unsupported URL scheme {scheme or url[:20]!r}; send a base64 data URL")


def data_url_bytes(url: str) -> bytes:
    """The bytes of a base64 `data:image/...;base64,` URL."""
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise ValueError("image_url.url: a data URL must be data:image/<type>;base64,<data>")
    mime = header[len("data:"):-len(";base64")].lower()
    if not mime.startswith("image/"):
        raise ValueError(f"image_url.url: a data URL of type {mime or 'none'!r} is not an image")
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ValueError(f"image_url.url: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ValueError("image_url.url: the data URL's payload is not valid base64") from None


def local_file_bytes(url: str, allowed: str | None) -> bytes:
    """A `file://` URL's bytes, from under `allowed` only."""
    if allowed is None:
        raise ValueError("image_url.url: file URLs are off; start the server with --allowed-local-media-path DIR")
    path = Path(os.path.realpath(unquote(urlparse(url).path)))
    root = Path(os.path.realpath(allowed))
    if not path.is_relative_to(root) or not path.is_file():
        raise ValueError("image_url.url: no such file under the allowed local media path")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ValueError(f"image_url.url: the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
    return path.read_bytes()


def decode_image(data: bytes) -> Image.Image:
    """Bytes decoded as an image of a supported format and size, fully read."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError("image_url.url: the data is not an image Pillow can read") from None
    if image.format not in FORMATS:
        raise ValueError(f"image_url.url: image type {image.format} is not supported; send one of "
                         f"{', '.join(FORMATS)}")
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ValueError(f"image_url.url: the image is {image.width}x{image.height}, more than "
                         f"{MAX_IMAGE_PIXELS // 2**20} Mpx")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image_url.url: the image cannot be decoded ({e})") from None
    return image
