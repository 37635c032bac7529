"""The server process: uvicorn around create_app() (app/main.py), with a graceful drain on SIGTERM, the process's
log handler, and the follower ranks of tensor parallelism, which serve no HTTP."""

from __future__ import annotations

import logging
import os
import signal
import time
from functools import partial

import uvicorn

from app import progress
from app.config import Settings
from app.core.engine.tensor_parallel import run_follower
from app.errors import ShuttingDown
from app.logs import JsonFormatter, LogFormatter
from app.main import create_app
from app.models.distributed import launched_rank
from app.models.loading import load_model
from app.request_id import RequestIdFilter
from app.state import ServerState

REPEAT_S = 1.0  # the same signal again within this long is the same request to stop, delivered twice


class GracefulServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains first: /ready and new requests answer 503 while in-flight requests finish,
    for at most `shutdown_grace_s`. Then whatever is still generating is ended with an error (a stream gets an
    error event and `[DONE]`, never a cut), and the server exits once those responses are out, or
    `ABORT_FLUSH_S` later. A second signal exits at once. If the engine dies, the process exits with code 1."""

    ABORT_FLUSH_S = 5.0

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.drain_deadline: float | None = None
        self.flush_deadline: float | None = None
        self.first_signal: tuple[int, float] | None = None  # the signal that started the drain, and when
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        now = time.monotonic()
        if self.first_signal is not None and sig == self.first_signal[0] and now - self.first_signal[1] < REPEAT_S:
            return  # one shutdown delivered twice: `make serve` forwards the SIGTERM its process group also got
        if self.drain_deadline is not None or sig == signal.SIGINT and self.should_exit:
            self.should_exit = self.force_exit = True
            return
        logging.getLogger("app").info("signal %s: draining for up to %.0f s", sig, self.state.settings.shutdown_grace_s)
        self.first_signal = (sig, now)
        self.state.start_drain()
        self.drain_deadline = now + self.state.settings.shutdown_grace_s

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's shutdown then, and its lifespan task dies with a traceback
            await self.lifespan.shutdown()  # stops the engine: a step or two

    async def on_tick(self, counter: int) -> bool:
        if self.state.load_error:
            self.exit_code = 1
            return True
        if self.state.engine_error and self.state.idle:  # its requests have had their errors: restart us
            logging.getLogger("app").error("%s; exiting", self.state.engine_error)
            self.exit_code = 1
            return True
        if self.drain_deadline is not None:
            now = time.monotonic()
            if self.state.idle:
                return True  # uvicorn's own shutdown then lets open responses finish
            if self.flush_deadline is None and now >= self.drain_deadline:
                logging.getLogger("app").warning("grace period over with requests in flight; ending them")
                self.state.engine.abort_all(ShuttingDown(
                    "the server is shutting down and its grace period ended before this generation finished"))
                self.flush_deadline = now + self.ABORT_FLUSH_S
            if self.flush_deadline is not None and now >= self.flush_deadline:
                self.force_exit = True
                return True
        return await super().on_tick(counter)


def log_to_stderr(level: str, fmt: str, log_format: str = "plain") -> None:
    """Every logger's records, uvicorn's included, through app/logs.py's formatter: one line per message, and
    tracebacks bounded; LOG_FORMAT=json: one JSON object per line. Each record carries its request's id."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else LogFormatter(fmt))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if log_format == "json":  # progress bars are not log lines: off, and our notes become records
        import huggingface_hub.utils
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
        progress.as_log_records = True


def run_server(settings: Settings) -> int:
    log_to_stderr(settings.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s", settings.log_format)
    if settings.tensor_parallel > 1:
        launched_rank(settings.tensor_parallel)  # torchrun started us, one process per rank: say how otherwise
    app = create_app(settings)
    # JSON: uvicorn's own lines ("Started server process"...) go through the root handler too (its default config
    # gives them a plain handler of their own), so that every line is one JSON object.
    json_logs = {"log_config": None} if settings.log_format == "json" else {}
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
                            **json_logs)
    server = GracefulServer(config, app.state.serve)
    server.run()
    return server.exit_code


def run_tensor_parallel_follower(settings: Settings) -> int:
    """Ranks > 0 under `--tensor-parallel`: no HTTP, only rank 0's passes on this rank's shard."""
    log_to_stderr(settings.log_level, f"%(asctime)s %(levelname)s rank{os.environ.get('RANK')} %(name)s: %(message)s")
    s = settings
    return run_follower(partial(load_model, s.model, s.device, s.dtype, s.model_cache, s.max_model_len,
                                prepack=s.prepack, quant=s.quant, tensor_parallel=s.tensor_parallel))
