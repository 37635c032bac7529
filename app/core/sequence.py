"""What one request owns while it generates, and how its next token is chosen: the state that the article's loop
(app/core/generate.py) and the engine's steps (app/core/engine/step.py) share.

`Sequence` holds a request's tokens, its own KV cache (a DynamicCache that grows in place,
app/core/runner/kv_store.py), its seeded generator, its detokenizer and its stop state.
`choose_many` picks the next token of several sequences from one pass's logits at once; `Sequence.accept` turns a
chosen token into the event a caller sees. Every path, solo or batched, chooses through these two.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from app.core.detokenize import IncrementalDetokenizer
from app.core.preamble import PreambleState
from app.core.runner.kv_store import KVStore
from app.core.sampling import (MAX_PROMPT_LOGPROBS_TOKENS, Inspection, SamplingParams, inspect_stages,
                               make_generator, process_logits, sample)
from app.core.stopping import StopStringFilter, special_stop_ids, token_finish_reason
from app.errors import InvalidRequest


NO_TOKEN = -1  # the token_id of a last event that carries no token: a deadline ended the sequence between steps


@dataclass
class TokenEvent:
    """One generated token, as a caller sees it."""

    token_id: int
    text: str  # newly visible text; "" while a character or a possible stop string is incomplete
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    inspection: Inspection | None = None  # each stage's top candidates, when params.inspect asks for them
    finish_reason: str | None = None  # "stop" | "length" | "timeout" on the last event
    stop_string: str | None = None  # the stop string (of params.stop) that ended generation, if one did
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first event, when params.prompt_logprobs asks


@dataclass
class PromptLogprob:
    """How likely the model found one prompt token, given the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1: the model's own first choice
    top: list[tuple[int, float]]  # the `prompt_logprobs` most likely tokens at this position


def score_tokens(logits: torch.Tensor, next_ids: torch.Tensor, top_n: int) -> list[PromptLogprob]:
    """logits [n, vocab] at n positions, next_ids [n]: the token that came next at each -> each token's log
    probability under the model's own distribution (no temperature or penalties, as OpenAI and vLLM report it)."""
    logprobs = logits.float().log_softmax(dim=-1)  # [n, vocab]
    chosen = logprobs.gather(-1, next_ids[:, None])  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [n]
    top = logprobs.topk(top_n, dim=-1) if top_n else None
    return [PromptLogprob(token_id, logprob, rank,
                          list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else [])
            for i, (token_id, logprob, rank) in enumerate(zip(next_ids.tolist(), chosen[:, 0].tolist(),
                                                              ranks.tolist()))]


def check_request(prompt_ids: Seq[int], params: SamplingParams, vocab_size: int, max_context: int) -> int:
    """Reject what cannot run before any compute is spent; return how many tokens may be generated."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param="messages")
    if params.prompt_logprobs is not None and len(prompt_ids) > MAX_PROMPT_LOGPROBS_TOKENS:
        raise InvalidRequest(f"prompt logprobs are served for prompts of up to {MAX_PROMPT_LOGPROBS_TOKENS} tokens; "
                             f"this one has {len(prompt_ids)}", param="prompt_logprobs")
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
                 max_context: int, max_new_tokens: int | None = None, kv_int8: bool = False):
        """`max_new_tokens`: what `check_request` returned for this request, where the caller (the engine, at
        submit) has checked it already; None: check it here. `kv_int8`: an 8-bit cache (KV_CACHE_DTYPE=int8)."""
        self.params = params
        self.max_new_tokens = (max_new_tokens if max_new_tokens is not None
                               else check_request(prompt_ids, params, model.config.vocab_size, max_context))
        self.prompt_len = len(prompt_ids)
        device = model.device
        # prompt + output ids in one preallocated row, so penalties read a view instead of building a tensor per step
        self.token_ids = torch.zeros(1, self.prompt_len + self.max_new_tokens, dtype=torch.long, device=device)
        self.token_ids[0, : self.prompt_len] = torch.tensor(list(prompt_ids), device=device)
        self.length = self.prompt_len
        # its own KV cache, grown in place and never past the prompt + max_tokens the KV budget reserved
        self.cache = KVStore(model.config, limit=self.token_ids.shape[1], int8=kv_int8)
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
        # prompt logprobs, scored chunk by chunk from the prefill's own logits; they go out with the first token
        self.prompt_logprobs: list[PromptLogprob] | None = [] if params.prompt_logprobs is not None else None
        self.adapter = None  # an app.models.lora.LoraAdapter whose product every pass adds; None: the base model
        self.images = None  # an app.models.vision.ImagePrompt: embeddings the pass writes over its image placeholders

    def cache_keys(self, token_ids: list[int]) -> list:
        """Its tokens as the prefix cache keys them: an image's placeholders by that image's pixels."""
        return token_ids if self.images is None else self.images.keys(token_ids)

    @property
    def n_generated(self) -> int:
        return self.length - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.cache.get_seq_length() < self.prompt_len

    def n_out(self, fed: int, drafts: int) -> int:
        """How many logits rows a pass feeding `fed` tokens (`drafts` of them drafts) returns for this sequence:
        one per fed position while its prompt is scored, else its last position and one per draft. Call it
        before the pass: the pass ends the prefill it feeds."""
        return fed if self.prefilling and self.prompt_logprobs is not None else 1 + drafts

    def score_prompt(self, logits: torch.Tensor) -> torch.Tensor:
        """After a prefill pass that returned a row per fed position: logits [fed, vocab] -> the prompt tokens'
        logprobs are kept, and the logits of the next position are returned, [1, vocab] (what comes after the
        prompt, once the prefill is done). The first prompt token has no logprob: nothing came before it."""
        end = self.cache.get_seq_length()  # the positions fed were end - fed .. end - 1
        scored = min(end, self.prompt_len - 1) - (end - len(logits))  # rows whose next token is a prompt token
        if scored > 0:
            next_ids = self.token_ids[0, end - len(logits) + 1 : end - len(logits) + 1 + scored]
            self.prompt_logprobs += score_tokens(logits[:scored], next_ids, self.params.prompt_logprobs)
        return logits[-1:]

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
        if self.n_generated == 1 and self.prompt_logprobs is not None:
            event.prompt_logprobs = self.prompt_logprobs
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
