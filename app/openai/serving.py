"""The engine side of every generating API: a request checked against the served model, its prompt encoded off
the loop, its grammar compiled, turned into SamplingParams and submitted, its choices collected or their deltas
merged (app/openai/answer.py turns each token event into what the client sees).

The flow around these steps, and the stream loop, are app/openai/flow.py's, shared by every API; each API's wire
format is its own (app/openai/completions_wire.py for chat and text completions, app/openai/responses/,
app/anthropic/). `chat` and `completion` are the routes' entry points for the first two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request

from app.core.engine.engine import Engine
from app.deadlines import HEADER, request_deadlines
from app.errors import InvalidRequest, ModelNotFound, PriorityNotGranted, ServeError
from app.core.sequence import TokenEvent
from app.models.loading import LoadedModel
from app.models.lora import LoraAdapter, LoraAdapters
from app.openai.answer import Choice, Delta
from app.openai.completions_wire import ChatApi, CompletionsApi, error_body  # noqa: F401 (error_body: main.py's)
from app.openai.flow import Prepared, create
from app.images import ImageLimits, check_image_count, load_image
from app.openai.content_parts import refuse_images
from app.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.structured.grammars import Grammar, Grammars
from app.structured.schema_check import GrammarLimits
from app.openai.reasoning import reasoning_format
from app.openai.scoring import check_prompt_scores
from app.openai.stream_parts import merge_events, record_timing, sampling_header
from app.openai.structured import compile_client, request_grammar
from app.openai.tools import make_parser, tool_format, tool_markers
from app.prepare import Preparing
from app.core.sampling import SamplingParams

log = logging.getLogger("app.openai.serving")
DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


class CompletionServing:
    def __init__(self, engine: Engine, lm: LoadedModel, model_id: str, default_max_tokens: int | None = None,
                 grammar_limits: GrammarLimits = GrammarLimits(), sse_send_timeout_s: float | None = None,
                 preparing: Preparing | None = None, grammar_client_header: str | None = None,
                 queue_timeout_s: float | None = None, request_timeout_s: float | None = None,
                 adapters: LoraAdapters | None = None, max_prompt_logprob_entries: int = 1_000_000,
                 reasoning_parser: str = "auto", priority_granted: Callable[[str | None], bool] = lambda t: False,
                 image_limits: ImageLimits = ImageLimits()):
        self.engine, self.lm, self.preparing = engine, lm, preparing or Preparing()
        self.image_limits = image_limits  # a request's images: bytes, pixels, count, tokens (app/images.py)
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s  # app/deadlines.py
        self.sse_send_timeout_s = sse_send_timeout_s  # a stream whose client reads nothing this long ends
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        # stable across restarts (str hash() is salted per process): changes only with the model and dtype
        self.fingerprint = "fp_" + hashlib.sha256(f"{lm.name}|{lm.dtype}".encode()).hexdigest()[:10]
        self.reasoning = reasoning_format(lm.tokenizer, reasoning_parser)  # None: the model does not think
        log.info("reasoning parser: %s (REASONING_PARSER=%s)", self.reasoning.name if self.reasoning else "none",
                 reasoning_parser)
        self.tool_format = tool_format(getattr(lm.tokenizer, "chat_template", None))  # None: cannot show tools
        self.tool_markers = tool_markers(lm.tokenizer, self.tool_format)
        self.grammars = Grammars(lm.tokenizer, lm.vocab_size, lm.eos_ids, limits=grammar_limits)
        self.grammar_client_header = grammar_client_header  # see compile_client
        self.adapters = adapters  # LoRA adapters a request's `model` may name; None: the base model alone
        self.max_prompt_logprob_entries = max_prompt_logprob_entries  # app/openai/scoring.py
        self.priority_granted = priority_granted  # whether a tenant may ask for a priority below 0 (PRIORITY_KEYS)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await create(ChatApi(self), body, request)

    async def completion(self, body: CompletionRequest, request: Request):
        return await create(CompletionsApi(self), body, request)

    async def prepare_chat(self, body: ChatCompletionRequest, continue_final: bool = False) -> Prepared:
        """The chat request ready for the engine: its prompt ids and, where it sends images, their embeddings.
        `continue_final`: the last (assistant) message is the start of the answer, to be continued (Anthropic's
        prefill), rather than a finished turn followed by a new one."""
        body.check_tools()
        if body.tools and self.tool_format is None:
            raise InvalidRequest(f"the chat template of {self.model_id!r} cannot show tools to the model, so "
                                 "`tools` cannot be served", param="tools")
        kwargs = body.template_kwargs() | ({"continue_final_message": True} if continue_final else {})
        ids, images = await self.encode_prompt(body.chat_messages(), body.image_parts(), kwargs,
                                               body.template_tools(), add_generation_prompt=not continue_final)
        return Prepared(body, ids, images=images)

    async def encode_prompt(self, messages: list[dict[str, Any]], images: list[tuple[str, str]],
                            template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True) -> tuple[list[int], Any]:
        """(prompt ids, its images' ImagePrompt or None). `images`: (url, the field its client sent it under), in
        prompt order (ChatCompletionRequest.image_parts); a text model refuses them, naming the first one's field."""
        if images and getattr(self.lm, "vision", None) is None:
            refuse_images(images, self.model_id)  # never dropped silently
        if not images:
            return await self.encode_messages(messages, template_kwargs, tools, add_generation_prompt), None
        return await self.preparing.run(self._encode_images, messages, template_kwargs, tools, add_generation_prompt,
                                        images)

    def _encode_images(self, messages, kwargs, tools, add_generation_prompt: bool, images: list[tuple[str, str]]):
        """On a prepare worker: the images read and bounded (app/images.py), the prompt rendered, each image's
        placeholder expanded and the vision tower run (app/models/vision.py). A decode or a vision pass takes
        far longer than a text token: never on the event loop, and counted against MAX_PREPARING."""
        check_image_count(len(images), self.image_limits, images[-1][1])
        loaded = [load_image(url, field, self.image_limits) for url, field in images]
        prompt = self.lm.render_chat(messages, kwargs, tools, add_generation_prompt)
        return self.lm.vision.encode(prompt, [i.image for i in loaded], [i.digest for i in loaded],
                                     self.image_limits.max_image_tokens)

    def check_prompt_ids(self, prompt_ids: list[int]) -> list[int]:
        if unknown := sorted({t for t in prompt_ids if t >= self.lm.vocab_size}):
            raise InvalidRequest(f"prompt names token ids outside the vocabulary (size {self.lm.vocab_size}): "
                                 f"{unknown[:5]}", param="prompt")
        return prompt_ids

    # The template and the tokenizer take seconds on a 1 MiB body: on a prepare worker, counted (app/prepare.py).
    async def encode_messages(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                              tools: list[dict[str, Any]] | None = None,
                              add_generation_prompt: bool = True) -> list[int]:
        return await self.preparing.run(self.lm.encode_chat, messages, template_kwargs, tools, add_generation_prompt)

    async def encode_text(self, text: str) -> list[int]:
        return await self.preparing.run(self.lm.encode_text, text)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Work on an answer that is already made (laying out prompt scores, writing their JSON): on a prepare
        worker, off the loop, but never refused as new requests are (MAX_PREPARING): its generation has run."""
        return await asyncio.get_running_loop().run_in_executor(self.preparing.executor, functools.partial(fn, *args))

    def check_model(self, model: str, tenant: str | None = None) -> LoraAdapter | None:
        """The LoRA adapter `model` names, None for the base model; 404 naming it for anything else. `tenant` (the
        request's API key, request.state.tenant): a runtime adapter is found only by the key that loaded it."""
        if model == self.model_id:
            return None
        adapter = self.adapters.get(model, tenant) if self.adapters is not None else None
        if adapter is None:
            names = [a.name for a in self.adapters.visible(tenant)] if self.adapters is not None else []
            also = f" and the LoRA adapters {names}" if names else ""
            raise ModelNotFound(f"model {model!r} is not served here; this server serves {self.model_id!r}{also}")
        return adapter

    def served_name(self, choices: list[Choice]) -> str:
        """What answers name as their `model`: the adapter the request ran with (as vLLM does), else the base."""
        adapter = choices[0].handle.adapter if choices else None
        return adapter.name if adapter is not None else self.model_id

    async def grammar(self, body, request: Request | None = None) -> Grammar | None:
        """The compiled constraint a request asks for, if any: compiled in a worker process with a deadline
        (tens of ms for a typical new schema, a dict lookup for a cached one), never on the event loop."""
        client = compile_client(request, self.grammar_client_header)
        tenant = getattr(request.state, "cache_tenant", None) if request is not None else None  # as the prefix cache's
        return await request_grammar(self.grammars, body, self.tool_format, client, tenant)

    def start(self, body, request: Request, prompt_ids: list[int], chat: bool,
              grammar: Grammar | None = None, images=None) -> tuple[list[Choice], dict]:
        """Turn the request into SamplingParams and submit its choices; also the headers every answer carries.
        Every generating API comes through here (app/openai/flow.py)."""
        reasoning = self.reasoning if chat else None
        # again: it may have been unloaded while the prompt was prepared
        adapter = self.check_model(body.model, getattr(request.state, "tenant", None))
        room = self.lm.max_context - len(prompt_ids)  # < 1: leave it unset, so the context error names the prompt
        default_max = min(self.default_max_tokens or room, room) if room >= 1 else None
        tenant = getattr(request.state, "cache_tenant", None)  # the API-key check's (app/api.py): salts the cache
        params = [body.to_sampling_params(self.lm.generation_defaults, i, reasoning, grammar, default_max, tenant)
                  for i in range(body.n)]
        asked = getattr(body, "prompt_logprobs", None)
        check_prompt_scores(len(prompt_ids), params[0].prompt_logprobs, body.n, self.max_prompt_logprob_entries,
                            "logprobs" if asked is None else "prompt_logprobs")
        # the prompt is scored once, by the first choice; the others reuse its scores (app/openai/completions_wire.py)
        params[1:] = [dataclasses.replace(p, prompt_logprobs=None) for p in params[1:]]
        thinking = body.thinking(reasoning) if reasoning is not None else None
        background = getattr(request.state, "background", False)  # a batch line (app/entry.py)
        check_priority(params[0].priority, getattr(request.state, "tenant", None), self.priority_granted)
        # a batch line waits for capacity by design: its queue time is no timeout (its batch has a window)
        deadlines = (None, None) if background else request_deadlines(
            request.headers.get(HEADER), getattr(request.state, "arrived", None), self.queue_timeout_s,
            self.request_timeout_s)
        request.state.sampling = params[0]  # for the trace's attributes
        choices = self._submit(prompt_ids, params, thinking, deadlines, getattr(request.state, "x_request_id", None),
                               adapter, background, images)
        request.state.choices = choices  # for the log line and the trace, once the answer is out
        if chat and body.parse_tools:
            for choice in choices:
                choice.parser = make_parser(self.tool_format, body.tool_names(), body.parallel_tool_calls,
                                            body.tool_schemas())
                choice.tool_markers = self.tool_markers
        request.state.prompt_tokens = len(prompt_ids)
        headers = {"x-sampling-params": sampling_header(params[0])}
        return choices, headers

    async def started(self, choices: list[Choice]) -> None:
        """With a deadline, a stream's 200 waits until its choices have left the queue, so that a queue timeout is
        still an HTTP error with Retry-After; without one, a stream starts at once, as it always has."""
        if all(c.handle.deadline is None and c.handle.queue_deadline is None for c in choices):
            return
        try:
            for c in choices:
                await c.handle.wait_until_started()
        except BaseException:
            for c in choices:  # all or nothing, as at submit
                c.handle.cancel(client_left=False)
            raise

    def _submit(self, prompt_ids: list[int], params: list[SamplingParams], thinking: bool | None,
                deadlines: tuple[float | None, float | None] = (None, None),
                request_id: str | None = None, adapter: LoraAdapter | None = None,
                background: bool = False, images=None) -> list[Choice]:
        choices: list[Choice] = []
        queue_deadline, deadline = deadlines
        try:
            for i, p in enumerate(params):
                splitter = self.reasoning.splitter(thinking) if thinking is not None else None
                handle_id = f"{request_id}/{i}" if request_id and len(params) > 1 else request_id  # engine's log
                choices.append(Choice(i, self.engine.submit(prompt_ids, p, handle_id, queue_deadline, deadline,
                                                                adapter, background=background, images=images),
                                      splitter))
        except ServeError:
            for choice in choices:  # all or nothing: don't leave half of an n>1 request running
                choice.handle.cancel()
            raise
        return choices

    # ---- non-streaming ----

    async def collect(self, choices: list[Choice], request: Request) -> None:
        try:
            await self._collect(choices, request)
        except ServeError:
            for choice in choices:  # a choice failed: its siblings are stopped by us, not by the client
                choice.handle.cancel(client_left=False)
            raise
        finally:
            for choice in choices:
                choice.handle.cancel()  # no-op when finished; frees the cache when the client left
        record_timing(request, choices)

    async def _collect(self, choices: list[Choice], request: Request) -> None:
        """Gather every choice's events, and give up (cancelling them) if the client disconnects. If one choice
        fails, its error is raised at once and its siblings' tasks are cancelled here, never left pending."""
        tasks = [asyncio.ensure_future(self._drain(c)) for c in choices]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t.exception() for t in done if not t.cancelled() and t.exception()), None)
                if failed is not None:
                    raise failed  # a mid-generation failure becomes its HTTP error
                if not pending:
                    return
                if await request.is_disconnected():
                    request.state.cancelled = True
                    return
        finally:
            for task in tasks:
                task.cancel()  # no-op for finished ones

    async def _drain(self, choice: Choice) -> None:
        async for event in choice.handle:
            self._add(choice, event)

    def _add(self, choice: Choice, event: TokenEvent) -> Delta:
        return choice.add(event, self.lm.tokenizer)

    async def deltas(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, Delta]]:
        """Every choice's deltas in arrival order, skipping events that show nothing yet (an incomplete character,
        a possible stop string, a tag)."""
        async for choice, event in merge_events(choices):
            delta = self._add(choice, event)
            if not delta.empty:
                yield choice, delta


def check_priority(priority: int, tenant: str | None, granted: Callable[[str | None], bool]) -> None:
    """A client may lower its own priority (above 0 runs later); going ahead of the default (below 0) needs the
    operator's grant: else any client could jump every other tenant's queue."""
    if priority < 0 and not granted(tenant):
        raise PriorityNotGranted("`priority` below 0 runs ahead of other clients and needs the operator's grant: "
                                 "this key is not in PRIORITY_KEYS; send 0 or more", param="priority")
