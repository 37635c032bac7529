"""The bf16 prepack choice (PREPACK=auto) is measured once per model, CPU and torch, kept in the model cache, and
the same at every later start: a restart never re-times while the machine is busy and packs other layers. Runs on
every CPU: the timing and the packing are stand-ins here (on AVX-512 CPUs tests/fast/test_prepack.py runs the real
ones); what is tested is which layers each start packs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from app.models import loading
from app.models.prepack import PackTiming, choice_key


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16))


@pytest.fixture
def stand_ins(monkeypatch):
    """measure_packing gives the timings queued in `runs` (one list per call); prepack_linears records the shapes
    its `only` would pack."""
    calls = {"measured": 0, "packed": []}
    runs: list[list[PackTiming]] = []

    def measure(model):
        calls["measured"] += 1
        return runs.pop(0)

    def pack(model, strict=False, only=None, invariant=False, splits=("whole",)):
        shapes = sorted({(m.in_features, m.out_features) for m in model.modules()
                         if isinstance(m, nn.Linear) and (only is None or only(m))})
        calls["packed"].append(shapes)
        return len(shapes)

    monkeypatch.setattr(loading, "measure_packing", measure)
    monkeypatch.setattr(loading, "prepack_linears", pack)
    return calls, runs


def timings(fast_shape: tuple[int, int]) -> list[PackTiming]:
    """Packed 2x faster on `fast_shape`, 2x slower on the other."""
    return [PackTiming(i, o, (1, 128), (1.0, 4.0), (0.5, 2.0) if (i, o) == fast_shape else (2.0, 8.0))
            for i, o in ((8, 16), (16, 8))]


def test_a_restart_packs_what_the_first_start_measured_without_timing_again(tmp_path, stand_ins):
    calls, runs = stand_ins
    choices, key = tmp_path / "prepack-choices.json", choice_key("some-model", torch.bfloat16)
    runs += [timings((8, 16)), timings((16, 8))]  # a second timing would have chosen the other shape
    first = loading._pack_bf16(small_model(), "auto", choices, key)
    again = loading._pack_bf16(small_model(), "auto", choices, key)
    assert calls["measured"] == 1 and calls["packed"] == [[(8, 16)], [(8, 16)]]
    assert first == again and first.startswith("on: 1 linear layers")
    assert key in json.loads(choices.read_text())


def test_another_model_or_dtype_is_measured_for_itself(tmp_path, stand_ins):
    calls, runs = stand_ins
    choices = tmp_path / "prepack-choices.json"
    runs += [timings((8, 16)), timings((16, 8))]
    loading._pack_bf16(small_model(), "auto", choices, choice_key("model-a", torch.bfloat16))
    loading._pack_bf16(small_model(), "auto", choices, choice_key("model-b", torch.bfloat16))
    assert calls["measured"] == 2 and calls["packed"] == [[(8, 16)], [(16, 8)]]
    assert len(json.loads(choices.read_text())) == 2


def test_an_unreadable_or_unwritable_choice_file_only_means_measuring_again(tmp_path, stand_ins):
    calls, runs = stand_ins
    broken = tmp_path / "prepack-choices.json"
    broken.write_text("{not json")
    runs += [timings((8, 16))]
    assert loading._pack_bf16(small_model(), "auto", broken, "k").startswith("on: 1")
    unwritable = tmp_path / "a-file" / "prepack-choices.json"
    (tmp_path / "a-file").write_text("")  # its parent is a file: nothing can be kept there
    runs += [timings((8, 16)), timings((8, 16))]
    loading._pack_bf16(small_model(), "auto", unwritable, "k")
    loading._pack_bf16(small_model(), "auto", unwritable, "k")
    assert calls["measured"] == 3


def test_prepack_true_packs_everything_without_measuring(tmp_path, stand_ins):
    calls, _ = stand_ins
    loading._pack_bf16(small_model(), "true", tmp_path / "prepack-choices.json", "k")
    assert calls["measured"] == 0 and calls["packed"] == [[(8, 16), (16, 8)]]
    assert not (tmp_path / "prepack-choices.json").exists()
