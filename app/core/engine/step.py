"""One engine step: what runs together, the forward passes that run it, and the token events they yield.

The Engine (app/core/engine/engine.py) owns the requests: its queue, its admission against the KV budget, and the worker
thread. Each step it hands `StepRunner.run_step` the admitted requests; the runner feeds every one of them (the
next prefill chunk of a new request, or the newest token of a running one) and tells the engine, through three
hooks, when a request's sequence starts, when it yields a token, and when it fails.

Every step first prefills newly admitted requests (in chunks, a bounded number of prompt tokens per step), then
advances every running request by one token in a single batched forward pass. A long generation therefore never
holds back another request's first token by more than one step, and N streams cost about one weight read per step
instead of N. `run_step` is the only place that decides what runs together.

Two shortcuts, both leaving the tokens as they would be without them: a new request starts from the cached KV of
the longest prefix of its prompt seen before (app/core/engine/prefix_cache.py), and a running request may feed n-gram
drafts after its newest token, so one step can emit several of its tokens (app/core/speculative.py).

A forward pass that raises fails only that pass's requests; after an out-of-memory error, its rows are first
rolled back and retried in smaller groups (app/core/engine/faults.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from app.core.engine.faults import cache_lengths, is_out_of_memory, release_cached_memory, roll_back
from app.core.runner.forward import run_pass
from app.core.runner.pieces import PIECE
from app.core.sequence import Sequence, TokenEvent, choose_many
from app.core.engine.handle import RequestHandle
from app.core.engine.kv_budget import KVBudget
from app.core.engine.prefix_cache import PrefixCache
from app.core.speculative import NgramDrafter, accept_drafts
from app.core.engine.tensor_parallel import Leader
from app.core.runner.static_step import StaticDecodeStep
from app.core.sampling import PROMPT_LOGPROBS_CHUNK
from app.metrics import Metrics
from app.models.loading import LoadedModel

log = logging.getLogger("app.core.engine.engine")  # the engine's own log: one name for operators to follow
Work = tuple[RequestHandle, Sequence, int, list[int]]  # a request, the tokens it feeds this step, its drafts
Emitted = tuple[RequestHandle, Sequence, TokenEvent | Exception]  # a token, or why this request cannot go on


def prefix_salt(cache_salt: str | None, adapter) -> str | None:
    """The prefix cache's salt: the request's own, and its LoRA adapter's load (an adapter's KV is its own: its
    keys and values differ from the base's and any other adapter's for the same tokens)."""
    return cache_salt if adapter is None else f"{cache_salt or ''}\0{adapter.key}"


def default_prefill_tokens_per_step(device: torch.device) -> int:
    """How many prompt tokens one engine step may prefill.

    A CPU prefill is compute-bound: 1,500 prompt tokens took 2.3 s here in chunks of 128, 256, 512 or in one
    piece, so small chunks cost nothing and let a burst of new requests take turns. In a burst of 8 ~125-token
    prompts, 128 per step gave a median time to first token of 358 ms against 609 ms with 512, at the same
    tokens/s. A GPU step is mostly fixed cost, so it takes far more per step (vLLM's chunked-prefill default;
    not measured here, where there is no GPU).
    """
    return 128 if device.type == "cpu" else 2048


def share_prefill(budget: int, left: list[int]) -> list[int]:
    """How many prompt tokens each prefilling request feeds this step. `left`: each one's prompt tokens still to
    prefill, in admission order.

    Shortest first: the budget goes to the requests with the fewest tokens left, each taking all it needs, so a
    short prompt admitted behind a long one finishes its prefill in its first step (its first token came 193 s
    late behind a 7,188-token prompt when the oldest took the whole budget), and a burst of equal prompts still
    goes first come, first served (the first to start has the fewest left). A step in which prompts of fewer than
    half the budget's tokens finish stays that short: the prompts still far from done do not top it up, so the
    first token it yields is not kept waiting by a long prompt's chunk (a 128-token chunk at 7,000 tokens of
    context is most of such a step's time on a CPU). Where the finishing prompts fill half the budget or more, the
    step is long anyway and is topped up (cutting it cost a burst of 8 equal prompts 25% of its tokens/s). So that
    a stream of short prompts cannot starve a long one, the oldest always keeps a quarter of the budget. vLLM gets the same effect with `max_num_partial_prefills` and
    `long_prefill_token_threshold` (several prompts prefill in one step, a long one in capped chunks); this rule
    needs no setting.
    """
    shares = [0] * len(left)
    if not left:
        return shares
    half, finishing = budget // 2, 0  # finishing: the tokens of the prompts whose prefill ends this step
    shares[0] = min(left[0], budget // 4)  # the oldest's guarantee
    budget -= shares[0]
    for i in sorted(range(len(left)), key=lambda i: (left[i], i)):
        need = left[i] - shares[i]
        if need <= budget:  # all it needs: its prefill ends this step
            shares[i], budget, finishing = left[i], budget - need, finishing + left[i]
        elif not 0 < finishing < half:  # a short first token waits for no long chunk
            shares[i], budget = shares[i] + budget, 0
    return shares


def align_to_pieces(shares: list[int], done: list[int], left: list[int], piece: int = PIECE) -> list[int]:
    """BATCH_INVARIANT: each prefill share cut back so that its chunk ends on a multiple of `piece` or at its
    prompt's end (`done`: each one's prompt tokens already in its cache). Its attention is then the same pieces
    however the prompt is split into steps (app/core/runner/pieces.py). If that leaves nothing to feed (a budget
    under one piece), the oldest still feeds up to its next multiple, so every prompt moves on."""
    aligned = [share if share == rest else max(0, (start + share) // piece * piece - start)
               for share, start, rest in zip(shares, done, left)]
    if left and not any(aligned):
        aligned[0] = min(left[0], piece - done[0] % piece)
    return aligned


def keep_groups_whole(share: int, done: int, prompt_len: int, groups, piece: int = 1) -> int:
    """A prefill share moved so that its chunk cuts no image run whose tokens see each other both ways (Gemma 3,
    `ImagePrompt.groups`: a query could not see the keys of the run's tokens not fed yet) and, under BATCH_INVARIANT
    (`piece` = PIECE), still ends on a piece or at the prompt's end. The chunk ends before the run it would cut, so
    the step keeps to its budget; where that leaves nothing to feed (the run starts the chunk), it ends after the run,
    over the budget, so that a run longer than the budget still moves on."""
    def cut(end: int):  # the run that a chunk ending at `end` would cut
        return next(((a, b) for a, b in groups if a < end < b), None)

    def fits(end: int) -> bool:
        return end == prompt_len or (end % piece == 0 and cut(end) is None)

    end = done + share
    while end > done and not fits(end):  # back: to the run's start, or the piece's
        end = run[0] if (run := cut(end)) else end // piece * piece
    if end > done:
        return end - done
    end = done + max(share, 1)
    while not fits(end):  # on: past the run, or to the next piece
        end = run[1] if (run := cut(end)) else min(prompt_len, (end // piece + 1) * piece)
    return end - done


@dataclass
class StepRunner:
    """Runs the engine's steps. It keeps no request between steps: each step's batch comes from the engine."""

    lm: LoadedModel
    metrics: Metrics
    kv_budget: KVBudget  # read only, for the reserved-bytes gauge after the prefix cache grows
    prefix_cache: PrefixCache | None  # None: off
    speculative: bool  # running requests feed n-gram drafts
    batch_decode: bool  # all of a step's work in one packed pass; False: one request per pass
    prefill_tokens_per_step: int
    sampling_pool: ThreadPoolExecutor | None  # CPU only: sampled rows side by side (see choose_many)
    # The engine's hooks, called on the worker thread:
    started: Callable[[RequestHandle, Sequence], None]  # a new request's sequence exists (its prefill begins)
    emit: Callable[[RequestHandle, TokenEvent], None]  # a token for the caller; the last one has a finish_reason
    fail: Callable[[list[RequestHandle], Exception], None]  # these requests end with a clean error
    static_decode: StaticDecodeStep | None = None  # DECODE_STEP=compiled: decode-only steps over the KV pool
    # Tensor parallel (app/core/engine/tensor_parallel.py): the other ranks run each pass too; None: the whole model is here
    leader: Leader | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.lm.ranks is not None:
            self.leader = Leader(self.lm, self.batch_decode)

    def run_step(self, batch: list[tuple[RequestHandle, Sequence | None]]) -> None:
        """One engine step: the next prefill chunk of new requests (at most `prefill_tokens_per_step` prompt tokens,
        so a long prompt never stalls running streams for long) and one token for every running request, all in
        one forward pass when the model allows it."""
        if self.leader is not None:
            self.leader.begin_step(batch)
        running = []
        for handle, seq in batch:
            if handle.cancelled.is_set():
                continue  # dropped at the next step's start
            if seq is None and (seq := self._start(handle)) is None:
                continue  # it failed, alone
            running.append((handle, seq))
        prefilling = [(handle, seq) for handle, seq in running if seq.prefilling]
        done = [seq.cache.get_seq_length() for _, seq in prefilling]
        left = [seq.prompt_len - n for (_, seq), n in zip(prefilling, done)]
        # a prompt being scored computes lm_head at each position it feeds: its chunks are capped, and so its logits
        shares = [min(n, PROMPT_LOGPROBS_CHUNK) if seq.prompt_logprobs is not None else n
                  for (_, seq), n in zip(prefilling, share_prefill(self.prefill_tokens_per_step, left))]
        if self.lm.batch_invariant:
            shares = align_to_pieces(shares, done, left)
        shares = [keep_groups_whole(n, d, seq.prompt_len, seq.images.groups, PIECE if self.lm.batch_invariant else 1)
                  if n > 0 and getattr(seq.images, "groups", ()) else n
                  for (_, seq), n, d in zip(prefilling, shares, done)]
        chunks = {handle: n for (handle, _), n in zip(prefilling, shares)}
        work = []
        for handle, seq in running:
            drafts: list[int] = []
            if seq.prefilling:
                n = chunks[handle]
                if n <= 0:
                    continue  # this step's prefill budget is spent; its turn comes next step
            else:
                try:
                    drafts = seq.drafter.propose(seq) if seq.drafter else []
                except Exception as err:  # noqa: BLE001 - one request's failure is its own
                    self.fail([handle], err)
                    continue
                n = 1 + len(drafts)  # the newest token, then any drafts to verify
            work.append((handle, seq, n, drafts))
        # each LoRA adapter's rows side by side (the base's first): its rows are then one slice of the pass for
        # the adapted layers, with no gather or scatter (app/models/lora_layers.py); a stable sort, so without
        # adapters nothing moves
        work.sort(key=lambda entry: "" if entry[1].adapter is None else entry[1].adapter.key)
        groups = [work] if self.batch_decode and work else [[entry] for entry in work]
        for group in groups:
            for handle, seq, event in self._run_pass(group):
                if isinstance(event, Exception):  # this request cannot go on; the others in its pass do
                    self.fail([handle], event)
                    continue
                self.emit(handle, event)
                # a later turn of this conversation starts with all of it; not under BATCH_INVARIANT, where the
                # generated tokens' keys (decode rows) are not what a prompt's prefill pieces compute
                if event.finish_reason and not self.lm.batch_invariant:
                    self._remember(seq.cache_keys(seq.token_ids[0, : seq.length].tolist()), seq)

    def _start(self, handle: RequestHandle) -> Sequence | None:
        """A newly admitted request's Sequence, from any cached prefix of its prompt; None: it failed (a prompt the
        model cannot take, no memory for the cached prefix's copy), and only it ends."""
        try:
            seq = Sequence(self.lm.model, self.lm.tokenizer, handle.prompt_ids, handle.params, self.lm.eos_ids,
                           self.lm.max_context, handle.max_new_tokens, kv_int8=self.lm.kv_int8)  # checked at submit
            seq.images = handle.images
            self._reuse_prefix(handle, seq)
        except Exception as err:  # noqa: BLE001 - one request's failure is its own
            self.fail([handle], err)
            return None
        seq.adapter = handle.adapter
        if self.speculative:  # an adapter's rows verify drafts with the same adapter: exact as without one
            seq.drafter = NgramDrafter()
        self.started(handle, seq)
        return seq

    def _run_pass(self, group: list[Work]) -> list[Emitted]:
        """One forward pass and the tokens it yields, or for a request that cannot go on (its grammar allows no
        token, say) its error instead. If the pass itself fails, only its requests fail; after an out-of-memory
        error, its rows are first rolled back and retried in two halves, down to one row, before failing."""
        before = [(seq.length, cache_lengths(seq.cache)) for _, seq, *_ in group]
        try:
            return self._forward_and_choose(group)
        except Exception as err:  # noqa: BLE001 - one pass failing must not stop the engine
            if not is_out_of_memory(err) or len(group) == 1:
                self.fail([handle for handle, *_ in group], err)
                return []
            log.warning("out of memory in a pass of %d rows; retrying them in smaller groups", len(group))
            release_cached_memory(self.lm.device)
            retry, lost = [], []
            for entry, (length, lengths) in zip(group, before):
                seq = entry[1]
                (retry if seq.length == length and roll_back(seq.cache, lengths) else lost).append(entry)
            self.fail([handle for handle, *_ in lost], err)
            half = (len(retry) + 1) // 2
            return self._run_pass(retry[:half]) + self._run_pass(retry[half:]) if retry else []

    def _forward_and_choose(self, group: list[Work]) -> list[Emitted]:
        """One forward pass and the step's tokens. Its logits have one row per request, or 1 + k for a request
        verifying k drafts; single rows are chosen together, drafts are checked request by request."""
        n_out = [seq.n_out(n, len(drafts)) for _, seq, n, drafts in group]  # before the pass moves the caches on
        logits = self._forward(group) if self.leader is None else self.leader.forward(group, self._forward)
        singles, single_rows, events, row, prompts_done = [], [], [], 0, []
        for (handle, seq, n, drafts), k in zip(group, n_out):
            rows, row = slice(row, row + k), row + k
            if seq.prompt_logprobs is not None and seq.n_generated == 0:
                seq.score_prompt(logits[rows])  # the prompt's own logprobs, from this prefill pass
                rows = slice(rows.stop - 1, rows.stop)  # its last position's row chooses the first token
            if seq.prefilling:
                continue  # a prefill chunk that was not the prompt's last: no token yet
            if seq.n_generated == 0:
                prompts_done.append((handle, seq.prompt_len))
                self._remember(seq.cache_keys(handle.prompt_ids), seq)
            if drafts:
                try:
                    verified, accepted = accept_drafts(seq, logits[rows], drafts)
                except Exception as err:  # noqa: BLE001 - one request's failure is its own
                    events.append((handle, seq, err))
                    continue
                handle.metrics.draft_tokens.inc(len(drafts))
                handle.metrics.accepted_tokens.inc(accepted)
                events += [(handle, seq, event) for event in verified]
            else:
                singles.append((handle, seq))
                single_rows.append(rows.start)
        if not singles:
            return events
        if len(single_rows) < logits.shape[0]:
            logits = logits[single_rows]  # only the rows still to choose: choose_many takes [B, vocab]
        chosen = choose_many([seq for _, seq in singles], logits, self.sampling_pool)
        for handle, prompt_len in prompts_done:  # once chosen: a pass retried after an OOM counts once
            handle.metrics.prompt_tokens.inc(prompt_len)
        return events + [(handle, seq, event) for (handle, seq), event in zip(singles, chosen)]

    def _forward(self, group: list[Work]) -> torch.Tensor:
        """Logits at each row's last fed position, or its last 1 + k to verify k drafts (app/core/runner/forward.py)."""
        logits, path = run_pass(self.lm.model, [(seq, n) for _, seq, n, _ in group],
                                [seq.n_out(n, len(drafts)) for _, seq, n, drafts in group], self.static_decode,
                                self.lm.batch_invariant)
        if all(n == 1 and not seq.prefilling for _, seq, n, _ in group):
            self.metrics.decode_steps.labels(path=path).inc()
        return logits

    def _reuse_prefix(self, handle: RequestHandle, seq: Sequence) -> None:
        """Start a new request from the cached KV of the longest cached prefix of its prompt, if any."""
        if self.prefix_cache is None or seq.prompt_logprobs is not None:  # a scored prompt needs every position
            return
        handle.metrics.prefix_cache_queried.inc(seq.prompt_len)
        blocks = self.prefix_cache.match(seq.cache_keys(handle.prompt_ids), prefix_salt(handle.params.cache_salt, handle.adapter))
        if blocks:
            seq.cache = self.prefix_cache.load(blocks, self.lm.model.config, limit=seq.token_ids.shape[1])
            handle.cached_tokens = seq.cache.get_seq_length()
            handle.metrics.prefix_cache_hits.inc(handle.cached_tokens)

    def _remember(self, token_ids: list[int], seq: Sequence) -> None:
        """Offer a sequence's KV to the prefix cache (only its blocks not cached yet are copied). A shortcut: if it
        fails, the request's tokens are already right, so the failure is logged, never raised into the step."""
        if self.prefix_cache is None:
            return
        try:
            as_dynamic = getattr(seq.cache, "as_dynamic_cache", None)  # a KV pool handle (DECODE_STEP=compiled)
            self.prefix_cache.insert(token_ids, as_dynamic(self.lm.model.config) if as_dynamic else seq.cache,
                                     prefix_salt(seq.params.cache_salt, seq.adapter))
        except Exception:  # noqa: BLE001
            log.exception("the prefix cache could not keep a sequence; serving goes on without it")
        self.metrics.kv_cache_reserved.set(self.kv_budget.in_use)

