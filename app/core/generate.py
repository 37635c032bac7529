"""The decode loop: the article's `simple_generate`, with a per-request KV cache, streaming events and stop rules.

    1) prefill: run the model body over the prompt once, filling this request's own DynamicCache,
       and make logits for the last position only (full-prompt logits would be prompt_len x vocab floats),
       as the model's own forward makes them (app/models/logits.py: lm_head, then any scaling or soft-capping);
    2) choose the next token from those logits (app.core.sampling);
    3) turn it into text and check the stop rules (app.core.detokenize, app.core.stopping), and yield an event;
    4) decode: feed only the new token at its position, and go back to 2.

`generate()` is that loop for one request. The engine drives the same steps for many requests at once, running
all their prefill chunks and decode tokens in one pass (`forward_many`), then choose every next token at once
(`choose_many`). `reference_generate` is the article's first, cache-free version, kept as a test oracle: it must
produce exactly the same greedy tokens.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Iterator, Sequence as Seq

import torch
from transformers import DynamicCache

from app.core.runner.packed import PackedCaches, attention_windows, decode_matmuls, packed_inputs
from app.core.detokenize import IncrementalDetokenizer
from app.core.preamble import PreambleState
from app.errors import InvalidRequest
from app.models.logits import logits_from_hidden
from app.models.batch_rows import batch_rows
from app.core.sampling import Inspection, SamplingParams, inspect_stages, make_generator, process_logits, sample
from app.core.stopping import StopStringFilter, special_stop_ids, token_finish_reason


@dataclass
class TokenEvent:
    """One generated token, as a caller sees it."""

    token_id: int
    text: str  # newly visible text; "" while a character or a possible stop string is incomplete
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    inspection: Inspection | None = None  # each stage's top candidates, when params.inspect asks for them
    finish_reason: str | None = None  # "stop" | "length" on the last event
    stop_string: str | None = None  # the stop string (of params.stop) that ended generation, if one did


def check_request(prompt_ids: Seq[int], params: SamplingParams, vocab_size: int, max_context: int) -> int:
    """Reject what cannot run before any compute is spent; return how many tokens may be generated."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param="messages")
    params.check_vocab(vocab_size)
    room = max_context - len(prompt_ids)
    wanted = params.max_tokens if params.max_tokens is not None else room
    if room < 1 or wanted > room:
        raise InvalidRequest(
            f"this model's context window is {max_context} tokens; the prompt has {len(prompt_ids)} tokens "
            f"and max_tokens asks for {wanted} more", param="max_tokens" if room >= 1 else "messages",
            code="context_length_exceeded")
    return wanted


class Sequence:
    """Everything one request owns: its tokens, KV cache, random generator, detokenizer and stop state."""

    def __init__(self, model, tokenizer, prompt_ids: Seq[int], params: SamplingParams, eos_ids: Seq[int],
                 max_context: int):
        self.params = params
        self.max_new_tokens = check_request(prompt_ids, params, model.config.vocab_size, max_context)
        self.prompt_len = len(prompt_ids)
        device = model.device
        # prompt + output ids in one preallocated row, so penalties read a view instead of building a tensor per step
        self.token_ids = torch.zeros(1, self.prompt_len + self.max_new_tokens, dtype=torch.long, device=device)
        self.token_ids[0, : self.prompt_len] = torch.tensor(list(prompt_ids), device=device)
        self.length = self.prompt_len
        self.cache = DynamicCache(config=model.config)
        self.generator = make_generator(params.seed, device)
        self.eos_ids = frozenset(eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids) | special_stop_ids(tokenizer, params.stop)
        # EOS and stop ids are banned until min_tokens exist (vLLM semantics)
        ends = (set() if params.ignore_eos else set(self.eos_ids)) | self.stop_ids
        self.banned_until_min = sorted(ends) if params.min_tokens else []
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop_filter = StopStringFilter(params.stop)
        self.stages: list[tuple[str, torch.Tensor]] | None = None  # the last pick's stages, when inspecting
        self.finish_reason: str | None = None
        # a reasoning model's thinking: once its budget is spent, the tokens that close it are forced
        self.preamble = PreambleState(params.preamble) if params.preamble is not None else None
        # structured output: a grammar masks the answer's tokens (after any thinking); EOS is the grammar's to allow
        self.grammar = params.grammar.matcher() if params.grammar is not None else None
        self.drafter = None  # an app.core.speculative.NgramDrafter when the engine speculates for this request

    @property
    def n_generated(self) -> int:
        return self.length - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.cache.get_seq_length() < self.prompt_len

    @property
    def last_token(self) -> torch.Tensor:
        return self.token_ids[:, self.length - 1 : self.length]  # [1, 1]

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first: the next token is the argmax of the raw logits."""
        p = self.params
        return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and not p.logit_bias and not p.inspect and not self._banned() and not self.constrained)

    @property
    def constrained(self) -> bool:
        """The grammar applies to the next token: there is one, and any thinking is over."""
        return self.grammar is not None and (self.preamble is None or (self.preamble.ended
                                                                       and self.preamble.forced_token() is None))

    def forced_token(self) -> int | None:
        return self.preamble.forced_token() if self.preamble is not None else None

    def _banned(self) -> list[int]:
        if self.grammar is not None:  # the grammar decides when EOS may come: when the document is complete
            return []
        return self.banned_until_min if self.n_generated < self.params.min_tokens else []

    def choose(self, logits: torch.Tensor) -> TokenEvent:
        """logits: [1, vocab] raw scores for the next position -> the chosen token as an event."""
        event = choose_many([self], logits)[0]
        if isinstance(event, Exception):
            raise event
        return event

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [1, vocab] -> the token [1], on the device: nothing waits for it."""
        self.stages = [] if self.params.inspect else None
        if not self.constrained:
            return self._choose(logits)
        self.grammar.fill()
        if self.grammar.dead_end:  # nothing may follow: masking would leave only -inf, and sampling NaN
            raise self.grammar.dead_end_error(self.n_generated)
        if self._cheap_greedy_check(logits):
            # Greedy under a grammar, checked first the way llama.cpp does: if the best token is allowed it is
            # also the best allowed one (the mask only removes tokens, and the penalties are per token), so the
            # ~1 ms pass that masks 151,936 logits is spent only on the steps where the model's choice is refused.
            token = self._choose(logits)
            if self.grammar.allows(int(token)):
                return token
        return self._choose(self.grammar.apply(logits))  # forbidden tokens become -inf before anything else

    def _cheap_greedy_check(self, logits: torch.Tensor) -> bool:
        # on a GPU the mask is one cheap kernel and reading the token back would be a sync: mask as usual there
        return self.params.greedy and self.stages is None and logits.device.type == "cpu"

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        scores = process_logits(logits, self.params, self.token_ids[:, : self.length],
                                self.token_ids[:, self.prompt_len : self.length], self._banned(), self.stages)
        return sample(scores, self.params, self.generator)

    def accept(self, token_id: int, logits: torch.Tensor) -> TokenEvent:
        """Append the chosen token and turn it into an event: logprobs if asked, text, stop checks."""
        if self.constrained and not self.grammar.accept(token_id):
            raise RuntimeError(f"token {token_id} does not continue the grammar")  # the mask makes this impossible
        self.token_ids[:, self.length] = token_id
        self.length += 1
        if self.preamble is not None:
            self.preamble.observe(token_id, self.n_generated)
        event = TokenEvent(token_id=token_id, text="")
        if self.params.logprobs:
            logprobs = logits.log_softmax(dim=-1)[0]  # OpenAI and vLLM report the model's own distribution
            event.logprob = float(logprobs[token_id])
            if self.params.top_logprobs:
                top = logprobs.topk(self.params.top_logprobs)
                event.top_logprobs = list(zip(top.indices.tolist(), top.values.tolist()))
        if self.stages:
            event.inspection = inspect_stages(self.stages, token_id, self.params.inspect)
        return self._finish_event(event)

    def _finish_event(self, event: TokenEvent) -> TokenEvent:
        p = self.params
        reason = token_finish_reason(event.token_id, self.n_generated, self.max_new_tokens, self.eos_ids,
                                     p.min_tokens, p.ignore_eos, self.stop_ids)
        if reason is None and self.grammar is not None and self.grammar.terminated:
            reason = "stop"  # the document is complete: nothing may follow it, whatever ignore_eos says
        stopped_by_id = reason == "stop" and event.token_id in self.stop_ids
        # a stop token's own text is never shown, like a stop string's
        text = "" if stopped_by_id else self.detokenizer.add(event.token_id)
        if reason is not None:  # the last token: release what the detokenizer still holds
            text += self.detokenizer.flush()
        matched = False
        if self.n_generated >= p.min_tokens:  # stop strings count only once min_tokens exist (vLLM semantics)
            text, matched = self.stop_filter.feed(text)
        if matched:
            reason = "stop"  # the stop string and anything after it are never shown
            event.stop_string = self.stop_filter.matched
        elif stopped_by_id and event.token_id not in p.stop_token_ids:  # a stop string that is one special token
            event.stop_string = self.detokenizer.tokenizer.added_tokens_decoder[event.token_id].content
        elif reason is not None:
            text += self.stop_filter.flush()  # a held tail that never became a stop string is real output
        event.text, event.finish_reason = text, reason
        self.finish_reason = reason
        return event


def choose_many(seqs: Seq[Sequence], logits: torch.Tensor,
                pool: Executor | None = None) -> list[TokenEvent | Exception]:
    """The next token for each sequence from logits [B, vocab], with one device-to-host transfer for all of them.

    A row that cannot go on (its grammar allows no token, say) gets its exception in its place and no token, so
    it ends only its own request: its neighbours' tokens are the same as without it.

    Rows that are plain greedy share one argmax; every other row runs its own processors and draws from its own
    generator (so a seeded request gets the same tokens alone or in any batch). Either way the chosen ids stay
    on the device until the single `.tolist()`: on a GPU that is one sync per step, not one per request.

    `pool`: on a CPU a sampled row is expensive with a large vocabulary (Qwen2.5, 151,936 tokens: ~6 ms, mostly
    top-p's sort and the 151,936 exponential draws inside torch.multinomial, which HF-identical seeds require).
    The rows are independent, so a thread pool can run them side by side: in a batch of 8 after a forward pass,
    37 ms one after another and 28 ms on 2 workers here. Each row's result is the same either way.
    """
    tokens = logits.argmax(dim=-1)  # [B]: the answer for plain greedy rows; the other rows are overwritten below
    forced = {row: token for row, seq in enumerate(seqs) if (token := seq.forced_token()) is not None}
    sampled = [row for row, seq in enumerate(seqs) if not seq.plain_greedy and row not in forced]

    def pick(row: int) -> torch.Tensor | Exception:
        try:
            return seqs[row].pick(logits[row : row + 1])
        except Exception as err:  # noqa: BLE001 - this row's failure is its own request's, not the batch's
            return err

    failed: dict[int, Exception] = {}
    picked = pool.map(pick, sampled) if pool is not None and len(sampled) > 1 else map(pick, sampled)
    for row, token in zip(sampled, picked):
        if isinstance(token, Exception):
            failed[row] = token
        else:
            tokens[row : row + 1] = token
    for row, token in forced.items():  # a spent thinking budget: these tokens come whatever the logits say
        tokens[row], seqs[row].stages = token, None  # not drawn, so nothing to inspect
    return [failed[row] if row in failed else accept_row(seq, token_id, logits[row : row + 1])
            for row, (seq, token_id) in enumerate(zip(seqs, tokens.tolist()))]


def accept_row(seq: Sequence, token_id: int, logits: torch.Tensor) -> TokenEvent | Exception:
    """`seq.accept`, with a failure returned for its own request rather than raised through the batch."""
    try:
        return seq.accept(token_id, logits)
    except Exception as err:  # noqa: BLE001
        return err


@torch.inference_mode()
def prefill(model, seq: Sequence, chunk_size: int | None = None) -> torch.Tensor | None:
    """Run the prompt (or its next `chunk_size` tokens) into the cache; once all of it is in, return float32
    logits [1, vocab] for the next token only. Chunks let the engine keep other streams decoding meanwhile."""
    start = seq.cache.get_seq_length()
    end = seq.prompt_len if chunk_size is None else min(seq.prompt_len, start + chunk_size)
    input_ids = seq.token_ids[:, start:end]  # [1, S]
    positions = torch.arange(start, end, device=input_ids.device)[None, :]  # [1, S]
    hidden = model.model(input_ids=input_ids, position_ids=positions, cache=seq.cache, use_cache=True)
    if end < seq.prompt_len:
        return None
    return logits_from_hidden(model, hidden.last_hidden_state[:, -1:, :])[:, -1, :].float()


@torch.inference_mode()
def decode_step(model, seq: Sequence) -> torch.Tensor:
    """Feed only the newest token at its position; the cache holds everything before it."""
    position = torch.tensor([[seq.length - 1]], device=seq.token_ids.device)  # [1, 1]
    hidden = model.model(input_ids=seq.last_token, position_ids=position, cache=seq.cache, use_cache=True)
    return logits_from_hidden(model, hidden.last_hidden_state)[:, -1, :].float()  # [1, vocab]


@torch.inference_mode()
@batch_rows()
def forward_many(model, work: list[tuple[Sequence, int]], n_out: Seq[int] | None = None) -> torch.Tensor:
    """One forward pass for several sequences: each feeds its next `n` tokens (a prefill chunk, 1 to decode, or
    the last token and k drafts to verify them: app/core/speculative.py).

    Returns float32 logits at each sequence's last `n_out[i]` fed positions (default 1), stacked in order:
    [sum(n_out), vocab]. The tokens travel packed in one row and each sequence's keys and values land in its own
    cache (app/core/runner/packed.py explains how). In fp32 on a CPU the linears take its several rows on faster
    kernels than `nn.Linear`'s (app/models/batch_rows.py), which round differently as any batching does; one row,
    the article's loop above (`prefill`, `decode_step`) and `model.generate()` keep `nn.Linear`'s own arithmetic.
    """
    n_out = n_out or [1] * len(work)
    device = work[0][0].token_ids.device
    if len(work) == 1 and not decode_matmuls(device, model.dtype):
        # Nothing to pack: one request's pass is the solo pass itself, HF's own SDPA over its own cache, without the
        # packed pass's per-layer splitting and padded copies (46.1 -> 42.3 ms a step for one int8 stream on 2 AVX2
        # cores). Not in half precision on a CPU, where the packed pass's fp32 decode matmuls beat SDPA.
        (seq, n), = work
        return forward_solo(model, seq, n, n_out[0])
    items = []
    for seq, n in work:
        cached = seq.cache.get_seq_length()
        items.append((seq.token_ids[0, cached : cached + n], cached))
    packed = packed_inputs(items, device)
    cache = PackedCaches([seq.cache for seq, _ in work], packed["spans"], device, attention_windows(model))
    hidden = model.model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], cache=cache,
                         use_cache=True, attention_mask=packed["attention_mask"]).last_hidden_state  # [1, T, H]
    last = torch.tensor([end - n + j for (_, end), n in zip(packed["spans"], n_out) for j in range(n)],
                        device=device)
    return logits_from_hidden(model, hidden[:, last])[0].float()  # only where a token is to be chosen


def forward_solo(model, seq: Sequence, n: int, n_out: int = 1) -> torch.Tensor:
    """One sequence feeds its next n tokens with its own cache, as `prefill` and `decode_step` do: float32 logits
    [n_out, vocab] at its last n_out fed positions."""
    start = seq.cache.get_seq_length()
    input_ids = seq.token_ids[:, start : start + n]  # [1, n]
    positions = torch.arange(start, start + n, device=input_ids.device)[None, :]  # [1, n]
    hidden = model.model(input_ids=input_ids, position_ids=positions, cache=seq.cache, use_cache=True)
    return logits_from_hidden(model, hidden.last_hidden_state[:, -n_out:])[0].float()


def generate(model, tokenizer, prompt_ids: Seq[int], params: SamplingParams, eos_ids: Seq[int],
             max_context: int) -> Iterator[TokenEvent]:
    """Stream one request's tokens. Stop iterating at any time to cancel; the cache goes with the Sequence."""
    seq = Sequence(model, tokenizer, prompt_ids, params, eos_ids, max_context)
    logits = prefill(model, seq)  # 1) prefill
    while True:
        event = seq.choose(logits)  # 2) choose + 3) detokenize and check stop rules
        yield event
        if event.finish_reason:
            return
        logits = decode_step(model, seq)  # 4) decode: feed only the new token


@torch.inference_mode()
def reference_generate(model, prompt_ids: Seq[int], max_new_tokens: int, eos_ids: Seq[int]) -> list[int]:
    """The article's first version: no cache, the whole sequence every step, greedy. A test oracle, not for serving."""
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    output: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [1, S, H]
        logits = logits_from_hidden(model, hidden[:, -1:, :])[:, -1]  # [1, vocab]: last position only
        next_id = logits.argmax(dim=-1)  # [1]
        output.append(int(next_id.item()))
        if output[-1] in eos_ids:
            break
        ids = torch.cat([ids, next_id[:, None]], dim=-1)
    return output
