"""A server without CUDA makes `import triton` fail (app/gpu_only_imports.py); torch.compile's CPU backend, which
DECODE_STEP=compiled uses, generates C++ and still runs then. In a process of its own: the skip must come before
torch's own imports, and dynamo's state is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.compile

PROBE = """
from app.gpu_only_imports import skip_triton_without_cuda
assert skip_triton_without_cuda("cpu")
import torch
from torch import nn

layer = nn.Linear(16, 16)
step = torch.compile(lambda x: torch.nn.functional.silu(layer(x)) * 2)
x = torch.randn(4, 16)
with torch.inference_mode():
    assert torch.allclose(step(x), torch.nn.functional.silu(layer(x)) * 2, atol=1e-6)
import sys
assert sys.modules["triton"] is None
print("ok")
"""


def test_torch_compile_runs_on_a_cpu_with_triton_left_unimported():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
