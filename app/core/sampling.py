"""How the next token is chosen: a validated `SamplingParams` and small pure logits functions.

Every transform is `(logits, ...) -> logits` on a `[batch, vocab]` float32 tensor and never mutates its input.
`process_logits` applies them in one fixed order, the same order Hugging Face's `generate()` uses, so that the same
settings pick the same tokens:

    repetition_penalty -> presence/frequency penalty -> logit_bias -> temperature -> top_k -> top_p -> min_p -> sample

The first three shape the scores whatever the decoding mode; the rest only matter when sampling (greedy decoding is
argmax, which temperature, top-k, top-p and min-p cannot change). Semantics follow
`transformers.generation.logits_process` (repetition penalty over prompt *and* output, HF-style) and the OpenAI API
(presence and frequency penalties over the output only). Tests compare each function with HF's own.

`process_logits` can also hand back each stage's scores as it goes, and `inspect_stages` turns them into the token
inspector's table (the playground, `--show-logits`): the record of the pass that chose the token, not a re-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from app.core.preamble import Preamble
from app.errors import InvalidRequest
from app.models.loading import GENERATION_CONFIG_KEYS

# Used when neither the request nor the model's generation_config.json says otherwise (OpenAI's defaults).
BUILTIN_DEFAULTS: dict[str, Any] = dict(
    do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0
)
assert set(BUILTIN_DEFAULTS) == set(GENERATION_CONFIG_KEYS), "every model default needs a built-in one"
MAX_INSPECT = 20

# Bounds on what one request may ask of the engine thread, which pays for each of these on every step.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # the held-back tail is matched against every stop on each token
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's own limit on logit_bias entries
MAX_TOP_LOGPROBS = 20
# Prompt logprobs keep N + 1 entries per prompt token until the answer is sent, and their prefill computes lm_head at
# every position: a bound on the prompt they may score (a 400 past it) and on the positions one pass scores.
MAX_PROMPT_LOGPROBS_TOKENS = 16384
PROMPT_LOGPROBS_CHUNK = 256  # [256, vocab] fp32 logits at most: 155 MB for Qwen's 151,936 tokens
SEED_RANGE = (-(2**63), 2**63 - 1)  # int64, as vLLM: torch's generators take 64 bits
# Dividing float32 logits by a tiny temperature or penalty overflows to inf, and softmax then gives NaN. A temperature
# below this samples as this (vLLM does the same; the draw is all but greedy anyway); penalties must be in range.
MIN_TEMPERATURE = 1e-2
REPETITION_PENALTY_RANGE = (1e-2, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the context window
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # vLLM's field: stop on these ids, whether or not they decode to text
    min_tokens: int = 0  # EOS and stop strings are ignored until this many tokens exist
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # score the prompt: each prompt token's logprob and this many alternatives
    inspect: int = 0  # > 0: record that many top candidates at every stage of the pipeline (costs time; opt-in)
    do_sample: bool = True
    preamble: Preamble | None = None  # a reasoning model's thinking: its end marker and token budget
    grammar: Any = field(default=None, compare=False)  # app.structured.grammars.Grammar: the answer must match it
    # prefix-cache entries are reused only among requests with the same salt (vLLM's `cache_salt`); never echoed
    cache_salt: str | None = field(default=None, repr=False)
    # scheduling, not sampling: the engine's queue orders waiting requests by it, lower first (vLLM's `priority`)
    priority: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, why: str) -> None:
            if not ok:
                raise InvalidRequest(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1")
        check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables it)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
              "repetition_penalty", f"must be in [{REPETITION_PENALTY_RANGE[0]}, {REPETITION_PENALTY_RANGE[1]:g}]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(all(-100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]")
        check(all(isinstance(k, int) and k >= 0 for k in self.logit_bias), "logit_bias", "keys must be token ids")
        check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens")
        check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"may have at most {MAX_LOGIT_BIAS} entries")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        check(all(len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
              f"strings may be at most {MAX_STOP_CHARS} characters long")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              f"must be at most {MAX_STOP_TOKEN_IDS} token ids")
        check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed", "must fit in 64 bits")
        check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS, "prompt_logprobs",
              f"must be in [0, {MAX_TOP_LOGPROBS}]")
        check(0 <= self.inspect <= MAX_INSPECT, "inspect", f"must be in [0, {MAX_INSPECT}] candidates")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        for param, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            unknown = sorted(t for t in ids if t >= vocab_size)
            if unknown:
                raise InvalidRequest(f"{param} names token ids outside the vocabulary (size {vocab_size}): "
                                     f"{unknown[:5]}", param=param)

    def effective(self) -> dict[str, Any]:
        """What will actually be used, for the `x-sampling-params` header and `--show-logits`."""
        skip = ("logit_bias", "stop", "preamble", "grammar", "cache_salt", "priority")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["grammar"] = self.grammar.description if self.grammar is not None else None
        if self.preamble is not None:
            out["preamble_budget"] = self.preamble.budget
        out["stop"] = list(self.stop)
        out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return out


def resolve_sampling_params(request: Mapping[str, Any], model_defaults: Mapping[str, Any]) -> SamplingParams:
    """Request values override the model's generation_config.json, which overrides BUILTIN_DEFAULTS.

    `request` holds only the fields the caller actually set. A request that sets a temperature decides the mode
    itself: 0 means greedy, anything else samples, even for a model whose config says do_sample=false.
    """
    merged = dict(BUILTIN_DEFAULTS)
    merged.update({k: v for k, v in model_defaults.items() if k in GENERATION_CONFIG_KEYS and v is not None})
    merged.update({k: v for k, v in request.items() if v is not None})
    if request.get("temperature") is not None:
        merged["do_sample"] = request["temperature"] > 0
    if "stop" in merged:
        stop = merged["stop"]
        merged["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    if "stop_token_ids" in merged:
        merged["stop_token_ids"] = tuple(merged["stop_token_ids"])
    return SamplingParams(**merged)


# ---- the logits pipeline: each step is (logits [B, V], ...) -> logits [B, V] ----

def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF semantics: each token seen in prompt or output, once: positive scores / penalty, negative * penalty."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    seen = logits.gather(-1, seen_ids)  # seen_ids: [B, T]
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, seen_ids, seen)


def apply_presence_frequency_penalty(logits: torch.Tensor, output_ids: torch.Tensor,
                                     presence: float, frequency: float) -> torch.Tensor:
    """OpenAI semantics, over generated tokens only: minus frequency * count, minus presence if count > 0."""
    if (presence == 0 and frequency == 0) or output_ids.numel() == 0:
        return logits
    counts = torch.zeros_like(logits).scatter_add_(-1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: Mapping[int, float]) -> torch.Tensor:
    if not bias:
        return logits
    ids = torch.tensor(list(bias.keys()), device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def suppress_tokens(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Make tokens impossible, e.g. EOS before min_tokens is reached."""
    if not token_ids:
        return logits
    return logits.index_fill(-1, torch.tensor(token_ids, device=logits.device), -math.inf)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / max(temperature, MIN_TEMPERATURE)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep tokens scoring at least the k-th best (HF keeps ties with the k-th, and so do we)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_best = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of best tokens whose probability reaches top_p (always at least the best one)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_ids = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)  # the low tail that adds up to at most 1 - top_p
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(-1, sorted_ids, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the best token's probability."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, -math.inf)


def process_logits(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor,
                   output_ids: torch.Tensor, banned_ids: list[int] = (),
                   stages: list[tuple[str, torch.Tensor]] | None = None) -> torch.Tensor:
    """The whole pipeline, in the documented order. seen_ids: prompt + output [B, T]; output_ids: [B, N].

    `stages`, when given, receives (name, scores) after each stage: the token inspector's record of this very pass.
    """
    def stage(name: str, scores: torch.Tensor) -> torch.Tensor:
        if stages is not None:
            stages.append((name, scores))
        return scores

    stage("raw", logits)
    # repetition, presence and frequency penalties, logit_bias and tokens banned before min_tokens: one stage
    logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    logits = apply_presence_frequency_penalty(logits, output_ids, params.presence_penalty, params.frequency_penalty)
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = stage("penalties", suppress_tokens(logits, list(banned_ids)))
    if params.greedy:
        return logits
    logits = stage("temperature", apply_temperature(logits, params.temperature))
    logits = stage("top_k", apply_top_k(logits, params.top_k))
    logits = stage("top_p", apply_top_p(logits, params.top_p))
    return stage("min_p", apply_min_p(logits, params.min_p))


@dataclass
class Inspection:
    """What the pipeline did to the best candidates for one token: probabilities [candidate][stage].

    Candidates are the `top` best tokens after the penalties, in that order (every later stage keeps it:
    temperature keeps the order, top-k/top-p/min-p only cut its tail); then those of the model's own `top` best that
    the penalties pushed out; then the drawn token if it is not listed yet. A token impossible after the penalties
    is listed only when the model itself ranked it high (an EOS held back by min_tokens, say). A probability of 0
    at a stage means that stage cut the token.
    """

    stages: list[str]
    token_ids: list[int]
    probs: list[list[float]]
    chosen: int


def inspect_stages(stages: list[tuple[str, torch.Tensor]], chosen: int, top: int) -> Inspection:
    """stages: (name, scores [1, vocab]) from `process_logits` -> the top candidates' probability at each stage."""
    names = [name for name, _ in stages]
    probs = torch.stack([scores[0].softmax(dim=-1) for _, scores in stages])  # [stages, vocab]
    top, penalised = min(top, probs.shape[-1]), probs[names.index("penalties")]
    best = penalised.topk(top)
    ids = best.indices[best.values > 0].tolist()
    ids += [t for t in probs[0].topk(top).indices.tolist() + [chosen] if t not in ids]
    ids = torch.tensor(ids)[penalised[ids].argsort(descending=True, stable=True)].tolist()
    table = probs[:, ids].T  # [candidates, stages]
    return Inspection(stages=names, token_ids=ids, probs=table.tolist(), chosen=chosen)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row: argmax when greedy, else a draw from softmax with the request's own generator."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """Each request owns its generator, so one request's draws never depend on another's or touch the global RNG."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic seed from the OS, not from the global torch RNG
    else:
        generator.manual_seed(seed)
    return generator

