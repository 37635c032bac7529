"""Decode attention on a CPU in bf16 (app/core/runner/packed.py `grouped_decode_attention`): grouped-query attention as
two fp32 matmuls instead of SDPA. Not bit-identical to bf16 SDPA, so these tests measure how far it strays.

Bound, measured: against an fp32 reference (attention computed in fp64 from the same bf16 inputs), the matmul
path is within 2e-6 (it is fp32 math, then one bf16 rounding at the end), never further than bf16 SDPA itself
(which rounds its intermediate results too). In a whole bf16 model, batched decode logits stay within 2% of the
solo (SDPA) run's and greedy tokens agree at >= 90% of positions under teacher forcing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.core.runner.packed import _left_padded, enable_packed_batching, grouped_decode_attention
from app.core.generate import decode_step, prefill
from app.core.runner.forward import forward
from app.core.sequence import Sequence
from app.core.sampling import SamplingParams

from conftest import build_tiny_model


def reference(q, keys, values, scale):
    """Per request, in float64, with HF's repeat_kv semantics: query head h uses KV head h // groups."""
    outs = []
    for i, (k, v) in enumerate(zip(keys, values)):
        groups = q.shape[1] // k.shape[1]
        k64, v64 = k[0].double().repeat_interleave(groups, 0), v[0].double().repeat_interleave(groups, 0)
        scores = q[i, :, 0].double()[:, None, :] @ k64.transpose(-1, -2) * scale  # [heads, 1, len]
        outs.append((scores.softmax(-1) @ v64)[:, 0])  # [heads, d]
    return torch.stack(outs)


def test_matches_a_float64_reference_at_least_as_well_as_bf16_sdpa():
    torch.manual_seed(0)
    heads, kv_heads, dim, lengths = 14, 2, 64, [2000, 7, 513, 1]  # Qwen2.5-0.5B's shape; ragged lengths
    q = torch.randn(len(lengths), heads, 1, dim).bfloat16()
    keys = [torch.randn(1, kv_heads, n, dim).bfloat16() for n in lengths]
    values = [torch.randn(1, kv_heads, n, dim).bfloat16() for n in lengths]
    scale = dim ** -0.5
    expected = reference(q, keys, values, scale)
    k, v = _left_padded(keys, values, torch.float32)  # as packed_attention pads them, zeros on the left
    width = k.shape[-2]
    mask = torch.zeros(len(lengths), 1, 1, width)
    for i, n in enumerate(lengths):
        mask[i, ..., : width - n] = torch.finfo(torch.float32).min
    ours = grouped_decode_attention(q, k, v, mask, scale)  # [B, heads, d], fp32
    assert ours.shape == (len(lengths), heads, dim) and ours.dtype == torch.float32
    ours_error = (ours.double() - expected).abs().max().item()
    sdpa_error = max((F.scaled_dot_product_attention(q[i:i + 1], k, v, scale=scale, enable_gqa=True)[0, :, 0].double()
                      - expected[i]).abs().max().item() for i, (k, v) in enumerate(zip(keys, values)))
    assert ours_error < 2e-6
    assert ours_error <= sdpa_error
    # A request whose one key is all there is attends to exactly that value (padding fully masked out).
    assert torch.allclose(ours[3], values[3][0, :, 0].float().repeat_interleave(heads // kv_heads, 0))


def test_bf16_batched_decode_stays_close_to_solo_sdpa(tiny_tokenizer):
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    assert enable_packed_batching(model)
    prompts = [tiny_tokenizer.encode(t) for t in ("Hi!", "Which city is the capital of France?", "def reverse(s):")]
    params = SamplingParams(max_tokens=9, do_sample=False, ignore_eos=True)

    def sequences():
        return [Sequence(model, tiny_tokenizer, ids, params, (), 256) for ids in prompts]

    solo, batch = sequences(), sequences()
    agree = total = 0
    for s in solo + batch:
        s.choose(prefill(model, s))  # prefill is the same SDPA call on both sides; decode differs
    for _ in range(8):
        solo_logits = torch.cat([decode_step(model, s) for s in solo])
        batch_logits = forward(model, [(s, 1) for s in batch])  # the decode rows take the fp32 matmul path
        rel = ((batch_logits - solo_logits).norm(dim=-1) / solo_logits.norm(dim=-1)).max().item()
        assert rel < 0.02
        agree += int((batch_logits.argmax(-1) == solo_logits.argmax(-1)).sum())
        total += len(solo)
        for s, b, row in zip(solo, batch, solo_logits):  # teacher forcing: both sides feed the solo run's token
            s.choose(row[None])
            b.choose(row[None])
    assert agree / total >= 0.9
