"""Tensor parallelism in the engine: rank 0 decides every pass, the other ranks run the same pass on their shards.

The model is split by transformers' own plan (app/models/distributed.py), so every forward pass is a collective:
each rank must feed the same tokens at the same positions, and request by request the same caches. Rank 0 runs
the whole engine (HTTP, admission, sampling); `Leader`, hooked into its StepRunner, broadcasts each pass's inputs
just before running it:

    ("pass", ended, packed, rows)  ended: request keys whose caches go; packed: rank 0 runs packed attention
                                   rows: (key, start, tokens, n_out, length, new) per request, in the
                                   pass's order; new: (prompt_len, size) the first time a request runs
    ("sync",)                      the last pass raised on rank 0: every rank meets at a barrier before the next
    ("beat",)                      nothing to run; rank 0 is alive (app/models/distributed.py)
    ("stop",)                      the server is shutting down

`follow` is the loop on every other rank. It keeps a `Mirror` per request (its token ids and its own DynamicCache,
which holds this rank's heads) and calls the dispatcher rank 0's StepRunner calls (`run_pass`,
app/core/runner/forward.py), so the two never diverge in which collectives they run (lm_head gathers its logits
only where a token is to be chosen). Only rank 0 samples.

`start` is rank 0's cache length for the row: a follower cuts its cache back to it first, which is how n-gram
speculation's cropped drafts (app/core/speculative.py) stay mirrored without a message of their own. The prefix
cache is off under tensor parallelism: its blocks would have to be mirrored on every rank.

A pass that raises on rank 0 (an out-of-memory error from one long prompt, say) fails only its requests, as
without tensor parallelism, if the ranks are still in step: rank 0 sends ("sync",) and waits at a barrier. A
follower whose own pass raised too (every shard allocates the same sizes, so an out-of-memory error is usually
every rank's) or finished it comes to the barrier; the next message's `start` cuts its caches back to rank 0's
(rolled back, or retried in smaller groups) and `ended` drops the failed requests. A follower that does not come
is stuck in a collective rank 0 never joined: that, and a broadcast that fails, is fatal (`RankLost`), so the
engine stops, every request in flight gets a clean error, and the process exits for its supervisor to restart it.
"""

from __future__ import annotations

import itertools
import logging
import signal
from typing import Any, Callable

import torch
from transformers import DynamicCache

from app.core.runner.packed import PACKED, enable_packed_batching
from app.core.engine.faults import roll_back
from app.core.runner.forward import run_pass
from app.models.loading import LoadedModel

log = logging.getLogger("app.core.engine.engine")


class RankLost(BaseException):
    """The ranks no longer run in step. A BaseException so that no per-pass handler takes it for one request's
    failure: it ends the engine (app/core/engine/engine.py), and with it every request in flight."""


class Leader:
    """Rank 0's side: the message for each pass, sent just before the pass runs."""

    def __init__(self, lm: LoadedModel, packed: bool):
        self.ranks = lm.ranks
        self.packed = packed
        self._keys: dict[Any, int] = {}  # RequestHandle (by identity) -> the key the followers know it by
        self._ended: list[int] = []  # keys whose caches the followers drop with the next message
        self._next_key = itertools.count()

    def begin_step(self, batch: list) -> None:
        """The engine's active requests this step: any other request it was running has ended (finished,
        failed, cancelled), and so has a cancelled one still listed."""
        live = {handle for handle, _ in batch if not handle.cancelled.is_set()}
        for handle in [h for h in self._keys if h not in live]:
            self._ended.append(self._keys.pop(handle))

    def forward(self, group: list, run: Callable[[list], torch.Tensor | None]) -> torch.Tensor | None:
        """Broadcast this pass, then run it here: `run(group)` is the StepRunner's own forward."""
        if self.ranks.lost:
            raise RankLost(f"tensor parallel: a rank is gone ({self.ranks.lost})")
        rows = []
        for handle, seq, n, drafts in group:
            new = handle not in self._keys
            key = self._keys.setdefault(handle, next(self._next_key))
            start = seq.cache.get_seq_length()
            rows.append((key, start, seq.token_ids[0, start : start + n].tolist(), seq.n_out(n, len(drafts)), seq.length,
                         (seq.prompt_len, seq.token_ids.shape[1]) if new else None))
        ended, self._ended = self._ended, []
        try:
            self.ranks.send(("pass", ended, self.packed, rows))
        except Exception as err:  # noqa: BLE001 - the followers may or may not have this pass
            raise RankLost(f"tensor parallel: a rank is gone: {_first_line(err)}") from err
        try:
            return run(group)
        except Exception as err:  # noqa: BLE001 - its requests' failure, if every rank is still in step
            try:
                self.ranks.sync()
            except Exception as lost:  # noqa: BLE001 - a follower is stuck in this pass's collectives
                raise RankLost(f"tensor parallel: the pass failed on rank 0 ({_first_line(err)}) and a rank "
                               f"did not come back in step: {_first_line(lost)}") from err
            raise


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


class Mirror:
    """A follower's copy of one request: what the forward pass reads from a Sequence (its tokens and its cache)."""

    def __init__(self, model, prompt_len: int, size: int):
        self.prompt_len = prompt_len
        self.length = prompt_len
        self.token_ids = torch.zeros(1, size, dtype=torch.long, device=model.device)
        self.cache = DynamicCache(config=model.config)

    def feed(self, start: int, tokens: list[int], length: int) -> None:
        """Take rank 0's view of this row: its cache length (cropping what rank 0 cropped) and the tokens fed."""
        # every layer cut back to `start`: after a pass that raised, some layers may be ahead of the others
        if not roll_back(self.cache, [start] * len(self.cache.layers)) or self.cache.get_seq_length() != start:
            raise RuntimeError(f"out of step: this rank's cache holds {self.cache.get_seq_length()} tokens, "
                               f"rank 0's {start}")
        self.token_ids[0, start : start + len(tokens)] = torch.tensor(tokens, device=self.token_ids.device)
        self.length = length


@torch.inference_mode()
def follow(lm: LoadedModel) -> dict[int, Mirror]:
    """Ranks > 0: run every pass rank 0 announces, until it says stop; returns the requests still held then.
    Raises if rank 0 died or went silent."""
    model, ranks = lm.model, lm.ranks
    mirrors: dict[int, Mirror] = {}
    while True:
        message = ranks.receive()
        if message[0] == "stop":
            return mirrors
        if message[0] == "sync":  # the last pass raised on rank 0: show that this rank is not stuck in it
            ranks.sync()
        if message[0] != "pass":
            continue  # a heartbeat
        _, ended, packed, rows = message
        if packed and model.config._attn_implementation != PACKED:
            enable_packed_batching(model)  # as rank 0's engine did: the pass takes the same path here
        for key in ended:
            mirrors.pop(key, None)
        work = []
        for key, start, tokens, n_out, length, new in rows:
            if new is not None:
                mirrors[key] = Mirror(model, *new)
            mirror = mirrors[key]
            mirror.feed(start, tokens, length)
            work.append((mirror, len(tokens), n_out))
        try:
            run_pass(model, [(mirror, n) for mirror, n, _ in work], [n_out for *_, n_out in work], None,
                     lm.batch_invariant)  # BATCH_INVARIANT: loaded from the same settings as rank 0's
        except Exception as err:  # noqa: BLE001 - rank 0's pass likely raised too; it says so with ("sync",)
            log.warning("tensor parallel: rank %d: a pass raised: %s", ranks.rank, _first_line(err))


def run_follower(load: Callable[[], LoadedModel]) -> int:
    """A follower process's whole life: load its shard, follow rank 0, leave the group. Exit code 1 if rank 0 died,
    went silent or the ranks fell out of step."""
    torch.set_grad_enabled(False)
    # torchrun passes a SIGTERM or Ctrl-C to every rank at once; rank 0 then drains its requests, which still need
    # this rank's passes, and says stop when it is done (or this rank sees it gone).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _: log.info("tensor parallel: signal %d; following rank 0 until it stops",
                                                       number))
    lm = load()
    log.info("tensor parallel: rank %d of %d loaded its shard; following rank 0", lm.ranks.rank, lm.ranks.size)
    try:
        follow(lm)
    except Exception as err:  # noqa: BLE001 - a follower has nobody to report to but its log and exit code
        log.error("tensor parallel: rank %d stops: %s: %s", lm.ranks.rank, type(err).__name__, err)
        return 1
    finally:
        lm.ranks.close()
    return 0
