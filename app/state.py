"""What one server process holds: settings, metrics, and (once loaded) the model, engine and serving layer.

Loading happens in the background after the server starts listening, so `/health` answers at once and `/ready`
turns 200 only when the model is loaded and has generated a warm-up token.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from functools import partial

from app.auth import ApiKeys, priority_grant
from app.body import BodyLimits
from app.images import ImageLimits
from app.config import Settings
from app.core.engine.embedding import EmbeddingEngine
from app.core.engine.engine import Engine
from app.structured.schema_check import GrammarLimits
from app.errors import ConfigError, NotReady, ShuttingDown
from app.gpu_only_imports import SKIPPED, triton_skipped
from app.metrics import Metrics
from app.models.loading import LoadedModel, load_model, serves_embeddings
from app.models.lora import LoraAdapters
from app.core.sampling import SamplingParams
from app.openai.embeddings.serving import EmbeddingServing
from app.openai.serving import CompletionServing
from app.openai.tools import choose_tool_format, tool_markers
from app.prepare import Preparing
from app.probes import GenerateProbe
from app.tracing import tracing_from_env

log = logging.getLogger("app.state")


def grammar_limits(s: Settings) -> GrammarLimits:
    return GrammarLimits(max_depth=s.grammar_max_depth, max_repeat=s.grammar_max_repeat,
                         max_total_repeat=s.grammar_max_total_repeat, max_enum_values=s.grammar_max_enum_values,
                         max_literal_bytes=s.grammar_max_literal_bytes, compile_timeout_s=s.grammar_compile_timeout_s,
                         workers=s.grammar_compile_workers, queue=s.grammar_compile_queue,
                         per_client=s.grammar_compile_per_client, memory_bytes=s.grammar_compile_memory_bytes)


def freeze_heap() -> None:
    """Moves every object alive once the model is loaded (torch's and transformers' modules, the model's own: 420,000
    on the tiny test model) out of the garbage collector's reach for good. Else a full collection walks them all
    again, holding the GIL: 0.5 s on a 2-core machine, a stalled step for every stream and a stalled event loop (the
    flood test's investigation met one a few dozen requests after the start; Python runs one whenever a quarter as
    many new objects have survived). Collected first, so that what is frozen is what stays alive anyway; what is
    frozen and dies later is still freed by its reference count, but a cycle of it is never collected: for a server
    that owns its process only."""
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d objects frozen", gc.get_freeze_count())


class ServerState:
    def __init__(self, settings: Settings, lm: LoadedModel | None = None):
        self.settings = settings
        self.api_keys = ApiKeys(settings.api_key)
        self.metrics = Metrics()
        # Parsing, validating, templating and tokenizing: off the loop, bounded (app/prepare.py, app/body.py).
        self.preparing = Preparing(settings.max_preparing, settings.prepare_workers)
        self.body_limits = BodyLimits(settings.max_json_depth, settings.max_messages, settings.max_content_blocks,
                                      settings.max_tools)
        self.lm = lm
        # "embedding": MODEL is an encoder; /v1/embeddings, /v1/rerank and /v1/score are served instead of chat.
        if lm is not None:
            self.kind = getattr(lm, "kind", "chat")
        else:
            self.kind = "embedding" if serves_embeddings(settings.model) else "chat"
        # LoRA: adapters by name (app/models/lora.py); None: the model's linears stay as loaded
        self.adapters = (LoraAdapters(settings.model_id, settings.lora_modules, settings.max_loras,
                                      settings.max_lora_rank, settings.lora_runtime_loading,
                                      settings.lora_adapter_root, settings.loras_per_key) if settings.lora else None)
        self.metrics.adapter_series.adapters = self.adapters  # their series live and leave with them
        self.engine: Engine | EmbeddingEngine | None = None
        self.serving: CompletionServing | None = None
        self.embedding: EmbeddingServing | None = None
        self.ready = False
        self.draining = False
        self.batch_store = None  # app/batch/store.py's, when BATCH_DIR is set (opened by create_app)
        self.batches = None  # app/batch/service.py's, once the model is loaded
        self.load_error: str | None = None
        self.probe = GenerateProbe(settings.health_generate_timeout_s)  # /health/generate (app/probes.py)
        self.probe_prompt: list[int] = []
        self.tracing = tracing_from_env()  # None unless OTEL_EXPORTER_OTLP_ENDPOINT is set (app/tracing.py)

    async def load(self) -> None:
        s = self.settings
        owns_process = self.lm is None  # a model handed in is a test's, in a process with more than this server
        try:
            if self.lm is None:
                log.info("loading model %s (device=%s, dtype=%s)", s.model, s.device, s.dtype)
                if triton_skipped():
                    log.info(SKIPPED)
            # The engine's own thread loads the model (see Engine for why); we wait without blocking the loop.
            loader = self.lm or partial(load_model, s.model, s.device, s.dtype, s.model_cache, s.max_model_len,
                                         prepack=s.prepack, quant=s.quant, tensor_parallel=s.tensor_parallel,
                                         int4_wide_copy=s.int4_wide_copy, int4_kernel=s.int4_kernel,
                                         batch_invariant=s.batch_invariant,
                                         decode_step=s.decode_step, lora=s.lora, kv_cache_dtype=s.kv_cache_dtype,
                                         decode_attention=s.decode_attention)
            if self.kind == "embedding":
                await self._load_embedding(loader)
            else:
                await self._load_chat(loader)
            if owns_process:
                freeze_heap()  # on the loop or off it, it holds the GIL: /health waits, once, before /ready
        except Exception as err:  # noqa: BLE001 - reported through /ready and the process exit code
            self.load_error = f"{type(err).__name__}: {err}"
            log.error("model failed to load: %s", self.load_error)
            return
        self.ready = True
        log.info("ready: %s on %s, context %d tokens; dtype %s (%s); prepack %s", s.model_id, self.lm.device,
                 self.lm.max_context, self.model_info["dtype"], self.lm.dtype_reason, self.lm.prepack)

    async def _load_embedding(self, loader) -> None:
        """The pooling model's own worker (app/core/engine/embedding.py), then one warm-up pass."""
        s = self.settings
        if self.adapters is not None:
            raise ConfigError(f"{s.model!r} is an embedding model; LORA_MODULES and LORA_RUNTIME_LOADING apply to "
                              "chat models only", param="lora_modules")
        self.engine = EmbeddingEngine(loader, max_requests=s.max_active + s.max_queue, metrics=self.metrics)
        self.engine.start()
        await asyncio.to_thread(self.engine.loaded.wait)
        if self.engine.load_error is not None:
            raise self.engine.load_error
        self.lm = self.engine.lm
        if self.lm.kind != "embedding":
            raise RuntimeError(f"{s.model} was taken for an embedding model but loaded as a {self.lm.kind} model")
        self.embedding = EmbeddingServing(self.engine, self.lm, s.model_id, self.preparing, self.metrics,
                                          s.queue_timeout_s, s.request_timeout_s)
        warm = self.lm.encode_pair("Hello", "Hello") if self.lm.scores_pairs else self.lm.encode_text("Hello")
        await self.engine.embed([warm])
        self.probe_prompt = warm  # /health/generate's input when the engine is idle

    async def _load_chat(self, loader) -> None:
        s = self.settings
        prefix_cache_bytes = s.prefix_cache_bytes
        if s.tensor_parallel > 1 and prefix_cache_bytes:
            log.info("prefix cache off: under tensor parallelism its blocks would have to be mirrored on every rank")
            prefix_cache_bytes = 0
        self.engine = Engine(loader, s.max_active, s.max_queue, self.metrics, s.prefill_tokens_per_step,
                             s.kv_cache_bytes, prefix_cache_bytes=prefix_cache_bytes,
                             speculative=s.speculative, decode_step=s.decode_step, adapters=self.adapters,
                             batch_slots=s.batch_slots)
        self.engine.start()
        await asyncio.to_thread(self.engine.loaded.wait)
        if self.engine.load_error is not None:
            raise self.engine.load_error
        self.lm = self.engine.lm
        if self.lm.ranks is not None:
            self.lm.ranks.start_heartbeat()  # an idle server notices a rank that died, too
        self.serving = CompletionServing(self.engine, self.lm, s.model_id, s.default_max_tokens,
                                         grammar_limits(s), s.sse_send_timeout_s, self.preparing,
                                         s.grammar_client_header, s.queue_timeout_s, s.request_timeout_s,
                                         self.adapters, s.max_prompt_logprob_entries,
                                         reasoning_parser=s.reasoning_parser,
                                         priority_granted=priority_grant(s.priority_keys, self.api_keys),
                                         image_limits=ImageLimits.from_settings(s))
        self.serving.tool_format, why = choose_tool_format(self.lm.tokenizer, s.tool_call_parser)
        self.serving.tool_markers = tool_markers(self.lm.tokenizer, self.serving.tool_format)
        log.info("tool calls: %s (%s)", self.serving.tool_format or "not served", why)
        self.probe_prompt = self.lm.encode_text("Hello")
        for name, nbytes in self.lm.weight_bytes.items():
            self.metrics.weight_bytes.labels(format=name).set(nbytes)
        if prefix_cache_bytes:
            log.info("prefix cache: up to %.1f MiB of earlier prompts' KV, taken from the KV budget",
                     prefix_cache_bytes / 2**20)
        await self._warm_up()

    @property
    def model_info(self) -> dict[str, str]:
        """How the model was loaded and why, for /ready and /v1/models; empty until it is loaded."""
        if self.lm is None:
            return {}
        info = {"dtype": str(self.lm.dtype).removeprefix("torch."), "dtype_reason": self.lm.dtype_reason,
                "prepack": self.lm.prepack}
        if self.kind == "chat":  # BATCH_INVARIANT as it holds, after the engine's say (app/models/invariance.py)
            info["batch_invariance"] = f"{'on' if self.lm.batch_invariant else 'off'}: {self.lm.invariance}"
        return info

    async def _warm_up(self) -> None:
        """One short greedy generation, so the first real request does not pay for lazy initialisation."""
        handle = self.engine.submit(self.lm.encode_text("Hello"), SamplingParams(max_tokens=2, do_sample=False),
                                    traffic=False)  # not a request: kept out of the request metrics
        async for _ in handle:
            pass

    @property
    def engine_error(self) -> str | None:
        """Why the engine can no longer generate, once it has died or lost a tensor-parallel rank (None while
        loading or serving)."""
        if self.lm is not None and self.lm.ranks is not None and self.lm.ranks.lost:
            return f"a tensor-parallel rank is gone: {self.lm.ranks.lost}"
        if self.engine is None or self.engine.alive or self.engine.load_error is not None:
            return None
        return f"the engine stopped: {self.engine.died!r}" if self.engine.died else "the engine stopped"

    def start_drain(self) -> None:
        self.draining = True
        if self.engine is not None:
            self.engine.draining = True

    @property
    def idle(self) -> bool:
        return self.engine is None or self.engine.in_flight == 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.batch_store is not None:
            self.batch_store.close()
        if self.serving is not None:
            self.serving.grammars.close()  # its compile processes
        self.preparing.close()
        if self.lm is not None and self.lm.ranks is not None:
            self.lm.ranks.close()  # the other ranks exit with us
        if self.tracing is not None:
            self.tracing.close()  # sends what is still batched, within the exporter's timeout
        # What load() froze goes back to the collector for the interpreter's last collections at exit: what stays
        # frozen is never freed, and native bindings report it (triton's nanobind printed ~30 lines of leaked
        # instances and types after every `serve` stopped). Nothing frozen (a test's model): a no-op.
        gc.unfreeze()


def check_ready(state: ServerState) -> None:
    """What every API request meets first: 503 while the server drains, its engine is dead or its model loads."""
    if state.draining:
        raise ShuttingDown()
    if error := state.engine_error:
        raise NotReady(error, code="engine_dead")
    if not state.ready:
        raise NotReady(state.load_error or "the model is still loading; retry when /ready answers 200",
                       code="model_not_ready")
