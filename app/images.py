"""Images a client sends (a `data:` URL, or an http(s) URL on a host the operator allowed), decoded safely.

An image is the cheapest way for a client to make a server spend memory: a PNG of a few hundred bytes can declare
100,000 x 100,000 pixels, and decoding it would ask for 30 GB. So every bound here is checked before the work it
bounds: the base64 text's length before it is decoded (every 4 characters are 3 bytes), the body of a fetch while
it streams, and width x height from the header (`Image.open` reads only that) before a single
pixel is decoded. Pillow's own decompression-bomb guard (`Image.MAX_IMAGE_PIXELS`, a process-wide global) is left as
it is: changing it would change every other `Image.open` in the process. It runs inside `Image.open`, before ours
can, but it refuses only past twice its default of 89 million pixels, above any MAX_IMAGE_PIXELS may be (past the
default itself it merely warns), and its error is answered as ours. Nothing here reads or sets Pillow's globals.

Remote URLs are off unless IMAGE_URL_HOSTS names hosts: a server that fetches any URL a client sends is a proxy into
its own network (SSRF: cloud metadata at 169.254.169.254, admin ports on localhost). A redirect is followed only to
a host of the same list, and at most MAX_REDIRECTS times, since an allowed host's redirect is the classic way out of
an allow-list. The host is read by httpx's own URL parser, the one that connects, so no `user@host` or backslash
trick can make the check and the connection see two different hosts.

The decoded image is RGB: transparency composited onto white and EXIF rotation applied, as transformers'
`load_image` and `convert_to_rgb` do, so the model sees what a viewer shows. An animated GIF, APNG or WebP gives
its first frame (the frame count is never read: that would walk the whole file). Its digest hashes the decoded
pixels, not the bytes sent, so the prefix cache keys one picture once whether it came as PNG, WebP or BMP.

`load_image` is synchronous; the caller runs it in a worker thread (Pillow's decoders and the socket reads release
the GIL).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import time
from dataclasses import dataclass

import httpx
from PIL import Image, ImageOps, UnidentifiedImageError

from app.errors import InvalidRequest

# What OpenAI and Anthropic accept (PNG, JPEG, GIF, WebP), and BMP. Only these plugins are tried: Pillow also opens
# EPS (by running Ghostscript), TIFF (all of libtiff) and dozens of formats no client sends.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
MAX_REDIRECTS = 3  # enough for http -> https -> a canonical path; each hop is checked against IMAGE_URL_HOSTS
CHUNK = 64 * 1024


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 10 * 2**20  # encoded bytes per image (after base64 decode, or fetched)
    max_pixels: int = 16 * 2**20  # width*height per image, read from the header BEFORE decoding
    max_images: int = 8  # images per request
    max_image_tokens: int = 16384  # image tokens per request (checked by the caller after the processor)
    url_hosts: frozenset[str] = frozenset()  # hosts whose http(s) image URLs may be fetched; empty: remote URLs refused
    url_timeout_s: float = 10.0  # the whole fetch, redirects and body included

    @classmethod
    def from_settings(cls, settings) -> ImageLimits:
        return cls(max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels,
                   max_images=settings.max_images_per_request, max_image_tokens=settings.max_image_tokens,
                   url_hosts=frozenset(host.lower() for host in settings.image_url_hosts),
                   url_timeout_s=settings.image_url_timeout_s)


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image  # decoded, RGB, first frame of an animated image
    digest: str  # sha256 hex over (width, height, mode, raw RGB pixel bytes): the prefix cache keys on it


def check_image_count(n: int, limits: ImageLimits, field: str) -> None:
    if n > limits.max_images:
        raise InvalidRequest(f"`{field}` has {n:,} images; at most {limits.max_images:,} are accepted "
                             "(MAX_IMAGES_PER_REQUEST)", param=field, code="too_many_items")


def load_image(url: str, field: str, limits: ImageLimits) -> LoadedImage:
    """A client's image URL (`data:image/...;base64,...`, or http(s) on an allowed host) -> the decoded image and
    its digest; anything wrong with it is a 400 naming `field`."""
    if not isinstance(url, str) or not url.strip():
        raise bad_image(field, "the image URL is empty")
    if url[:5].lower() == "data:":
        data = decode_data_url(url, field, limits)
    elif url[:7].lower() == "http://" or url[:8].lower() == "https://":
        data = fetch(url, field, limits)
    else:
        what = f"a {url.partition(':')[0][:20]!r} URL" if ":" in url else "text without a scheme"
        raise bad_url(field, f"an image URL is a `data:image/...;base64,` URL or an http(s) URL, not {what}")
    return decode_image(data, field, limits)


def decode_data_url(url: str, field: str, limits: ImageLimits) -> bytes:
    """`data:image/png;base64,iVBOR...` -> its bytes, refused by length before anything is decoded."""
    head, comma, payload = url[5:].partition(",")
    params = [part.strip().lower() for part in head.split(";")]
    if not comma or not params[0].startswith("image/"):
        raise bad_image(field, "a data URL must be `data:image/<type>;base64,<data>`")
    if "base64" not in params[1:]:
        raise bad_image(field, "a data URL's image must be base64 (`;base64,`)")
    if not payload:
        raise bad_image(field, "the data URL holds no image")
    # Every 4 base64 characters are 3 bytes, less the `=` padding: the decoded size, known before decoding.
    size = len(payload) // 4 * 3 - payload[-2:].count("=")
    if size > limits.max_bytes:
        raise too_many_bytes(field, f"about {size:,}", limits)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):  # ValueError: a non-ASCII character
        raise bad_image(field, "the data URL's base64 is not valid") from None


_client_lock = threading.Lock()
_client: httpx.Client | None = None


def client() -> httpx.Client:
    """One client for every fetch, made at the first: its TLS context and connection pool are reused."""
    global _client
    with _client_lock:
        if _client is None:
            # Redirects are followed by `fetch` itself, each hop checked against the allow-list.
            _client = httpx.Client(follow_redirects=False, headers={"accept-encoding": "identity"})
        return _client


def fetch(url: str, field: str, limits: ImageLimits) -> bytes:
    """GET an image from an allowed host: within url_timeout_s in all, at most max_bytes of body, redirects only
    to allowed hosts."""
    if not limits.url_hosts:
        raise bad_url(field, "remote image URLs are off; set IMAGE_URL_HOSTS to allow named hosts")
    deadline = time.monotonic() + limits.url_timeout_s
    target = allowed_url(url, field, limits)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            with client().stream("GET", target, timeout=time_left(deadline)) as response:
                if response.is_redirect:
                    target = allowed_url(response.headers["location"], field, limits, base=response.url)
                    continue
                if response.status_code != 200:
                    raise bad_url(field, f"fetching the image URL got HTTP {response.status_code}")
                return read_body(response, deadline, field, limits)
        except httpx.TimeoutException:
            raise bad_url(field, f"fetching the image URL took over {limits.url_timeout_s:g} s "
                                 "(IMAGE_URL_TIMEOUT_S)") from None
        except httpx.HTTPError as err:
            raise bad_url(field, f"fetching the image URL failed: {type(err).__name__}") from None
    raise bad_url(field, f"the image URL redirects more than {MAX_REDIRECTS} times")


def allowed_url(url: str, field: str, limits: ImageLimits, base: httpx.URL | None = None) -> httpx.URL:
    """The URL (a redirect's Location read against `base`) as httpx will connect to it, if its scheme is http(s)
    and its host is listed."""
    try:
        parsed = base.join(url) if base is not None else httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise bad_url(field, "the image URL is not a valid URL") from None
    if parsed.scheme not in ("http", "https"):
        raise bad_url(field, f"the image URL leads to a {parsed.scheme!r} URL; only http(s) is fetched")
    if parsed.host not in limits.url_hosts:
        raise bad_url(field, f"the image URL's host {parsed.host!r} is not one IMAGE_URL_HOSTS allows")
    return parsed


def time_left(deadline: float) -> float:
    """Seconds to the fetch's deadline, for httpx's per-operation timeouts; past it, the fetch's own timeout."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise httpx.TimeoutException("deadline")
    return remaining


def read_body(response: httpx.Response, deadline: float, field: str, limits: ImageLimits) -> bytes:
    """The body, stopped as soon as it passes max_bytes or the deadline (a server may send it a byte at a time)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_many_bytes(field, f"{int(declared):,}", limits)
    body = bytearray()
    # iter_raw: the bytes as sent; identity was asked for, so a gzip'd body is not an image and not inflated here.
    for chunk in response.iter_raw(CHUNK):
        body += chunk
        if len(body) > limits.max_bytes:
            raise too_many_bytes(field, f"over {limits.max_bytes:,}", limits)
        time_left(deadline)
    return bytes(body)


def decode_image(data: bytes, field: str, limits: ImageLimits) -> LoadedImage:
    """Bytes -> RGB first frame and its digest, with width x height checked from the header first."""
    if len(data) > limits.max_bytes:  # exact, after the data URL's estimate
        raise too_many_bytes(field, f"{len(data):,}", limits)
    if not data:
        raise bad_image(field, "the image is empty")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as img:
            width, height = img.size  # from the header: nothing is decoded yet
            if width * height > limits.max_pixels:
                raise too_many_pixels(field, f"the image is {width:,} x {height:,} pixels", limits)
            img.load()  # the first frame only; an animation's other frames are never read
            ImageOps.exif_transpose(img, in_place=True)
            rgb = to_rgb(img)
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's guard, inside Image.open, fired before our check could (a warning only under `-W error`).
        raise too_many_pixels(field, "the image has more pixels than even Pillow's bomb guard opens", limits) from None
    except UnidentifiedImageError:
        raise bad_image(field, f"not an image this server reads ({', '.join(FORMATS)})") from None
    except Exception as err:  # noqa: BLE001 - any failure on a client's bytes is its bad image, not our 500
        detail = str(err)[:200] or type(err).__name__
        raise bad_image(field, f"the image could not be decoded (truncated or corrupt: {detail})") from None
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:{rgb.mode}:".encode())
    digest.update(rgb.tobytes())
    return LoadedImage(image=rgb, digest=digest.hexdigest())


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white as transformers' `convert_to_rgb` does (a bare `convert` would show
    whatever colour the transparent pixels happen to hold)."""
    if img.has_transparency_data:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def bad_image(field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"`{field}`: {what}", param=field, code="invalid_image")


def bad_url(field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"`{field}`: {what}", param=field, code="invalid_image_url")


def too_many_bytes(field: str, size: str, limits: ImageLimits) -> InvalidRequest:
    return InvalidRequest(f"`{field}`: the image is {size} bytes; at most {limits.max_bytes:,} are accepted "
                          "(MAX_IMAGE_BYTES)", param=field, code="image_too_large")


def too_many_pixels(field: str, what: str, limits: ImageLimits) -> InvalidRequest:
    return InvalidRequest(f"`{field}`: {what}; at most {limits.max_pixels:,} pixels "
                          "(width x height) are accepted (MAX_IMAGE_PIXELS)", param=field, code="image_too_large")
