"""Tensor parallelism's ranks: one model split over N processes by transformers' own plan, and the channel that keeps
them in step.

`torchrun --nproc-per-node N -m app serve --tensor-parallel N` starts N processes. Each joins one process group
(NCCL on GPUs, gloo on CPUs) and loads its shard with `from_pretrained(distributed_config=DistributedConfig(tp_size=N))`:
the model's `base_model_tp_plan` splits every attention layer by heads and every MLP by its hidden width, and the
rowwise layers all-reduce their partial sums, so each forward pass is a collective that every rank must enter with
the same inputs. Rank 0 serves HTTP and decides what runs; before each pass it broadcasts the pass's inputs over
`Ranks`, a gloo group on the CPU (app/core/engine/tensor_parallel.py says what a message holds).

Failure is loud and quick, never a hang: gloo reports a peer that died at the next send or receive; rank 0 sends a
heartbeat whenever it has sent nothing for `BEAT_S`, so an idle server notices a dead rank too, and a follower whose
rank 0 went silent gives up after `CONTROL_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from app.errors import ConfigError

log = logging.getLogger("app.models.distributed")

BEAT_S = 1.0  # rank 0 sends a heartbeat after this long without a message
CONTROL_TIMEOUT_S = 60.0  # a follower gives up when rank 0 has sent nothing, not even a heartbeat, for this long
# The model's own collectives: long enough for ranks that finish loading minutes apart (a gloo peer that dies is
# reported at once whatever this says; a NCCL rank that hangs is given up on after it).
GROUP_TIMEOUT = timedelta(minutes=10)


def launched_rank(tp_size: int) -> int:
    """This process's rank, checked against what torchrun set up; a ConfigError that gives the command otherwise."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        raise ConfigError(f"--tensor-parallel {tp_size} runs one process per rank: start it as `torchrun "
                          f"--nproc-per-node {tp_size} -m app serve --tensor-parallel {tp_size} ...`",
                          param="tensor_parallel")
    if int(world) != tp_size:
        raise ConfigError(f"--tensor-parallel {tp_size}, but torchrun started {world} processes (--nproc-per-node "
                          "must equal --tensor-parallel)", param="tensor_parallel")
    return int(os.environ["RANK"])


def tp_plan_problem(config: Any, tp_size: int, name: str) -> str | None:
    """Why this model cannot be split over `tp_size` ranks by transformers' plan, or None if it can."""
    text = config.get_text_config(decoder=True)
    if not getattr(text, "base_model_tp_plan", None):
        return (f"model {name!r} ({type(config).__name__}) has no tensor-parallel plan in transformers "
                "(its config defines no base_model_tp_plan), so it cannot be split over ranks")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            return (f"model {name!r} has {count} {what}, which do not divide evenly over {tp_size} ranks; "
                    f"choose a --tensor-parallel that divides {heads} and {kv_heads}")
    return None


class Ranks:
    """The process group's control channel: rank 0 broadcasts small Python messages, every other rank receives
    them in the same order."""

    def __init__(self, tp_size: int, device: torch.device):
        self.rank = launched_rank(tp_size)
        self.size = tp_size
        self.lost: str | None = None  # why the group broke, once it has (rank 0: reported by /ready and /health)
        self._lock = threading.Lock()  # one broadcast at a time: the engine's passes and the heartbeat share it
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        if device.type == "cuda" and torch.cuda.device_count() < tp_size:
            raise ConfigError(f"--tensor-parallel {tp_size} puts one rank on each GPU, but torch sees "
                              f"{torch.cuda.device_count()} on this host", param="tensor_parallel")
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
        # gloo even beside NCCL: messages are pickled bytes on the CPU, and gloo times out a receive cleanly
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def send(self, message: Any) -> None:
        """Rank 0: every other rank receives `message` next. Raises (and records `lost`) if the group broke."""
        with self._lock:
            self._send(message)

    def _send(self, message: Any) -> None:
        if self.lost:
            raise ConnectionError(self.lost)
        try:
            dist.broadcast_object_list([message], src=0, group=self._control)
        except Exception as err:  # noqa: BLE001 - gloo names the peer that closed its connection
            self.lost = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            raise
        self._last_sent = time.monotonic()

    def sync(self) -> None:
        """Every rank meets here: rank 0 after a pass that raised on it (it sends ("sync",) first), each follower on
        receiving that. A follower still inside a collective that rank 0 left never comes; past CONTROL_TIMEOUT_S
        this raises (and records `lost`), and rank 0 knows the ranks are out of step."""
        with self._lock:  # the heartbeat must not broadcast between the message and the barrier
            if self.leader:
                self._send(("sync",))
            try:
                dist.monitored_barrier(group=self._control, timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
            except Exception as err:  # noqa: BLE001 - gloo names the rank that did not come
                self.lost = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                raise

    def receive(self) -> Any:
        """Ranks > 0: the next message from rank 0 (raises after CONTROL_TIMEOUT_S of silence or if it died)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def start_heartbeat(self) -> None:
        """Rank 0: keep the followers' receives from timing out while idle, and find out that one died."""
        threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._closed.wait(BEAT_S / 4):
            if self.lost:
                return
            if time.monotonic() - self._last_sent >= BEAT_S:
                try:
                    self.send(("beat",))
                except Exception:  # noqa: BLE001 - recorded in `lost`
                    log.error("tensor parallel: a rank is gone: %s", self.lost)
                    return

    def close(self) -> None:
        """Rank 0: tell the followers to exit; every rank: leave the group."""
        self._closed.set()
        if self.leader and not self.lost:
            try:
                self.send(("stop",))
            except Exception:  # noqa: BLE001 - they are gone already
                pass
        if dist.is_initialized():
            dist.destroy_process_group()

