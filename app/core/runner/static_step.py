"""DECODE_STEP=compiled: one decode token for each of B rows, in fixed shapes, compiled once per batch-size bucket.

The eager step builds new tensors of new sizes every token (packed rows, left-padded key copies, masks), so all a
compiler could do is retrace. This step instead reads everything that changes from preallocated buffers:

    ids [B, 1]          the rows' newest tokens
    positions [B, 1]    where each goes (its length so far)
    write_block, write_offset [B]   the pool slot its keys and values are written to
    table [B, W]        each row's block ids (app/core/runner/kv_pool.py), padded with the pad block
    lengths [B]         keys each row sees, its new one included

B is a bucket (1, 2, 4, 8, ... up to MAX_ACTIVE): a batch of 3 runs as 4, its fourth row a pad row that writes to
and reads only the pad block. W, the table's width in blocks, is the one dynamic size: rounded up to a power of
two, and marked dynamic, so one compiled graph per bucket serves every context length. The model body is
transformers' own; the pool tensors travel inside `PooledKV`, which `pooled_attention` reads.

On a CPU the step is compiled with inductor; on CUDA it is compiled and then captured as CUDA graphs
(torch.cuda.graph, one per bucket and width: `CudaGraphs`). Warm-up compiles every bucket at start, and on CUDA
captures every (bucket, width) graph, so no request waits for a compile or a capture; a later new shape (a
recompile) shows in `compiles`. When the pool runs out of blocks, a row leaves it for a DynamicCache of its own
(`make_room`) rather than failing its pass. Prefill, steps with prefill chunks, and models whose
attention is not full attention in every layer keep the eager path.

Exactness: a compiled step is not bit-identical to the eager one (the compiler fuses and reorders float
arithmetic, and attention here always takes fp32 matmuls). tests/compile/test_static_step.py measures how far apart they
are; the fp32 oracle (`generate`, `reference_generate`) never takes this path.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence as Seq

import torch

from app.core.runner.kv_pool import POOLED, POOLED_MASK, KVPool, PoolExhausted, PoolHandle, PooledKV
from app.core.runner.packed import latent_kv
from app.models.logits import head_only
from app.models.prepack import PackedLinear

log = logging.getLogger("app.core.engine.engine")


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds max_batch."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


class _PoolWrites:
    """Stands in for the cache during one pooled step: writes each layer's new keys into the pool in place and
    hands attention a PooledKV, which reads the pool through the block table."""

    is_compileable = True

    def __init__(self, pool: KVPool, write_block, write_offset, table, mask, latent: bool = False):
        self.pool, self.write_block, self.write_offset, self.table, self.mask = (pool, write_block, write_offset,
                                                                                 table, mask)
        self.latent = latent  # MLA: hand back every row's latents, which the model expands itself

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states: [B, kv_heads, 1, head_dim]."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys[self.write_block, :, self.write_offset] = key_states[:, :, 0]
        values[self.write_block, :, self.write_offset] = value_states[:, :, 0]
        if self.latent:  # [B, 1, W * block_size, latent or rotary size]
            return PooledKV(keys, self.table, self.mask).rows(), PooledKV(values, self.table, self.mask).rows()
        return PooledKV(keys, self.table, self.mask), PooledKV(values, self.table, self.mask)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # never consulted: positions and masks are given


class CudaGraphs:
    """Captures `forward` once per input shape with torch.cuda.graph and replays it (as nano-vllm does). Every
    input is a view of one of the step's preallocated buffers and the pool is written in place, so the captured
    addresses stay valid; only the output is new, and the caller copies it before the next replay."""

    def __init__(self, forward):
        self.forward, self.graphs, self.outputs, self.memory = forward, {}, {}, None
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        shape = tuple(inputs[0].shape[:1]) + tuple(inputs[4].shape[1:])  # (bucket, table width)
        if shape not in self.graphs:
            self._capture(shape, inputs)
        self.graphs[shape].replay()
        self.replays += 1
        return self.outputs[shape]

    def _capture(self, shape: tuple, inputs) -> None:
        side = torch.cuda.Stream()  # one run first, off the capture: lazy set-up (cuBLAS, a compile) happens here
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):  # one memory pool for all: they never run at once
            self.outputs[shape] = self.forward(*inputs)
        self.memory = graph.pool()
        self.graphs[shape] = graph


class StaticDecodeStep:
    """Runs decode rows through the pool, eagerly (compile=False: the same arithmetic, for tests and as the
    reference) or compiled per bucket."""

    def __init__(self, model, pool: KVPool, max_batch: int, max_context: int, compile: bool = True,
                 options: dict | None = None, buckets: Seq[int] | None = None):
        if model.config._attn_implementation not in (POOLED, "simple_serve_packed", "sdpa"):
            raise ValueError(f"the pooled step needs SDPA attention, not {model.config._attn_implementation}")
        model.set_attn_implementation(POOLED)  # packed_attention for every other call
        self.model, self.pool = model, pool
        self.latent = latent_kv(model.config) is not None
        self.buckets = sorted(buckets) if buckets else buckets_up_to(max_batch)  # `buckets`: a bench's subset
        self.max_blocks = -(-max_context // pool.block_size)
        device, biggest = pool.device, self.buckets[-1]
        self.ids = torch.zeros(biggest, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(biggest, 1, dtype=torch.long, device=device)
        self.write_block = torch.full((biggest,), pool.pad_block, dtype=torch.long, device=device)
        self.write_offset = torch.zeros(biggest, dtype=torch.long, device=device)
        self.table = torch.full((biggest, max(2, self.max_blocks)), pool.pad_block, dtype=torch.long, device=device)
        self.lengths = torch.ones(biggest, dtype=torch.long, device=device)
        self.head = head_only(model)  # transformers' own forward after the body: lm_head, any scaling
        self.compiled = compile
        self.compile_seconds: dict[int, float] = {}
        self.steps = 0
        self._forward = self._eager_forward
        if compile:
            # freezing: the weights become constants, so inductor can lower bf16 prepacked linears (oneDNN's
            # packed weights, app/models/prepack.py), which it refuses as plain inputs
            options = {"freezing": True} if options is None and device.type == "cpu" else options
            self._forward = torch.compile(self._eager_forward, fullgraph=True, options=options)
            # one graph per bucket, all kept: past dynamo's limit it would fall back to eager, silently
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(self.buckets))
        # CUDA: the (compiled) step is captured as a CUDA graph per bucket and width and replayed, so a step costs
        # one launch, not one per kernel. Untested here (no GPU reached this code): `make gpu-check` runs it.
        self.graphs = CudaGraphs(self._forward) if device.type == "cuda" else None
        self.path = "graph" if self.graphs is not None else "pooled"  # as /metrics counts its steps

    def _eager_forward(self, ids, positions, write_block, write_offset, table, lengths) -> torch.Tensor:
        """-> float32 logits [B, vocab] for the rows' next tokens."""
        width = table.shape[1] * self.pool.block_size
        visible = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]  # [B, W * block_size]
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=ids.device).masked_fill_(
            ~visible, torch.finfo(torch.float32).min)[:, None, None, :]
        cache = _PoolWrites(self.pool, write_block, write_offset, table, mask, latent=self.latent)
        extra = {POOLED_MASK: mask} if self.latent else {}  # MLA: attention meets expanded keys, not PooledKV
        hidden = self.model.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                                  attention_mask=mask, **extra).last_hidden_state  # [B, 1, H]; a 4D mask: kept
        return self.head(inputs_embeds=hidden, use_cache=False).logits[:, -1].float()

    def widths(self) -> list[int]:
        """Every block-table width `run` may use: powers of two from 2, then the widest table (max_blocks)."""
        top, sizes = max(2, self.max_blocks), [2]
        while sizes[-1] < top:
            sizes.append(min(top, 2 * sizes[-1]))
        return sizes

    def warm_up(self) -> None:
        """Compile every bucket now (pad rows only: nothing a request owns is touched). On CUDA, also capture
        every (bucket, width) graph now, as vLLM captures all of its graphs at start: captured on first use, each
        new width stalled a step in the engine thread (up to ~44 of them for 4 buckets and a 32K context)."""
        for bucket in self.buckets:
            start = time.perf_counter()
            for width in self.widths() if self.graphs is not None else [2]:  # compiled: one graph for all widths
                self._run_bucket(bucket, width)
            self.compile_seconds[bucket] = time.perf_counter() - start
        if self.compiled:
            log.info("compiled decode step: buckets %s, compile seconds %s", self.buckets,
                     {b: round(s, 1) for b, s in self.compile_seconds.items()})

    def _run_bucket(self, bucket: int, width: int) -> torch.Tensor:
        inputs = (self.ids[:bucket], self.positions[:bucket], self.write_block[:bucket], self.write_offset[:bucket],
                  self.table[:bucket, :width], self.lengths[:bucket])
        if self.compiled:
            for tensor in inputs:  # the bucket is a static size: dynamo must not merge the buckets into one graph
                torch._dynamo.mark_static(tensor, 0)
            torch._dynamo.mark_dynamic(inputs[4], 1)  # widths are powers of two from 2: never 0 or 1
        with torch.inference_mode():
            return self.graphs(*inputs) if self.graphs is not None else self._forward(*inputs)

    def adopt(self, seqs: Seq) -> bool:
        """Move each sequence's finished-prefill DynamicCache into the pool (once per request). False: the pool is
        full, and the step runs eagerly as before (the sequences adopted so far keep their handles, which the
        eager path also takes)."""
        for seq in seqs:
            if not isinstance(seq.cache, PoolHandle):
                try:
                    seq.cache = self.pool.adopt(seq.cache)
                except PoolExhausted:
                    return False
        return True

    def make_room(self, work: Seq) -> int:
        """Before an eager pass over (sequence, tokens it feeds) rows: each pooled row holds the blocks its new
        tokens need, or leaves the pool for a DynamicCache of its own (a copy of its keys and values), so the pass
        never runs out of blocks half way. A full pool failed the whole pass before (4 requests got a 500 where
        the eager engine served them: admission reserves exact tokens, the pool rounds to blocks). Returns how
        many rows left the pool; they may be adopted again once blocks are free."""
        moved = 0
        for seq, n in work:
            if isinstance(seq.cache, PoolHandle):
                try:
                    seq.cache.reserve(seq.cache.get_seq_length() + n)
                except PoolExhausted:
                    handle, seq.cache = seq.cache, seq.cache.as_dynamic_cache(self.model.config)
                    handle.release()
                    moved += 1
        return moved

    def run(self, seqs: Seq) -> torch.Tensor | None:
        """Each sequence feeds its newest token: float32 logits [len(seqs), vocab], or None where this step
        cannot take them (more rows than the largest bucket, a full pool, a context past max_context)."""
        if not seqs or len(seqs) > self.buckets[-1] or not self.adopt(seqs):
            return None
        bucket = next(b for b in self.buckets if b >= len(seqs))
        block_size, rows = self.pool.block_size, len(seqs)
        try:
            for seq in seqs:
                seq.cache.reserve(seq.cache.get_seq_length() + 1)
        except PoolExhausted:
            return None
        n_blocks = max(len(seq.cache.block_ids) for seq in seqs)
        if n_blocks > self.max_blocks:
            return None
        width = min(max(2, 1 << (n_blocks - 1).bit_length()), max(2, self.max_blocks))  # a power of two
        positions = [seq.cache.get_seq_length() for seq in seqs]
        # One small host-to-device copy per buffer; the pad rows (rows..bucket) keep writing the pad block.
        self.ids[:rows] = torch.cat([seq.last_token for seq in seqs])
        self.positions[:rows, 0] = torch.tensor(positions)
        self.write_block[:rows] = torch.tensor([seq.cache.block_ids[p // block_size]
                                                for seq, p in zip(seqs, positions)])
        self.write_offset[:rows] = torch.tensor([p % block_size for p in positions])
        self.lengths[:rows] = torch.tensor([p + 1 for p in positions])
        self.table[:rows, :width] = self.pool.pad_block
        for row, seq in enumerate(seqs):
            self.table[row, : len(seq.cache.block_ids)] = seq.cache.block_table
        self._reset_pad_rows(rows, bucket)
        logits = self._run_bucket(bucket, width)[:rows]
        for seq in seqs:
            for layer in seq.cache.layers:
                layer.length += 1
        self.steps += 1
        return logits.clone() if self.pool.device.type == "cuda" else logits  # a graph's output is overwritten

    def _reset_pad_rows(self, rows: int, bucket: int) -> None:
        if rows < bucket:
            self.ids[rows:bucket] = 0
            self.positions[rows:bucket] = 0
            self.write_block[rows:bucket] = self.pool.pad_block
            self.write_offset[rows:bucket] = 0
            self.lengths[rows:bucket] = 1
            self.table[rows:bucket] = self.pool.pad_block


def pooled_step_problem(lm, batch_decode: bool) -> str | None:
    """Why DECODE_STEP=compiled does not apply to this model (a sentence for the start log), or None."""
    from app.core.runner.packed import PACKED_EAGER, attention_windows  # the packed pass's reading of the layers

    windows = attention_windows(lm.model) if batch_decode else None
    if lm.ranks is not None:
        return "tensor parallelism is on: the other ranks mirror the packed passes, not a pooled step"
    if not batch_decode:
        return "this model's attention is not packed"
    if lm.model.config._attn_implementation == PACKED_EAGER:
        return ("this model's attention runs on its own eager function (soft-capping, sinks), which the pooled "
                "step's attention does not replace")
    if windows is None or any(w is not None for w in windows):
        return "some layers use sliding or other attention; the pooled step does full attention only"
    if any(isinstance(m, PackedLinear) for m in lm.model.modules()):
        return "inductor cannot compile bf16 prepacked linears (PREPACK=false allows it)"
    return None


def build_decode_step(lm, max_batch: int, kv_capacity_bytes: int, *, batch_decode: bool,
                      block_size: int = 16, compile: bool = True) -> StaticDecodeStep | None:
    """DECODE_STEP=compiled at the engine's start: the pool, the step, and every bucket compiled. None (with a
    log line saying why) where it does not apply, and the engine decodes eagerly as before."""
    from app.core.runner.packed import PACKED

    if why_not := pooled_step_problem(lm, batch_decode):
        log.info("DECODE_STEP=compiled does not apply, decode steps stay eager: %s", why_not)
        return None
    per_block = KVPool.bytes_per_block(lm.model.config, block_size, lm.dtype)
    blocks_per_row = -(-lm.max_context // block_size)
    # as many blocks as max_batch full contexts need, capped by `kv_capacity_bytes` (allocated once, now)
    num_blocks = max(1, min(max_batch * blocks_per_row, kv_capacity_bytes // per_block - 1))  # - 1: the pad block
    pool = KVPool(lm.model.config, num_blocks, block_size, lm.dtype, lm.device)
    log.info("KV pool: %d blocks of %d tokens, %.2f GiB", num_blocks, block_size, num_blocks * per_block / 2**30)
    try:
        step = StaticDecodeStep(lm.model, pool, max_batch, lm.max_context, compile=compile)
        step.warm_up()
    except Exception as exc:  # a compiler or capture that fails here must not keep the server from serving
        log.warning("DECODE_STEP=compiled failed at warm-up, decode steps stay eager: %s: %s",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        lm.model.set_attn_implementation(PACKED)
        return None
    return step
