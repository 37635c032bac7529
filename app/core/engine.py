"""The one owner of the model: a worker thread that admits requests and advances them step by step.

The asyncio event loop never runs model code. It calls `submit()`, which validates and queues the request and
returns a `RequestHandle` to iterate; the worker thread does all prefill and decode work and hands each token
event back to the event loop with `call_soon_threadsafe`.

Scheduling: every step first prefills newly admitted requests (in chunks, a bounded number of prompt tokens per
step), then advances every running request by one token in a single batched forward pass. A long generation
therefore never holds back another request's first token by more than one step, and N streams cost about one
weight read per step instead of N. `_step` is the only place that decides what runs together.

Backpressure: at most `max_active` sequences decode at once and at most `max_queue` wait; past that, `submit`
raises `Overloaded` at once, so memory never grows without bound.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import torch

from app.errors import Overloaded, ServeError, ShuttingDown
from app.core.batching import enable_packed_batching
from app.core.generate import Sequence, TokenEvent, check_request, choose_many, decode_step, forward_many, prefill
from app.metrics import Metrics
from app.models.loading import LoadedModel
from app.core.sampling import SamplingParams

log = logging.getLogger("app.core.engine")
_DONE = object()


def default_prefill_tokens_per_step(device: torch.device) -> int:
    """How many prompt tokens one engine step may prefill.

    A CPU prefill is compute-bound: 1,500 prompt tokens took 2.3 s here in chunks of 128, 256, 512 or in one
    piece, so small chunks cost nothing and let a burst of new requests take turns. In a burst of 8 ~125-token
    prompts, 128 per step gave a median time to first token of 358 ms against 609 ms with 512, at the same
    tokens/s. A GPU step is mostly fixed cost, so it takes far more per step (vLLM's chunked-prefill default;
    not measured here, where there is no GPU).
    """
    return 128 if device.type == "cpu" else 2048


class GenerationFailed(ServeError):
    """The model failed mid-generation (out of memory, say); the request ends with this error."""


@dataclass
class RequestHandle:
    """What a caller holds: an async iterator of TokenEvents, plus `cancel()`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            item = await self.events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _deliver(self, item: object) -> None:  # called from the worker thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Engine:
    """`model` is a LoadedModel, or a function that loads one: the worker thread then loads it itself.

    Loading in the worker matters on CPU: torch's OpenMP pool runs about 20% slower in a thread other than the
    first one that used it (measured here: 18 vs 22 tokens/s for Qwen2.5-0.5B in bf16), so the thread that will
    run every forward pass should also be the one that loads the weights.
    """

    def __init__(self, model: LoadedModel | Callable[[], LoadedModel], max_active: int = 8, max_queue: int = 64,
                 metrics: Metrics | None = None, prefill_tokens_per_step: int | None = None):
        self._load = model if callable(model) else (lambda: model)
        self.lm: LoadedModel | None = None
        self.loaded = threading.Event()  # set once the model is loaded, or failed to load
        self.load_error: BaseException | None = None
        self.batch_decode = False
        self.max_active = max_active
        self.max_queue = max_queue
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.metrics = metrics or Metrics()
        self.draining = False
        self._waiting: deque[RequestHandle] = deque()
        self._active: list[tuple[RequestHandle, Sequence | None]] = []  # None: admitted, not yet prefilled
        self._wake = threading.Condition()
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._sampling_pool: ThreadPoolExecutor | None = None

    # ---- called from the event loop ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def in_flight(self) -> int:
        with self._wake:
            return len(self._waiting) + len(self._active)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequest, Overloaded or ShuttingDown before any compute is spent."""
        if self.draining:
            raise ShuttingDown()
        max_new = check_request(prompt_ids, params, self.lm.vocab_size, self.lm.max_context)
        handle = RequestHandle(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, max_new,
                               asyncio.get_running_loop())
        with self._wake:
            if len(self._waiting) + len(self._active) >= self.max_active + self.max_queue:
                raise Overloaded(f"server is at capacity ({self.max_active} active, {self.max_queue} queued); "
                                 "retry shortly")
            self._waiting.append(handle)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()
        return handle

    # ---- the worker thread ----

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self.lm = self._load()
            self.batch_decode = enable_packed_batching(self.lm.model)
            if self.prefill_tokens_per_step is None:
                self.prefill_tokens_per_step = default_prefill_tokens_per_step(self.lm.device)
            if self.lm.device.type == "cpu":  # sampled rows side by side (see choose_many); GPU kernels are async
                # One torch thread per worker: with torch's default, each worker's own OpenMP team kept spinning
                # after sampling and slowed the next forward pass from 44 to 63 ms (batch 8, measured here).
                self._sampling_pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="sampling",
                                                         initializer=torch.set_num_threads, initargs=(1,))
        except BaseException as err:  # noqa: BLE001 - reported to whoever waits on `loaded`
            self.load_error = err
            return
        finally:
            self.loaded.set()
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._active):
                    self._wake.wait()
                if self._stopping:
                    break
                self._drop_cancelled()
                while self._waiting and len(self._active) < self.max_active:
                    self._active.append((self._waiting.popleft(), None))
                self.metrics.queue_depth.set(len(self._waiting))
                self.metrics.active_sequences.set(len(self._active))
                batch = list(self._active)
            self._step(batch)
        for handle, _ in self._active + [(h, None) for h in self._waiting]:
            handle._deliver(ShuttingDown("the engine stopped"))
        if self._sampling_pool is not None:
            self._sampling_pool.shutdown()

    def _drop_cancelled(self) -> None:
        """Free cancelled requests' caches; called with the lock held, so at most one step after cancel()."""
        for entry in [e for e in self._active if e[0].cancelled.is_set()]:
            self._active.remove(entry)
            self.metrics.cancellations.inc()
        for handle in [h for h in self._waiting if h.cancelled.is_set()]:
            self._waiting.remove(handle)
            self.metrics.cancellations.inc()

    def _step(self, batch: list[tuple[RequestHandle, Sequence | None]]) -> None:
        """One engine step: the next prefill chunk of new requests (at most `prefill_tokens_per_step` prompt tokens,
        so a long prompt never stalls running streams for long) and one token for every running request, all in
        one forward pass when the model allows it."""
        model, budget, work = self.lm.model, self.prefill_tokens_per_step, []
        for handle, seq in batch:
            if handle.cancelled.is_set():
                continue  # dropped at the next step's start
            if seq is None:
                try:
                    seq = Sequence(model, self.lm.tokenizer, handle.prompt_ids, handle.params, self.lm.eos_ids,
                                   self.lm.max_context)
                except Exception as err:  # noqa: BLE001
                    self._fail([handle], err)
                    continue
                self._replace(handle, seq)
            n = 1
            if seq.prefilling:
                n = min(budget, seq.prompt_len - seq.cache.get_seq_length())
                if n <= 0:
                    continue  # this step's prefill budget is spent; its turn comes next step
                budget -= n
            work.append((handle, seq, n))
        groups = [work] if self.batch_decode and work else [[entry] for entry in work]
        for group in groups:
            try:
                logits = self._forward(group)  # [len(group), vocab]
                # Rows whose prefill chunk was not the prompt's last have no token yet.
                rows = [row for row, (_, seq, _) in enumerate(group) if not seq.prefilling]
                ready = [group[row][:2] for row in rows]  # (handle, seq)
                for _, seq in ready:
                    if seq.n_generated == 0:
                        self.metrics.prompt_tokens.inc(seq.prompt_len)
                chosen = choose_many([seq for _, seq in ready], logits if len(rows) == len(group) else logits[rows],
                                     self._sampling_pool)
                events = [(handle, event) for (handle, _), event in zip(ready, chosen)]
            except Exception as err:  # noqa: BLE001 - one pass failing must not stop the engine
                self._fail([handle for handle, _, _ in group], err)
                continue
            for handle, event in events:
                self._emit(handle, event)

    def _forward(self, group: list[tuple[RequestHandle, Sequence, int]]) -> torch.Tensor:
        if self.batch_decode:
            return forward_many(self.lm.model, [(seq, n) for _, seq, n in group])
        (_, seq, n), = group  # models without packed attention: one request per pass
        return decode_step(self.lm.model, seq) if not seq.prefilling else prefill(self.lm.model, seq, n)

    def _emit(self, handle: RequestHandle, event: TokenEvent) -> None:
        self._record(handle, event)
        handle._deliver(event)
        if event.finish_reason:
            self.metrics.finished.labels(event.finish_reason).inc()
            self._finish(handle, _DONE)

    def _fail(self, handles: list[RequestHandle], err: Exception) -> None:
        log.error("generation failed for %s: %r", [h.request_id for h in handles], err)
        for handle in handles:
            self._finish(handle, GenerationFailed(f"generation failed: {type(err).__name__}: {err}"))

    def _replace(self, handle: RequestHandle, seq: Sequence) -> None:
        with self._wake:
            for i, (h, _) in enumerate(self._active):
                if h is handle:
                    self._active[i] = (handle, seq)

    def _finish(self, handle: RequestHandle, last: object) -> None:
        with self._wake:
            self._active = [(h, s) for h, s in self._active if h is not handle]
            self.metrics.active_sequences.set(len(self._active))
        self.metrics.request_duration.observe(time.perf_counter() - handle.submitted_at)
        handle._deliver(last)

    def _record(self, handle: RequestHandle, event: TokenEvent) -> None:
        now = time.perf_counter()
        if handle.first_token_at is None:
            self.metrics.time_to_first_token.observe(now - handle.submitted_at)
        else:
            self.metrics.inter_token_latency.observe(now - handle.last_token_at)
        handle.first_token_at = handle.first_token_at or now
        handle.last_token_at = now
        self.metrics.completion_tokens.inc()
