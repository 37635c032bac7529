"""q/k/v and gate/up read in one call where our CPU kernels hold them (app/models/fuse.py): the same logits bit for
bit, the same bytes held, and a projection called in any other pattern still right."""

from __future__ import annotations

import torch
from torch import nn

from app.models.fuse import ProjectionRows, join_projections
from app.models.int4_decode import choose_int4_kernel
from app.models.quant import quantize_linears
from app.models.quant_group8 import GroupInt8Linear
from app.models.weight_memory import weight_bytes_by_format
from conftest import build_tiny_model

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7, 2]])


def int4_tiny_model() -> nn.Module:
    model = build_tiny_model(400, arch="llama")
    quantize_linears(model, "int4", dtype=torch.float32)
    return model


@torch.no_grad()
def test_joined_projections_give_the_same_logits_bit_for_bit_and_hold_the_same_bytes():
    model = int4_tiny_model()
    assert choose_int4_kernel().ours, "these layers must be on our kernel to be joined"
    before, held = model(PROMPT).logits, weight_bytes_by_format(model)
    assert join_projections(model) == 4  # two layers: q/k/v and gate/up each
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(getattr(attention, n), ProjectionRows) for n in ("q_proj", "k_proj", "v_proj"))
    assert all(isinstance(getattr(mlp, n), ProjectionRows) for n in ("gate_proj", "up_proj"))
    assert torch.equal(model(PROMPT).logits, before)
    assert weight_bytes_by_format(model) == held


@torch.no_grad()
def test_a_projection_called_alone_twice_or_on_an_input_changed_in_place_is_still_its_own():
    model = int4_tiny_model()
    attention = model.model.layers[0].self_attn
    alone = {n: getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj")}
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    expected = {n: layer(x) for n, layer in alone.items()}
    join_projections(model)
    assert torch.equal(attention.k_proj(x), expected["k_proj"])  # k first, alone
    assert torch.equal(attention.k_proj(x), expected["k_proj"])  # and again
    assert torch.equal(attention.q_proj(y), alone["q_proj"](y))  # another input
    x2 = x.clone()
    attention.v_proj(x2)
    x2.mul_(2)  # the same tensor, changed in place: v must not come from the earlier call
    assert torch.equal(attention.v_proj(x2), alone["v_proj"](x2))


@torch.no_grad()
def test_8_bit_groups_are_joined_too_and_layers_that_cannot_be_are_left_alone():
    kernel = choose_int4_kernel()
    gen = torch.Generator().manual_seed(0)

    def group8(out_features: int) -> GroupInt8Linear:
        codes = torch.randint(-128, 128, (out_features, 64), generator=gen, dtype=torch.int8)
        scale = torch.rand(out_features, 4, generator=gen) * 1e-2
        return GroupInt8Linear(nn.Linear(64, out_features, bias=True), codes, scale, torch.zeros(out_features, 2),
                               kernel)

    holder = nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = group8(64), group8(32), group8(32)
    holder.gate_proj, holder.up_proj = group8(48), nn.Linear(64, 48)  # a float sibling: not joined
    x = torch.randn(2, 64)
    expected = [holder.q_proj(x), holder.k_proj(x), holder.v_proj(x)]
    assert join_projections(holder) == 1
    assert [torch.equal(getattr(holder, n)(x), e) for n, e in zip(("q_proj", "k_proj", "v_proj"), expected)] == [
        True, True, True]
    assert isinstance(holder.gate_proj, GroupInt8Linear) and isinstance(holder.up_proj, nn.Linear)


def test_a_served_int4_model_joins_its_projections_and_says_so(tiny_dir, caplog):
    from app.models.loading import load_model

    with caplog.at_level("INFO", logger="app.models.loading"):
        served = load_model(str(tiny_dir), device="cpu", dtype="float32", quant="int4")
    assert isinstance(served.model.model.layers[0].self_attn.q_proj, ProjectionRows)
    assert any("groups each read in one call" in r.getMessage() for r in caplog.records)
    compiled = load_model(str(tiny_dir), device="cpu", dtype="float32", quant="int4", decode_step="compiled")
    assert not isinstance(compiled.model.model.layers[0].self_attn.q_proj, ProjectionRows)  # traced as it is


def test_the_separate_layers_are_freed_as_they_are_joined(monkeypatch):
    """Group by group: their packed weights must not stay beside the joined copies until the end (a 7B's load
    peaked 1.8 GB higher so)."""
    import gc
    import weakref

    from app.models import fuse

    model = int4_tiny_model()
    earlier: list[weakref.ref] = []
    alive_at_each_join = []

    def joined(layers):
        gc.collect()
        alive_at_each_join.append(sum(ref() is not None for ref in earlier))
        earlier.extend(weakref.ref(layer) for layer in layers)
        return real(layers)

    real = fuse._joined
    monkeypatch.setattr(fuse, "_joined", joined)
    assert join_projections(model) == 4
    assert alive_at_each_join == [0, 0, 0, 0]
