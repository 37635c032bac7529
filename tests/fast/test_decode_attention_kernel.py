"""Our decode attention kernel (app/models/decode_attention.cpp): one query row per request over its cache where it
lies, bf16 or 8-bit, in one call for all decode rows.

Its paths sum in fp32 in other orders than the torch version (`grouped_decode_attention` over an fp32 copy) and
take exp from a polynomial (within 2 ulp of expf), so they are held to that version within 2e-5 (measured: under
1.1e-5 at 4,096 tokens on a Zen 4, under 3e-6 at these lengths), at every head grouping and size a path takes,
ragged lengths and the tails of a vector of tokens included. An 8-bit cache's new tokens are quantized by the
kernel to the very bits kv_store's torch ops give. Each vector path runs where the CPU has it (the AVX2 path also
under `make test`'s emulated AVX2-only CPU); the baseline build runs everywhere.
"""

from __future__ import annotations

import pytest
import torch

from app.core.generate import prefill
from app.core.runner import packed
from app.core.runner.forward import forward
from app.core.runner.kv_store import GrowingLayer, Int8Layer
from app.core.runner.packed import enable_packed_batching, grouped_decode_attention
from app.core.sampling import SamplingParams
from app.core.sequence import Sequence
from app.models import decode_attention
from app.models.decode_attention import PATHS, AttentionKernel, choose_attention_kernel

from conftest import build_tiny_model

LENGTHS = [1, 15, 16, 17, 300]  # one call, ragged: a lone key, a vector's tail, whole vectors


@pytest.fixture(scope="module")
def module():
    kernel = choose_attention_kernel("reference")  # plain C++: builds wherever `make test` runs (g++ and ninja)
    assert kernel.ours, f"our decode attention kernel does not build here: {kernel.why}"
    return kernel.module


def paths() -> list:
    """Every path as a param, a vector path skipped with its reason where this CPU lacks its instructions."""
    module, why = decode_attention.extension()
    return [pytest.param(name, marks=pytest.mark.skipif(module is None or not module.supported(PATHS[name]),
                                                        reason=why or f"this CPU has no {name}"))
            for name in ("reference", "avx2", "avx512")]


def cached(kind: str, kv_heads: int, n: int, dim: int, seed: int):
    """(keys, values) [1, kv_heads, n, dim] as a request's cache layer hands them out: bf16, fp32 (a sliding layer
    of an fp32 model beside an 8-bit cache) or 8-bit."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    keys = (torch.randn(1, kv_heads, n, dim, generator=gen) * 3).to(dtype)  # wide scores: a peaked softmax
    values = torch.randn(1, kv_heads, n, dim, generator=gen).to(dtype)
    layer = Int8Layer() if kind == "int8" else GrowingLayer()
    layer.lazy_initialization(keys, values)
    return layer.append(keys, values)


def fp32(part) -> torch.Tensor:
    return part.dequantize(torch.float32) if hasattr(part, "scales") else part.float()


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (12, 1, 128), (20, 2, 40), (12, 2, 40), (6, 3, 36),
                                               (4, 4, 64)])
def test_each_path_matches_the_torch_version(module, path, kind, heads, kv_heads, dim):
    # 10 query heads a KV head: past the 8 a pass keeps in registers. 40 and 36 channels: not whole AVX-512 (or
    # AVX2) vectors, so those paths hand the head to the next narrower body. 6 a KV head over 40 channels: an 8-bit
    # cache's values two AVX2 vectors of columns a pass, then one. 4 heads on 4: no grouping at all.
    if kind == "int8" and dim % 4:
        dim += 4 - dim % 4  # the 8-bit cache keeps keys in groups of 4 channels
    caches = [cached(kind, kv_heads, n, dim, seed) for seed, n in enumerate(LENGTHS)]
    q = torch.randn(len(LENGTHS), heads, dim, generator=torch.Generator().manual_seed(9))
    scale = dim ** -0.5
    ours = AttentionKernel(path, "test", module).attend(q, [k for k, _ in caches], [v for _, v in caches], scale)
    expected = torch.cat([grouped_decode_attention(q[i : i + 1, :, None], fp32(k), fp32(v), None, scale)
                          for i, (k, v) in enumerate(caches)])
    assert ours.shape == (len(LENGTHS), heads, dim) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-5)
    # the lone key: its value exactly, whatever the query
    assert torch.allclose(ours[0], fp32(caches[0][1])[0, :, 0].repeat_interleave(heads // kv_heads, 0), atol=1e-6)


def test_a_sliding_window_reads_only_the_keys_it_shows(module):
    keys, values = cached("bf16", 2, 300, 64, seed=1)
    q = torch.randn(1, 14, 64).bfloat16()
    kernel = AttentionKernel("reference", "test", module)
    shown = [packed._shown(t, 40) for t in (keys, values)]
    ours = kernel.attend(q, [shown[0]], [shown[1]], 0.125)
    expected = grouped_decode_attention(q[:, :, None], keys[:, :, -40:].float(), values[:, :, -40:].float(), None,
                                        0.125)
    torch.testing.assert_close(ours, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_the_kernel_quantizes_new_tokens_to_the_torch_ops_bits(module, monkeypatch, dtype, n):
    gen = torch.Generator().manual_seed(n)
    keys = (torch.randn(1, 2, n, 64, generator=gen) * torch.logspace(-3, 2, 64)).to(dtype)  # k_proj-bias-wide
    values = torch.randn(1, 2, n, 64, generator=gen).to(dtype)
    keys[0, 0, 0, :4] = 0  # an all-zero group: codes 0
    layers = []
    for kernel in (None, module):
        monkeypatch.setattr(decode_attention, "_LOADED", [kernel] if kernel else [])
        layer = Int8Layer()
        layer.lazy_initialization(keys, values)
        layers.append(layer.append(keys, values))
    (torch_keys, torch_values), (our_keys, our_values) = layers
    for a, b in ((torch_keys, our_keys), (torch_values, our_values)):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


def test_a_packed_pass_attends_its_decode_rows_and_short_chunks_with_the_kernel(module, tiny_tokenizer, monkeypatch):
    """A bf16 model's decode rows, and each row of a short chunk (a speculative verify pass) over the keys up to its
    own position, go through the kernel, all in one call per layer, and give the torch version's logits (SDPA's
    for the chunk) but for bf16 rounding."""
    model = build_tiny_model(len(tiny_tokenizer)).to(torch.bfloat16)
    assert enable_packed_batching(model, AttentionKernel("reference", "test", module))
    original, calls = AttentionKernel.attend, []

    def counted(self, q, keys, values, scaling):
        calls.append(len(keys))
        return original(self, q, keys, values, scaling)

    monkeypatch.setattr(AttentionKernel, "attend", counted)
    prompts = [tiny_tokenizer.encode(t) for t in ("Hi!", "Which city is the capital of France?", "def reverse(s):")]
    params = SamplingParams(max_tokens=8, do_sample=False, ignore_eos=True)
    ours, theirs = ([Sequence(model, tiny_tokenizer, ids, params, (), 256) for ids in prompts] for _ in range(2))
    for s in ours + theirs:
        s.choose(prefill(model, s))
        for token in (5, 6, 7, 8):  # tokens a draft would propose, fed after the first: a 5-token verify chunk
            s.token_ids[0, s.length] = token
            s.length += 1
    work = [(1, 1), (1, 5), (1, 1)]  # [(n_out, fed)]: two decode rows and one chunk of 5

    def run(seqs):
        return forward(model, [(s, fed) for s, (_, fed) in zip(seqs, work)], [fed for _, fed in work])

    for n in (40, 5):  # a prompt chunk of any size is SDPA's (its size depends on what else prefills): no call
        forward(model, [(Sequence(model, tiny_tokenizer, list(range(5, 5 + n)), params, (), 256), n)])
    assert calls == []
    with_kernel = run(ours)
    assert calls == [1 + 5 + 1] * model.config.num_hidden_layers
    packed._DECODE_KERNELS.pop(model)
    without = run(theirs)
    assert len(calls) == model.config.num_hidden_layers  # the torch version and SDPA: no call
    rel = ((with_kernel - without).norm(dim=-1) / without.norm(dim=-1)).max().item()
    assert rel < 0.01
    assert (with_kernel.argmax(-1) == without.argmax(-1)).float().mean() >= 0.85
