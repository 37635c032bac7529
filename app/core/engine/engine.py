"""The one owner of the model: a worker thread that admits requests and advances them step by step.

The asyncio event loop never runs model code. It calls `submit()`, which validates and queues the request and
returns a `RequestHandle` to iterate; the worker thread does all prefill and decode work and hands each token
event back to the event loop with `call_soon_threadsafe`.

This file is the requests' bookkeeping: the queue, admission, the KV budget, and how each request ends. What one
step runs, in which forward passes, and which tokens those yield is app/core/engine/step.py's `StepRunner`: every step,
the worker hands it the admitted requests, and it calls back here as each one starts, yields a token or fails.

Backpressure: at most `max_active` sequences decode at once and at most `max_queue` interactive requests wait;
past that, `submit` raises `Overloaded` at once.

Priority classes: interactive (API clients) or background (batch lines; BATCH_CONCURRENCY bounds them). The queue
is ordered by class, `priority`, arrival, so batch lines run in the slots users leave free; and up to `batch_slots`
of them may hold a slot even while users queue (`next_to_admit`): steady traffic slows a batch, never stops it.
Each class counts against `max_queue` alone, so batch lines never turn a user's request into a 429.

A request is admitted only when its worst-case KV cache (prompt + max_tokens) fits the KV budget
(app/core/engine/kv_budget.py); until then it waits, so memory never grows without bound.

Deadlines (each request's own, set by the caller at submit): checked at the start of every step, so a request
ends at most one step late. A request still queued past its queue deadline (or its whole deadline) ends with
`QueueTimeout` and never starts; a running one past its deadline ends there with a last event that carries no
token and finish reason "timeout", and its slot, KV and grammar state go with its Sequence.

Failures: a forward pass that raises fails only that pass's requests (after an out-of-memory error, its rows are
first retried in smaller groups, see app/core/engine/step.py); the engine keeps serving. If the worker thread itself dies,
every request in flight or queued gets `EngineDead`, later submits too, and `alive` turns False for the probes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from app.errors import ConfigError, Overloaded, QueueTimeout, ServeError, ShuttingDown
from app.core.runner.packed import enable_packed_batching
from app.core.sequence import NO_TOKEN, Sequence, TokenEvent, check_request
from app.core.engine.handle import (DONE, EngineDead, GenerationFailed, RequestHandle, enqueue_by_priority,
                                    next_to_admit, without_frames)
from app.heap import release_free_heap
from app.core.engine.kv_budget import KVBudget, KVLayout, default_kv_cache_bytes, export_kv_cache_gauges
from app.core.engine.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache, keeps_all_keys
from app.core.runner.static_step import build_decode_step
from app.core.engine.step import StepRunner, default_prefill_tokens_per_step
from app.metrics import UNSCRAPED, Metrics
from app.models.loading import LoadedModel
from app.models.lora import LoraAdapter, LoraAdapters
from app.core.sampling import SamplingParams

log = logging.getLogger("app.core.engine.engine")


def _past(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


class Engine:
    """`model` is a LoadedModel, or a function that loads one: the worker thread then loads it itself.

    Loading in the worker matters on CPU: torch's OpenMP pool runs about 20% slower in a thread other than the
    first one that used it (measured here: 18 vs 22 tokens/s for Qwen2.5-0.5B in bf16), so the thread that will
    run every forward pass should also be the one that loads the weights.
    """

    def __init__(self, model: LoadedModel | Callable[[], LoadedModel], max_active: int = 8, max_queue: int = 64,
                 metrics: Metrics | None = None, prefill_tokens_per_step: int | None = None,
                 kv_cache_bytes: int | None = None, packed_batching: bool = True, prefix_cache_bytes: int = 0,
                 speculative: str = "off", decode_step: str = "eager", adapters: LoraAdapters | None = None,
                 batch_slots: int = 1):
        self._load = model if callable(model) else (lambda: model)
        self.lm: LoadedModel | None = None
        self.loaded = threading.Event()  # set once the model is loaded, or failed to load
        self.load_error: BaseException | None = None
        self.died: BaseException | None = None  # why the worker thread stopped serving, if it did
        self.packed_batching = packed_batching  # False: one request per pass even where packing works
        self.batch_decode = False
        self.kv_cache_bytes = kv_cache_bytes  # None: default_kv_cache_bytes() once the model is loaded
        self.kv_layout: KVLayout | None = None
        self.kv_budget: KVBudget | None = None
        self.prefix_cache_bytes = prefix_cache_bytes  # 0: off
        self.prefix_cache: PrefixCache | None = None
        self.speculative = speculative  # "ngram" | "off"
        self.decode_step = decode_step  # "eager" | "compiled" (app/core/runner/static_step.py)
        self.adapters = adapters  # LoRA: the model's linears made adaptable at load, the start-up adapters loaded
        self._abort: ServeError | None = None
        self.max_active, self.max_queue = max_active, max_queue
        # the background class's share (module docstring); interactive requests always keep at least one slot
        self.batch_slots = max(0, min(batch_slots, max_active - 1))
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
        self._runner: StepRunner | None = None  # built in the worker once the model is loaded
        # Forward progress, on the monotonic clock, for /health/generate: when the current (or last) step began,
        # and when the last one ended.
        self.step_started_at = self.step_ended_at = 0.0

    # ---- called from the event loop ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        """The worker thread is loading or serving (False once it died, failed to load, or was stopped)."""
        if self.died is not None or self.load_error is not None or self._stopping:
            return False
        return self._thread.is_alive() or not self._thread.ident  # not started yet counts as alive

    @property
    def in_flight(self) -> int:
        with self._wake:
            return len(self._waiting) + len(self._active)

    def abort_all(self, err: ServeError) -> None:
        """End every request in flight or queued with `err`, at the next step (the drain's deadline uses this)."""
        with self._wake:
            self._abort = err
            self._wake.notify()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               queue_deadline: float | None = None, deadline: float | None = None,
               adapter: LoraAdapter | None = None, traffic: bool = True, background: bool = False,
               images: object | None = None) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequest, Overloaded or ShuttingDown before any compute is spent.
        The deadlines are `time.perf_counter()` times (see the module docstring). `adapter`: the LoRA adapter this
        request runs with (the handle holds it to the end); None: the base model. `traffic=False`: the server's
        own generation (a probe), kept out of the request metrics (the gauges still see it: it holds a slot).
        `background`: the batch class (see the module docstring). `images`: the prompt's image embeddings
        (app/models/vision.py's ImagePrompt), written over its placeholders when its prefill runs."""
        if self.draining:
            raise ShuttingDown()
        max_new = check_request(prompt_ids, params, self.lm.vocab_size, self.lm.max_context)
        kv_bytes = self.kv_budget.request_bytes(self.kv_layout, len(prompt_ids), max_new)  # 400 if it never fits
        handle = RequestHandle(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, max_new,
                               asyncio.get_running_loop(), kv_bytes=kv_bytes, queue_deadline=queue_deadline,
                               deadline=deadline, adapter=adapter, metrics=self.metrics if traffic else UNSCRAPED,
                               background=background, images=images)
        with self._wake:
            if self.died is not None or self._stopping:
                raise EngineDead(f"the engine has stopped: {self.died!r}" if self.died else "the engine has stopped")
            held = sum(h.background == background for h in [*self._waiting, *(h for h, _ in self._active)])
            if held >= self.max_active + self.max_queue:  # each class against its own: batch lines never 429 a user
                raise Overloaded(f"server is at capacity ({self.max_active} active, {self.max_queue} queued); "
                                 "retry shortly")
            enqueue_by_priority(self._waiting, handle)
            handle.metrics.adapter_series.count_request(handle.adapter)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()
        return handle

    # ---- the worker thread ----

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self.lm = self._load()
            if self.adapters is not None:  # before the compiled step is traced: it sees the wrapped layers
                self.adapters.attach(self.lm.model)
            self.batch_decode = self.packed_batching and enable_packed_batching(self.lm.model, self.lm.decode_attention)
            if self.lm.batch_invariant and not self.batch_decode:  # its chunks' attention depends on the budget
                self.lm.invariance_cannot_hold("this model runs one request per pass on its own attention, whose "
                                               "prompt chunks depend on what else prefills")  # on: ConfigError
            self._set_up_kv_budget()
            self._set_up_shortcuts()
            export_kv_cache_gauges(self.metrics, self.kv_budget, self.kv_layout, lambda: self.prefix_cache,
                                   DEFAULT_BLOCK_SIZE)
            if self.prefill_tokens_per_step is None:
                self.prefill_tokens_per_step = default_prefill_tokens_per_step(self.lm.device)
            if self.lm.device.type == "cpu":  # sampled rows side by side (see choose_many); GPU kernels are async
                # One torch thread per worker: with torch's default, each worker's own OpenMP team kept spinning
                # after sampling and slowed the next forward pass from 44 to 63 ms (batch 8, measured here).
                self._sampling_pool = ThreadPoolExecutor(torch.get_num_threads(), thread_name_prefix="sampling",
                                                         initializer=torch.set_num_threads, initargs=(1,))
            # The hooks look this engine's methods up at each call, so an override or patch made later applies.
            self._runner = StepRunner(self.lm, self.metrics, self.kv_budget, self.prefix_cache,
                                      self.speculative != "off", self.batch_decode, self.prefill_tokens_per_step,
                                      self._sampling_pool, started=lambda handle, seq: self._replace(handle, seq),
                                      emit=lambda handle, event: self._emit(handle, event),
                                      fail=lambda handles, err: self._fail(handles, err),
                                      static_decode=self._set_up_static_decode())
        except BaseException as err:  # noqa: BLE001 - reported to whoever waits on `loaded`
            self.load_error = err
            return
        finally:
            self.loaded.set()
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - a bug in the loop: nobody may be left waiting
            log.exception("the engine thread died")
            self._end_all(EngineDead(f"the engine stopped after an internal error: {type(err).__name__}: {err}"),
                          "error", died=err)
        else:
            self._end_all(ShuttingDown("the engine stopped"))
        finally:
            if self._sampling_pool is not None:
                self._sampling_pool.shutdown(wait=False)

    def _set_up_kv_budget(self) -> None:
        self.kv_layout = KVLayout.from_config(self.lm.model.config, self.lm.dtype, int8=self.lm.kv_int8)
        capacity = self.kv_cache_bytes if self.kv_cache_bytes is not None else default_kv_cache_bytes(self.lm.device)
        self.kv_budget = KVBudget(capacity)
        self.metrics.kv_cache_budget.set(capacity)
        tokens = capacity // max(1, self.kv_layout.bytes_per_token)
        log.info("KV cache budget %.2f GiB: %d bytes per token, room for %d tokens (%.1f full contexts of %d)",
                 capacity / 2**30, self.kv_layout.bytes_per_token, tokens, tokens / self.lm.max_context,
                 self.lm.max_context)

    def _set_up_shortcuts(self) -> None:
        """The prefix cache takes its bytes from the KV budget, and gives them back when a request needs them."""
        full_attention = keeps_all_keys(self.lm.model.config)
        if self.prefix_cache_bytes > 0 and full_attention:
            self.prefix_cache = PrefixCache(self.prefix_cache_bytes, budget=self.kv_budget)
            self.kv_budget.add_reclaimer(self.prefix_cache.evict, self.prefix_cache.reclaimable)
            self.metrics.prefix_cache_bytes.set_function(lambda: self.prefix_cache.bytes)
        if self.speculative != "off" and not (self.batch_decode and full_attention):
            log.info("speculative decoding is off: drafts are verified in the packed pass and cropped afterwards, "
                     "which this model's attention does not allow")
            self.speculative = "off"

    def _set_up_static_decode(self):
        """DECODE_STEP=compiled: the pool is KV like any other, so it is charged to the budget, set aside for good.
        It gets at most half: the requests' own caches (while they prefill, or after a full pool moved them out)
        reserve the rest, each its worst case as always, so KV memory stays within KV_CACHE_BYTES."""
        if self.decode_step != "compiled":
            return None
        if self.lm.batch_invariant:  # a row's numbers would depend on its batch bucket and the block table's width
            raise ConfigError("DECODE_STEP=compiled runs decode rows in shapes padded to the batch, which "
                              "BATCH_INVARIANT=on rules out; set DECODE_STEP=eager or BATCH_INVARIANT=off",
                              param="decode_step")
        step = build_decode_step(self.lm, self.max_active, self.kv_budget.capacity // 2, batch_decode=self.batch_decode)
        if step is not None:
            self.kv_budget.set_aside(step.pool, step.pool.nbytes)
        return step

    def _serve(self) -> None:
        while True:
            with self._wake:
                idle = not (self._stopping or self._waiting or self._active)
            if idle:
                release_free_heap()
            with self._wake:
                while not (self._stopping or self._waiting or self._active):
                    self._wake.wait()
                if self._stopping:
                    return
                if self._abort is not None:  # the drain's deadline
                    err, self._abort = self._abort, None
                    self._end_all(err)
                    continue
                self._drop_cancelled()
                self._expire()
                self._admit()
                batch = list(self._active)
                self.step_started_at = time.monotonic()
            self._runner.run_step(batch)
            self.step_ended_at = time.monotonic()
            del batch  # an idle engine must not keep the last step's finished sequences (and their KV) alive
            self._update_kv_in_use()

    def _admit(self) -> None:
        """In queue order (class, priority, arrival), but for the batch's share: admit while a slot is free and the
        next request's worst-case KV cache fits the budget; otherwise it waits for running requests to end. Called
        with the lock held."""
        while self._waiting and len(self._active) < self.max_active:
            handle = next_to_admit(self._waiting, sum(h.background for h, _ in self._active), self.batch_slots)
            if not self.kv_budget.reserve(handle, handle.kv_bytes):
                break
            self._waiting.remove(handle)
            self._active.append((handle, None))
            handle._admitted()
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.active_sequences.set(len(self._active))
        self.metrics.kv_cache_reserved.set(self.kv_budget.in_use)

    def _update_kv_in_use(self) -> None:
        with self._wake:
            held = [seq.cache.get_seq_length() for _, seq in self._active if seq is not None]
        self.metrics.kv_cache_in_use.set(sum(self.kv_layout.bytes_for(tokens) for tokens in held))

    def _drop_cancelled(self) -> None:
        """Free cancelled requests' caches; called with the lock held, so at most one step after cancel()."""
        gone = {h for h, _ in self._active if h.cancelled.is_set()} | {h for h in self._waiting if h.cancelled.is_set()}
        self._active = [(h, s) for h, s in self._active if h not in gone]
        self._waiting = deque(h for h in self._waiting if h not in gone)
        for handle in gone:
            self.kv_budget.release(handle)
            handle._deliver(DONE)  # whoever still iterates it (a failed choice's sibling, say) is not left waiting
            if handle.client_left:
                handle.metrics.cancellations.inc()
            else:
                handle.metrics.finished.labels("abort").inc()

    def _expire(self) -> None:
        """End the requests whose deadlines have passed (see the module docstring); called with the lock held."""
        now = time.perf_counter()
        late = [h for h in self._waiting if _past(h.queue_deadline, now) or _past(h.deadline, now)]
        for handle in late:
            self._waiting.remove(handle)
            handle.never_started = QueueTimeout(f"the request waited {now - handle.submitted_at:.1f} s for a "
                                                "decode slot, past its limit, and was not started; retry shortly "
                                                "or on another replica")
            handle.metrics.deadlines_exceeded.labels("queue").inc()
            handle._deliver(handle.never_started)
        for handle, seq in [(h, s) for h, s in self._active if _past(h.deadline, now)]:
            text = seq.stop_filter.flush() if seq is not None else ""  # a held tail that never became a stop string
            handle.metrics.deadlines_exceeded.labels("run").inc()
            handle.metrics.finished.labels("timeout").inc()
            handle._deliver(TokenEvent(token_id=NO_TOKEN, text=text, finish_reason="timeout"))
            self._finish(handle, DONE)  # its slot, its KV reservation; its Sequence (cache, grammar) is dropped
        if late:
            self.metrics.queue_depth.set(len(self._waiting))

    def _end_all(self, err: ServeError, reason: str = "abort", died: BaseException | None = None) -> None:
        """Every request in flight or queued ends with `err`. `died`: the worker is leaving; later submits fail."""
        with self._wake:
            if died is not None:
                self.died, self._stopping = died, True
            handles = [h for h, _ in self._active] + list(self._waiting)
            self._active, self._waiting = [], deque()
            for handle in handles:
                self.kv_budget.release(handle)
                handle.metrics.finished.labels(reason).inc()
                handle._deliver(err)
            self._admit()  # refreshes the gauges

    def _emit(self, handle: RequestHandle, event: TokenEvent) -> None:
        self._record(handle, event)
        handle._deliver(event)
        if event.finish_reason:
            handle.metrics.finished.labels(event.finish_reason).inc()
            self._finish(handle, DONE)

    def _fail(self, handles: list[RequestHandle], err: Exception) -> None:
        """End these requests with a clean error; their caches go with them."""
        if not handles:
            return
        # the worker thread has no request context: a lone request's id goes on the record itself (JSON logs)
        log.error("generation failed for %s: %r", [h.request_id for h in handles], err,
                  extra={"request_id": handles[0].request_id} if len(handles) == 1 else None)
        err = without_frames(err)  # the frames it passed through would keep its neighbours' caches alive
        # A ServeError is the request's own (its grammar reached a dead end, say) and says so; anything else is ours.
        error = err if isinstance(err, ServeError) else GenerationFailed(f"generation failed: {type(err).__name__}: "
                                                                         f"{err}")
        for handle in handles:
            handle.metrics.finished.labels("error").inc()
            self._finish(handle, error)

    def _replace(self, handle: RequestHandle, seq: Sequence) -> None:
        with self._wake:
            for i, (h, _) in enumerate(self._active):
                if h is handle:
                    self._active[i] = (handle, seq)

    def _finish(self, handle: RequestHandle, last: object) -> None:
        with self._wake:
            self._active = [(h, s) for h, s in self._active if h is not handle]
            self.kv_budget.release(handle)
            self.metrics.active_sequences.set(len(self._active))
            self.metrics.kv_cache_reserved.set(self.kv_budget.in_use)
        handle.metrics.request_duration.observe(time.perf_counter() - handle.submitted_at)
        handle._deliver(last)

    def _record(self, handle: RequestHandle, event: TokenEvent) -> None:
        now = time.perf_counter()
        if handle.first_token_at is None:
            handle.metrics.time_to_first_token.observe(now - handle.submitted_at)
        else:
            handle.metrics.inter_token_latency.observe(now - handle.last_token_at)
        handle.first_token_at = handle.first_token_at or now
        handle.last_token_at = now
        handle.metrics.completion_tokens.inc()
        handle.metrics.adapter_series.count_token(handle.adapter)
