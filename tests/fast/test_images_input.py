"""Images as a client sends them (app/images.py): what decodes, what digest it gets, and the 400 each bad or too
large image gets, with the field it came in and the setting that bounds it. Remote URLs are fetched from a tiny
HTTP server on 127.0.0.1, the one host the tests allow."""

from __future__ import annotations

import base64
import io
import random
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from app.config import Settings
from app.errors import InvalidRequest
from app.images import ImageLimits, check_image_count, load_image

FIELD = "messages.0.content.1.image_url"


def picture(seed: int = 0, size: tuple[int, int] = (8, 6)) -> Image.Image:
    """A small RGB image of seeded noise (which no format compresses much)."""
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def encoded(img: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **save)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(url: str, limits: ImageLimits = ImageLimits()) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        load_image(url, FIELD, limits)
    assert err.value.status == 400 and err.value.param == FIELD and FIELD in err.value.message
    return err.value


def header_only_png(width: int, height: int) -> bytes:
    """A PNG of a few dozen bytes whose IHDR declares width x height RGB pixels: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024))
            + chunk(b"IEND", b""))


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_png_data_url_decodes_to_rgb_with_a_stable_digest_that_follows_the_pixels():
    first = load_image(data_url(encoded(picture(0))), FIELD, ImageLimits())
    assert first.image.mode == "RGB" and first.image.size == (8, 6)
    assert first.image.tobytes() == picture(0).tobytes()
    assert load_image(data_url(encoded(picture(0))), FIELD, ImageLimits()).digest == first.digest
    assert load_image(data_url(encoded(picture(1))), FIELD, ImageLimits()).digest != first.digest
    assert len(first.digest) == 64 and int(first.digest, 16) >= 0


def test_the_same_pixels_as_png_lossless_webp_and_bmp_share_one_digest():
    digests = {load_image(data_url(data, mime), FIELD, ImageLimits()).digest for data, mime in (
        (encoded(picture(3)), "image/png"), (encoded(picture(3), "WEBP", lossless=True), "image/webp"),
        (encoded(picture(3), "BMP"), "image/bmp"))}
    assert len(digests) == 1


def test_transparent_pixels_come_out_white_as_transformers_shows_them():
    img = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert load_image(data_url(encoded(img)), FIELD, ImageLimits()).image.getpixel((0, 0)) == (255, 255, 255)


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(io.BytesIO(gif)).n_frames == 3
    loaded = load_image(data_url(gif, "image/gif"), FIELD, ImageLimits())
    assert loaded.image.size == (16, 16) and loaded.image.getpixel((5, 5)) == (255, 0, 0)


@pytest.mark.parametrize("url,says", [
    ("", "empty"),
    ("data:image/png;base64,", "holds no image"),
    ("data:image/png;base64,@@not base64@@", "base64 is not valid"),
    ("data:text/plain;base64,aGVsbG8=", "data:image/<type>;base64,<data>"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), "not an image this server reads"),
    ("file:///etc/passwd", "not a 'file' URL"),
    ("ftp://example.com/cat.png", "not a 'ftp' URL"),
    ("/etc/passwd", "without a scheme"),
])
def test_what_is_not_an_image_url_is_a_400_saying_what_is_wrong(url, says):
    assert says in refused(url).message


def test_a_truncated_png_is_a_400_not_a_500():
    png = encoded(picture(0, (64, 64)))
    error = refused(data_url(png[: len(png) // 2]))
    assert error.code == "invalid_image" and "could not be decoded" in error.message


def test_past_max_image_bytes_a_400_before_the_base64_is_decoded():
    # Not valid base64 either: the length alone refuses it, so nothing was decoded.
    error = refused("data:image/png;base64," + "!" * 4000, ImageLimits(max_bytes=2048))
    assert "MAX_IMAGE_BYTES" in error.message and error.code == "image_too_large"
    png = encoded(picture(0, (64, 64)))
    assert len(png) > 2048 and "MAX_IMAGE_BYTES" in refused(data_url(png), ImageLimits(max_bytes=2048)).message
    assert load_image(data_url(png), FIELD, ImageLimits(max_bytes=len(png))).image.size == (64, 64)


@pytest.mark.parametrize("width,height", [(100_000, 100_000), (5000, 4000)])  # past Pillow's guard; past ours only
def test_a_header_declaring_too_many_pixels_is_refused_at_once_without_decoding(width, height):
    png = header_only_png(width, height)
    assert len(png) < 1200
    before, start = rss_bytes(), time.perf_counter()
    error = refused(data_url(png))
    assert time.perf_counter() - start < 1 and rss_bytes() - before < 50 * 2**20
    assert "MAX_IMAGE_PIXELS" in error.message and error.code == "image_too_large"


def test_under_max_image_pixels_the_same_header_is_decoded():
    img = load_image(data_url(encoded(picture(0, (20, 10)))), FIELD, ImageLimits(max_pixels=200))
    assert img.image.size == (20, 10)
    assert "20 x 10 pixels" in refused(data_url(encoded(picture(0, (20, 10)))), ImageLimits(max_pixels=199)).message


def test_a_remote_url_is_refused_until_image_url_hosts_names_its_host():
    assert "set IMAGE_URL_HOSTS" in refused("https://example.com/cat.png").message
    error = refused("https://example.com/cat.png", ImageLimits(url_hosts=frozenset({"images.example.com"})))
    assert "'example.com'" in error.message and "IMAGE_URL_HOSTS" in error.message
    # httpx's parser reads the host here as allowed.example.com, which is where it would connect
    assert "'allowed.example.com'" in refused("http://127.0.0.1\\@allowed.example.com/",
                                              ImageLimits(url_hosts=frozenset({"127.0.0.1"}))).message


PNG = encoded(picture(5))


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        port = self.server.server_address[1]
        routes = {"/cat.png": (200, {}, PNG), "/missing": (404, {}, b"no"),
                  "/big": (200, {"Content-Length": str(5000)}, b"\0" * 5000),
                  "/home": (302, {"Location": f"http://127.0.0.1:{port}/cat.png"}, b""),
                  "/away": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
                  "/loop": (302, {"Location": "/loop"}, b"")}
        if self.path == "/slow":
            time.sleep(0.6)
        if self.path == "/endless":  # no length: the body streams until the client stops reading
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"\0" * 1024)
            return
        status, headers, body = routes.get(self.path, (200, {}, PNG))
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.handle_error = lambda request, address: None  # a client that stopped reading (as it should) is no error
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


LOCAL = ImageLimits(max_bytes=4096, url_hosts=frozenset({"127.0.0.1"}), url_timeout_s=0.3)


def test_an_allowed_host_is_fetched_and_its_redirects_within_the_list_followed(server):
    assert load_image(f"{server}/cat.png", FIELD, LOCAL).digest == load_image(data_url(PNG), FIELD, LOCAL).digest
    assert load_image(f"{server}/home", FIELD, LOCAL).image.size == (8, 6)


@pytest.mark.parametrize("path,says", [
    ("/big", "MAX_IMAGE_BYTES"),  # refused on its Content-Length
    ("/endless", "MAX_IMAGE_BYTES"),  # refused as it streams past the bound
    ("/away", "'localhost' is not one IMAGE_URL_HOSTS allows"),
    ("/loop", "redirects more than 3 times"),
    ("/missing", "HTTP 404"),
    ("/slow", "IMAGE_URL_TIMEOUT_S"),
])
def test_a_fetch_that_goes_wrong_is_a_400_saying_why(server, path, says):
    assert says in refused(f"{server}{path}", LOCAL).message


def test_past_max_images_per_request_a_400_naming_the_setting():
    check_image_count(8, ImageLimits(), "messages")
    with pytest.raises(InvalidRequest) as err:
        check_image_count(9, ImageLimits(), "messages")
    assert err.value.param == "messages" and "MAX_IMAGES_PER_REQUEST" in err.value.message
    assert err.value.code == "too_many_items"


def test_the_limits_come_from_the_settings():
    settings = Settings(image_url_hosts="Images.Example.com, cdn.example.com", max_image_bytes="2MiB",
                        max_images_per_request=2, max_image_pixels=1000, image_url_timeout_s=3)
    limits = ImageLimits.from_settings(settings)
    assert limits == ImageLimits(max_bytes=2 * 2**20, max_pixels=1000, max_images=2,
                                 url_hosts=frozenset({"images.example.com", "cdn.example.com"}), url_timeout_s=3.0)
    assert ImageLimits.from_settings(Settings()) == ImageLimits()
    with pytest.raises(ValueError, match="IMAGE_URL_HOSTS takes names"):
        Settings(image_url_hosts="https://images.example.com/")
