"""`python -m benchmarks kernels` on the tiny model: every weight format runs on the model's own layers, each is
timed, and each one's error against fp32 is what its bits allow."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import kernels


def test_int4_weight_recovers_a_weight_already_on_a_4_bit_grid_of_its_group():
    # a Q4_K sub-block: 32 weights = code x scale + minimum, codes 0..15 with both ends used
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0)).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15
    scales = torch.rand(16, 2, 1, generator=torch.Generator().manual_seed(1)) + 0.01
    weight = (codes.reshape(16, 2, 32) * scales - 0.3).reshape(16, 64)
    got_codes, scales_and_zeros, dequantized = kernels.int4_weight(weight, 32)
    assert torch.equal(got_codes, codes.to(torch.int32))
    torch.testing.assert_close(dequantized, weight)
    assert scales_and_zeros.shape == (2, 16, 2)  # [in / group, out, (scale, zero)], the kernel's layout
    # a group of 128 spans four grids: the same weight can no longer be held exactly
    assert (kernels.int4_weight(weight, 64)[2] - weight).abs().max() > 1e-3


def test_bench_kernels_times_every_format_on_the_models_layers(tiny_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    out = tmp_path / "kernels.json"
    args = parser.parse_args(["--model", str(tiny_dir), "--layers", "model.layers.0.mlp.up_proj,lm_head",
                              "--rows", "1,8", "--group-sizes", "32", "--trials", "2", "--out", str(out)])
    report = kernels.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["bench"] == "kernels" and report["machine"]["cpu"] and report["settings"]["trials"] == 2
    assert [(r["layer"], r["rows"]) for r in report["results"]] == [
        ("model.layers.0.mlp.up_proj", 1), ("model.layers.0.mlp.up_proj", 8), ("lm_head", 1), ("lm_head", 8)]
    for r in report["results"]:
        f = r["formats"]
        assert {"fp32", "fp32, as the defaults serve it", "bf16", "int8 weight-only", "int4 g32, bf16 activations",
                "int4 g32, fp32 activations"} <= set(f)
        assert all(v["ms"] > 0 for v in f.values())
        assert f["fp32"]["rel_error"] == 0
        # bf16 keeps 8 bits of mantissa, int8 7 bits of a row's range, int4 4 bits of a group's
        assert f["bf16"]["rel_error"] < 0.01 and f["int8 weight-only"]["rel_error"] < 0.03
        assert 0.01 < f["int4 g32, fp32 activations"]["rel_error"] < 0.2
        assert f["int4 g32, bf16 activations"]["rel_error"] == pytest.approx(
            f["int4 g32, fp32 activations"]["rel_error"], abs=0.01)
        assert 0 < r["int4_weight_error"]["int4 g32"] < 0.2  # random weights are not on a 4-bit grid
    printed = capsys.readouterr().out
    assert "lm_head (400 x 64)" in printed and "int4 g32, bf16 activations" in printed


def test_bench_kernels_names_a_layer_that_is_not_linear(tiny_dir):
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--layers", "model.norm", "--trials", "1"])
    with pytest.raises(ValueError, match="--layers: 'model.norm' is not a linear layer"):
        kernels.run(args)
