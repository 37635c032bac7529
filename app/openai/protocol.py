"""OpenAI wire models (pydantic). A request becomes engine parameters in exactly one place: `to_sampling_params`.

Unknown fields the official SDK may send are accepted and ignored (`extra="allow"`); fields we cannot honour are
rejected with a 400 that names them (`unsupported_fields`), rather than silently doing something else.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, WrapValidator, field_validator

from app.errors import InvalidRequest
from app.models.chat_template import RESERVED_TEMPLATE_ARGS
from app.core.sampling import (MAX_INSPECT, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                               MAX_TOP_LOGPROBS, REPETITION_PENALTY_RANGE, SEED_RANGE, SamplingParams,
                               resolve_sampling_params)
from app.openai.content_parts import (ContentPart, ImageUrl, ImageUrlPart, TextPart, WithImages,  # noqa: F401
                                      checked_content, message_images, template_content)  # (ImageUrl: re-exported)
from app.openai.reasoning import TEMPLATE_EFFORT, ReasoningFormat
from app.openai.tools.wire import ToolCall, ToolFields, template_tool_calls

MAX_N = 8
MAX_CACHE_SALT_CHARS = 256  # vLLM suggests 43 characters (256 random bits, base64)
# The OpenAPI schema states the bounds SamplingParams enforces, so clients (and the fuzzer) see the real contract.
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
StopField = Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
    _STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]})]
LogitBiasField = Annotated[dict[str, float] | None, WithJsonSchema({"anyOf": [
    {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]+$"},
     "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}, {"type": "null"}]})]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # text, or parts: text and images (app/openai/content_parts.py); a list is validated alone, so errors name the part
    content: Annotated[str | list[ContentPart] | None, WrapValidator(checked_content)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    # an earlier answer's thinking (vLLM accepts both names); Qwen3's template keeps it for the latest turn only
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        """The message's text alone, without its images."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class InspectOptions(BaseModel):
    """`"inspect": {"top": 10}`: stream each token's top candidates at every sampling stage (off by default)."""

    model_config = ConfigDict(extra="forbid")
    top: int = Field(default=10, ge=1, le=MAX_INSPECT)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the answer (app/openai/structured.py compiles it)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema (or its JSON text)
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # EBNF as xgrammar reads it; llama.cpp's GBNF is the same notation


class TGIGrammar(BaseModel):
    """TGI's `grammar` field: {"type": "json" | "regex", "value": schema or pattern}."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["json", "json_object", "regex"]
    value: dict[str, Any] | str


class _SamplingFields(BaseModel):
    """Fields shared by chat and legacy completions. SamplingParams checks them again (for the CLI and the model's
    own defaults); the bounds here are the same numbers, stated for the OpenAPI schema."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 disables it")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBiasField = None
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    inspect: InspectOptions | None = None  # ours: the token inspector (the playground, docs/walkthrough.md)
    user: str | None = None
    # vLLM's: prefix-cache entries are reused only among requests with the same salt (docs/api.md)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # constraints on the answer, as each peer spells them (docs/tools-and-structured-outputs.md): vLLM's
    # `structured_outputs` and its older `guided_*` fields; llama.cpp's `grammar` (GBNF) and `json_schema`; TGI's
    # `grammar` object
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    grammar: str | TGIGrammar | None = None
    json_schema: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob and this many alternatives, from the prefill itself (docs/api.md)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: waiting requests run lower values first; below 0 needs PRIORITY_KEYS (docs/batch.md)
    priority: int = Field(0, ge=-2**31, le=2**31 - 1)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _small_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is not None and len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        return bias

    def unsupported_fields(self) -> None:
        """Reject fields that would change the answer if we silently ignored them."""
        extra = self.model_extra or {}
        for name in ("tools", "functions", "audio", "prediction"):
            if extra.get(name):
                raise InvalidRequest(f"`{name}` is not supported by this server", param=name)
        if extra.get("tool_choice") not in (None, "none", "auto"):
            raise InvalidRequest("`tool_choice` is not supported by this server", param="tool_choice")
        for name, used in (("best_of", extra.get("best_of") not in (None, 1)), ("suffix", bool(extra.get("suffix")))):
            if used:
                raise InvalidRequest(f"`{name}` is not supported by this server", param=name)
        response_format = extra.get("response_format")
        if response_format is not None and (not isinstance(response_format, dict)
                                             or response_format.get("type") != "text"):
            raise InvalidRequest('only response_format {"type": "text"} is supported', param="response_format")

    def _logprob_settings(self) -> tuple[bool, int]:
        return False, 0

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _preamble(self, reasoning: ReasoningFormat | None):
        return None  # only chat answers think

    def to_sampling_params(self, model_defaults: dict[str, Any], choice_index: int = 0,
                           reasoning: ReasoningFormat | None = None, grammar: Any = None,
                           default_max_tokens: int | None = None, tenant: str | None = None) -> SamplingParams:
        """Request fields -> SamplingParams: the one place the wire format meets the engine. `reasoning`: how the
        served model marks its thinking, or None for a model that does not think. `grammar`: the compiled
        constraint (app.openai.structured says what it enforces), or None.

        `default_max_tokens` applies when the request sets no limit: the serving layer caps it (like OpenAI's
        per-model output limit), so that n choices can never each run to the end of the context by default.
        `tenant`: the caller's API-key tenant when the server salts the prefix cache by key (app/auth.py)."""
        self.unsupported_fields()
        logprobs, top_logprobs = self._logprob_settings()
        max_tokens = self._max_tokens()
        fields: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "logprobs": logprobs, "top_logprobs": top_logprobs, "inspect": self.inspect.top if self.inspect else 0,
            "prompt_logprobs": self._prompt_logprobs(),
            # choices of one request must differ, yet stay reproducible for a fixed seed (and inside 64 bits)
            "seed": None if self.seed is None else (self.seed + choice_index - SEED_RANGE[0]) % 2**64 + SEED_RANGE[0],
            "preamble": self._preamble(reasoning), "grammar": grammar,
            "cache_salt": engine_cache_salt(tenant, self.cache_salt), "priority": self.priority,
        }
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            fields["top_k"] = 0
        if self.logit_bias:
            try:
                fields["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as err:
                raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias") from err
        return resolve_sampling_params({k: v for k, v in fields.items() if v is not None}, model_defaults)


def engine_cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The engine's prefix-cache salt: the request's `cache_salt` within its tenant, so an explicit salt never
    reaches across keys. Only a digest reaches the engine, never the salt a client sent."""
    if tenant is None and salt is None:
        return None
    return hashlib.sha256(f"{tenant or ''}\0{salt or ''}".encode()).hexdigest()  # a tenant id is hex: no \0


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Wire messages -> what the chat template renders; chat completions and /tokenize share it, so /tokenize
    counts exactly the prompt a completion would get. A message with images gets the multimodal template's content
    list (text and `{"type": "image"}` in order); every other message keeps its text as one string."""
    message_images(messages)  # only user messages may hold images: a 400 naming the field for any other
    out = []
    for i, m in enumerate(messages):
        has_images = isinstance(m.content, list) and any(isinstance(p, ImageUrlPart) for p in m.content)
        content = template_content(m.content) if has_images else m.text()
        # "developer" is OpenAI's newer name for "system"; chat templates know only "system".
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.role == "assistant" and (m.reasoning_content or m.reasoning):
            message["reasoning_content"] = m.reasoning_content or m.reasoning
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls(m.tool_calls, f"messages.{i}")
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class ChatCompletionRequest(_SamplingFields, ToolFields, WithImages):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # the chat template's own switches, e.g. {"enable_thinking": false} for Qwen3 (as in vLLM and llama.cpp)
    chat_template_kwargs: dict[str, Any] | None = None
    # a cap on a reasoning model's thinking, in tokens; `reasoning_effort` (OpenAI's) maps to one
    max_reasoning_tokens: int | None = None
    reasoning_effort: str | None = None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        for name in kwargs:
            if name in RESERVED_TEMPLATE_ARGS:
                raise InvalidRequest(f"chat_template_kwargs may not set {name!r}; the server sets it",
                                     param=f"chat_template_kwargs.{name}")
        if self.reasoning_effort == "none":  # OpenAI's "no reasoning at all": Qwen3's switch for it
            kwargs.setdefault("enable_thinking", False)
        if self.reasoning_effort is not None and self.reasoning_effort != "none":  # gpt-oss's template reads it
            kwargs.setdefault("reasoning_effort", TEMPLATE_EFFORT.get(self.reasoning_effort, self.reasoning_effort))
        return kwargs

    def thinking(self, reasoning: ReasoningFormat) -> bool:
        """Whether this request's answer thinks: each family has its own template switch (Qwen3's
        `enable_thinking`, Granite's `thinking`)."""
        return reasoning.thinks(self.template_kwargs())

    def _preamble(self, reasoning: ReasoningFormat | None):
        if reasoning is None:
            for name in ("max_reasoning_tokens", "reasoning_effort"):
                if getattr(self, name) is not None:
                    raise InvalidRequest(f"`{name}` needs a reasoning model; this model does not think", param=name)
            return None
        if not self.thinking(reasoning):
            return None
        # "none" where the template cannot turn thinking off (DeepSeek-R1, gpt-oss): a budget of 0
        effort = "minimal" if self.reasoning_effort == "none" else self.reasoning_effort
        return reasoning.preamble(reasoning.budget(self.max_reasoning_tokens, effort))

    def _logprob_settings(self) -> tuple[bool, int]:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return self.logprobs, self.top_logprobs or 0

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_SamplingFields):
    # one prompt per request (see prompt_value): text, or token ids as evaluation harnesses send them
    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1, "maxItems": 1}]})]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # legacy API: the number of top alternatives
    # the prompt comes back before the answer (with its tokens' logprobs when `logprobs` is set): how evaluation
    # harnesses score a text; with `max_tokens: 0` nothing is generated
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)

    def _logprob_settings(self) -> tuple[bool, int]:
        if self.logprobs is None:
            return False, 0
        return True, self.logprobs

    def _prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens carry logprobs like the answer's
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def score_only(self) -> bool:
        """`max_tokens: 0`: the prompt alone is scored. The engine still picks one token from the prefill's last
        logits (no extra pass); it is not sent or counted."""
        return self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        if self.score_only:
            if not (self.echo or self.prompt_logprobs is not None):
                raise InvalidRequest("max_tokens: 0 generates nothing; it needs `echo: true` or `prompt_logprobs`",
                                     param="max_tokens")
            if self.n > 1:
                raise InvalidRequest("max_tokens: 0 scores the prompt once; it takes n: 1", param="n")
            return 1
        return self.max_tokens

    def prompt_value(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("exactly one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        return prompt


class TokenizeRequest(WithImages):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True

    def chat_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages or [])


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def default_sampling(model_defaults: dict[str, Any]) -> dict[str, Any]:
    """What a request that sets nothing gets (generation_config.json over the built-in defaults), for clients
    such as the playground to show; `do_sample: false` means greedy whatever the temperature says."""
    effective = resolve_sampling_params({}, model_defaults).effective()
    return {k: effective[k] for k in ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                      "presence_penalty", "frequency_penalty")}


def new_id(prefix: str, request_id: str | None = None) -> str:
    """`prefix-<request id>`: the request's `x-request-id` (app/request_id.py), so a response and the log lines
    about it share one id; a fresh one where there is none."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
