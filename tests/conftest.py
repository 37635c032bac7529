"""Shared fixtures: a tiny random model with a real byte-level BPE tokenizer (built here, in seconds, offline),
the real embedded models (fetched by `make setup`), and a real uvicorn server on a loopback port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from benchmarks.processes import free_port, stop  # noqa: F401 (tests import them from here)

# torch, transformers (through app.models.loading) and uvicorn are imported where they are used: this file loads in
# xdist's controller process too, which runs no test, and importing them there cost 6 s of CPU (on a Zen 3) that the
# two workers, collecting on the same two cores meanwhile, waited for.
if TYPE_CHECKING:
    from app.models.loading import LoadedModel

MODEL_CACHE = Path(os.environ.get("MODEL_CACHE", Path.home() / ".cache" / "simple-serve"))
CORPUS = [
    "The capital of France is Paris. Paris is a city on the Seine.",
    "def reverse(s):\n    return s[::-1]\n\nprint(reverse('hello world'))",
    "北京是中国的首都。上海是一个大城市。你好，世界！",
    "Emoji are fun: 😀 🎉 🚀 and so is café, naïve, and façade.",
    "Stop strings like ### or <END> or \n\n end a generation early.",
] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def pytest_configure(config):
    """The order files are handed out in (HeavyFilesFirst). `make test-avx2` runs this suite under qemu with an
    AVX2-only CPU model and says so through TEST_EXPECT_AVX2_ONLY: a broken emulator that let torch see AVX-512
    would pass the pass without testing it."""
    config.pluginmanager.register(HeavyFilesFirst())
    config.pluginmanager.register(HELD)
    if os.environ.get("TEST_EXPECT_AVX2_ONLY"):
        from app.models.cpu import cpu_features

        cpu = cpu_features()
        if not (cpu.aten_capability == "AVX2" and not cpu.flags):
            raise pytest.UsageError(f"TEST_EXPECT_AVX2_ONLY is set, but this CPU shows {cpu.describe()}")
        print(f"test-avx2: emulated {cpu.describe()}")


def pytest_collection_modifyitems(config, items):
    """TEST_REAL_MODEL_FILES (space-separated test files): real-model tests run only in those, so that one emulated
    pytest process covers both of `make test-avx2`'s lists (each process costs half a minute to start there).

    A `compile` test lives in tests/compile/: `make test`'s compile pass collects that folder alone (collecting every
    folder costs it half a minute), and its other passes leave `compile` tests out, so one elsewhere would never run."""
    stray = [i.nodeid for i in items if i.get_closest_marker("compile") and i.path.parent.name != "compile"]
    if stray:
        raise pytest.UsageError(f"marked compile but outside tests/compile/: {stray}")
    files = os.environ.get("TEST_REAL_MODEL_FILES")
    if files is None:
        return
    keep = {Path(f).name for f in files.split()}
    dropped = [i for i in items if i.get_closest_marker("real_model") and i.path.name not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [i for i in items if i not in dropped]


class HeavyFilesFirst:
    """The parallel pass (`--dist loadfile --no-loadscope-reorder`) hands out files in the order collected here: the
    files that load a real model first, then those that start a server or a browser, then the rest by their count
    of tests, most first (xdist's own order). A worker takes a file when it is nearly done with its last, so a
    minutes-long file handed out last kept one worker busy while the other sat idle (71 s at the end of one pass
    here); with the long files first, the last ones handed out take seconds. Marks are read after `-m` has
    deselected, so a lane that leaves a file's real-model test out does not count it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        by_file: dict[Path, list] = {}
        for item in items:
            by_file.setdefault(item.path, []).append(item)

        def weight(path: Path) -> tuple[int, int]:
            file_items = by_file[path]
            marks = {m.name for item in file_items for m in item.iter_markers()}
            rank = 0 if "real_model" in marks else 1 if marks & {"server", "browser"} else 2
            return rank, -len(file_items)

        items[:] = [item for path in sorted(by_file, key=weight) for item in by_file[path]]


def build_tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE small enough that Chinese characters and emoji span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(vocab_size: int, arch: str = "qwen2", seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_class(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; sharpen them so greedy ties cannot make comparisons flaky.
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny model and tokenizer saved as a Hugging Face directory, for tests that go through load_model."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_tokenizer) -> LoadedModel:
    from app.models.loading import LoadedModel

    model = build_tiny_model(len(tiny_tokenizer))
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return LoadedModel(model=model, tokenizer=tiny_tokenizer, name="tiny", max_context=256, eos_ids=(im_end,),
                       generation_defaults={"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                            "repetition_penalty": 1.1})


def _real(name: str, dtype: str) -> LoadedModel:
    from app.models.fetch import fetch_model
    from app.models.loading import load_model

    return load_model(str(fetch_model(name, MODEL_CACHE)), device="cpu", dtype=dtype)


class HeldWhileFilesUseThem:
    """What a worker holds across files only while the files it runs use it: an fp32 real model (2.4 GB for the
    default one) and the shared real-model server process (4.9 GB in fp32, its weights and their packed copies).

    Held for the whole session, as they were, a worker kept each for every later file: on a 24 GB AVX2-only Zen 3,
    where both models load in fp32, the two workers held two shared servers, each its own fp32 models and one an
    adapter test's three copies, and the kernel's OOM killer stopped a worker. The fixtures are module-scoped and
    take their value from here; after a file's last test, what the next file on this worker does not use is let go
    (consecutive files that use one keep it: the heavy files are handed out first, together)."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[object, Callable[[], None]]] = {}

    def get(self, name: str, make: Callable[[], tuple[object, Callable[[], None]]]) -> object:
        if name not in self.held:
            self.held[name] = make()
        return self.held[name][0]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        yield  # the module's fixtures are finalized first, so that nothing but self.held refers to them
        if not self.held or (nextitem is not None and nextitem.path == item.path):
            return
        wanted = set() if nextitem is None else {
            name for other in item.session.items if other.path == nextitem.path for name in other.fixturenames}
        dropped = [name for name in self.held if name not in wanted]
        for name in dropped:
            self.held.pop(name)[1]()
        if dropped:
            import gc

            from app.heap import release_free_heap

            gc.collect()  # a model's modules refer to each other; their tensors go only with the cycle
            release_free_heap()

    def pytest_sessionfinish(self):
        """A run stopped early (-x, Ctrl-C) still stops the server process it started."""
        while self.held:
            self.held.popitem()[1][1]()


HELD = HeldWhileFilesUseThem()


@pytest.fixture(scope="module")
def qwen_fp32() -> LoadedModel:
    return HELD.get("qwen_fp32", lambda: (_real("qwen2.5-coder-0.5b-instruct", "float32"), lambda: None))


@pytest.fixture(scope="module")
def smollm_fp32() -> LoadedModel:
    return HELD.get("smollm_fp32", lambda: (_real("smollm2-135m-instruct", "float32"), lambda: None))


def wait_until_ready(url: str, timeout: float, exited=lambda: None, interval: float = 0.05) -> None:
    """Poll GET {url}/ready until 200; `exited()` returns a reason when the server died meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (reason := exited()) is not None:
            raise RuntimeError(reason)
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


@contextlib.contextmanager
def serve_process(model, log: Path, *args: str, env: dict | None = None, launch: tuple = ("-m", "app"),
                  clean_log: bool = True) -> Iterator[str]:
    """`python -m app serve --model MODEL --port P *args` in a process of its own, as an operator starts it, its
    output in `log`, with `env` over this process's environment. Yields its URL once /ready answers 200; then a
    SIGTERM (a kill after 30 s) and, with `clean_log`, a log with no traceback in it."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *launch, "serve", "--model", str(model), "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, timeout=120, exited=lambda: proc.poll())
        yield url
    finally:
        stop(proc)
    if clean_log:
        text = Path(log).read_text()
        assert "Traceback" not in text, text[-3000:]


class ThreadServer:
    """A real uvicorn server on a loopback port, in a background thread of the test process."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        wait_until_ready(self.url, timeout=120)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def state(self):
        return self.app.state.serve


@pytest.fixture(scope="module")
def shared_real_server(request, tmp_path_factory):
    """One `python -m app serve` process on the default model, with an API key (test_server_real.API_KEY), for the
    real clients' tests (the anthropic SDK, pydantic-ai, instructor, the openai SDK's tools, LangChain, the Agents
    SDK): each start costs ~10 s of the lane, and none of them changes the server's settings. Its log is printed
    when a test failed while it ran."""
    from test_server_real import finish, started

    def start():
        failed_before = request.session.testsfailed
        srv = started(tmp_path_factory, "shared", MAX_ACTIVE="4", API_KEY=request.getfixturevalue("real_api_key"),
                      SHUTDOWN_GRACE_S="5")
        return srv, lambda: finish(srv, request.session.testsfailed > failed_before)

    return HELD.get("shared_real_server", start)


@pytest.fixture(scope="session")
def real_api_key() -> str:
    from test_server_real import API_KEY

    return API_KEY


@pytest.fixture(scope="session")
def tiny_vlm() -> LoadedModel:
    """A tiny random LLaVA (tests/vision_models.py) as the server loads a vision model: its language model for the
    engine, its vision tower and processor for a request's images."""
    import torch

    from app.models.loading import LoadedModel
    from app.models.vision import VisionEncoder, text_model
    from vision_models import build

    vlm, processor = build("llava")
    tok = processor.tokenizer
    return LoadedModel(model=text_model(vlm), tokenizer=tok, name="tiny-llava", max_context=512,
                       eos_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
                       vision=VisionEncoder(vlm, processor, torch.float32))


@pytest.fixture
def make_vision_server(tiny_vlm):
    """Build a server around the tiny LLaVA with the given settings; closed at the end of the test."""
    from app.config import Settings
    from app.main import create_app

    servers: list[ThreadServer] = []

    def make(**settings) -> ThreadServer:
        app = create_app(Settings(model="tiny-llava", **settings), lm=tiny_vlm)
        servers.append(ThreadServer(app).__enter__())
        return servers[-1]

    yield make
    for server in servers:
        server.__exit__()


@pytest.fixture
def make_tiny_server(tiny_lm):
    """Build a server around the tiny model with the given settings; closed at the end of the test."""
    from app.config import Settings
    from app.main import create_app

    servers: list[ThreadServer] = []

    def make(**settings) -> ThreadServer:
        app = create_app(Settings(model="tiny", **settings), lm=tiny_lm)
        servers.append(ThreadServer(app).__enter__())
        return servers[-1]

    yield make
    for server in servers:
        server.__exit__()
