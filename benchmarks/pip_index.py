"""Find a pinned sdist through the package index pip is configured with, and fetch it checked by its sha256.

The index is read the way pip reads it: PIP_INDEX_URL, else the `index-url` that `pip config list` shows (its
`download` section over `install` over `global`), else pip's own default; then each `extra-index-url`. So a user
behind a mirror gets the mirror, and no host name is written here. Each index is asked for the project's page
through the simple API (PEP 691's JSON where the index speaks it, else PEP 503's HTML), and the pinned file is
taken from the first index that lists it. A hash the index gives must be the pinned one, and the download must
hash to it too; a download that does not is deleted, never unpacked.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

# As pip asks: JSON first, HTML (PEP 503) where the index has no JSON.
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
CONFIG_SECTIONS = (":env:", "download", "install", "global")  # pip's precedence, highest first


def pip_config() -> dict[str, str]:
    """`pip config list`'s values by key (`index-url`, ...), the highest-precedence section's value for each."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in CONFIG_SECTIONS:
            continue
        try:
            value = ast.literal_eval(value)  # pip prints each value as a Python literal
        except (ValueError, SyntaxError):
            continue
        rank = CONFIG_SECTIONS.index(section)
        if name not in found or rank < found[name][0]:
            found[name] = (rank, str(value))
    return {name: value for name, (_, value) in found.items()}


def pip_default_index() -> str:
    from pip._internal.models.index import PyPI  # pip's own default, so no host name is written here

    return PyPI.simple_url


def index_urls() -> list[str]:
    """The simple-API roots pip would search, in its order: the index, then each extra index."""
    config = pip_config()
    index = os.environ.get("PIP_INDEX_URL") or config.get("index-url") or pip_default_index()
    extras = os.environ.get("PIP_EXTRA_INDEX_URL") or config.get("extra-index-url") or ""
    return [index, *extras.split()]


class _Links(HTMLParser):
    """PEP 503: each file is an <a href="...#sha256=..."> whose text is its file name."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            url, _, fragment = self._href.partition("#")
            algo, _, digest = fragment.partition("=")
            self.files.append({"filename": data.strip(), "url": url, "hashes": {algo: digest} if digest else {}})
            self._href = None


def _open(url: str, accept: str | None = None):
    """urllib, with credentials written in the URL (a private mirror's user:token@) sent as Basic auth."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": accept} if accept else {}
    if parts.username:
        token = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(token.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
    if parts.scheme == "file" and Path(urllib.request.url2pathname(parts.path)).is_dir():
        url = url.rstrip("/") + "/index.html"  # a local index folder, as pip reads one
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=120)


def project_files(index: str, project: str) -> list[dict]:
    """The project's files on this index: [{"filename", "url" (absolute), "hashes"}]."""
    page = index.rstrip("/") + f"/{project}/"
    with _open(page, ACCEPT) as response:
        kind = response.headers.get_content_type()
        body = response.read().decode(response.headers.get_content_charset() or "utf-8")
    if kind == "application/vnd.pypi.simple.v1+json":
        files = json.loads(body)["files"]
    else:
        parser = _Links()
        parser.feed(body)
        files = parser.files
    return [{**f, "url": urllib.parse.urljoin(page, f["url"])} for f in files]


def find_sdist(project: str, filename: str, sha256: str, indexes: list[str] | None = None) -> tuple[str, str]:
    """(the file's URL, the index it came from) from the first index that lists `filename`. A listed sha256 other
    than the pinned one is refused before anything is downloaded."""
    tried = []
    for index in indexes or index_urls():
        try:
            files = project_files(index, project)
        except (OSError, ValueError, KeyError) as err:  # URLError is an OSError; bad JSON a ValueError
            tried.append(f"{_public(index)}: {err}")
            continue
        match = next((f for f in files if f["filename"] == filename), None)
        if match is None:
            tried.append(f"{_public(index)}: no {filename}")
            continue
        listed = (match.get("hashes") or {}).get("sha256")
        if listed and listed != sha256:
            raise ValueError(f"{_public(index)} lists {filename} with sha256 {listed}, expected {sha256}")
        return match["url"], index
    raise ValueError(f"{filename} not found on pip's configured indexes ({'; '.join(tried)})")


def download_sdist(target: Path, url: str, sha256: str) -> None:
    """Fetch to `target`; a download whose checksum is wrong (or that fails half way) is deleted, never unpacked."""
    partial, digest = target.with_name(target.name + ".partial"), hashlib.sha256()
    try:
        with _open(url) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise ValueError(f"{_public(url)} has sha256 {digest.hexdigest()}, expected {sha256}")
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)


def _public(url: str) -> str:
    """A URL without the credentials it may carry, for messages."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=host)) if parts.username else url
