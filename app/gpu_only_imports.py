"""A server without a GPU leaves triton unimported.

xgrammar (structured outputs) requires triton on Linux x86-64, for its GPU kernels, and torch's `torch._dynamo`,
which transformers imports, imports triton whenever it is installed. On a CPU nothing ever runs it: xgrammar masks
logits with its own C++ kernel there, and torch.compile's CPU backend generates C++. Yet the import maps libtriton.so
and initialises it: 70 MiB of a CPU server's resident memory under every setting (Zen 5, the 0.5B shape: QUANT=int4
815 MiB instead of 888, the defaults 1,438 instead of 1,510; docs/performance.md "Memory"). So where CUDA is not
there, or not asked for, `import triton` fails as if it were not installed, which torch and xgrammar both handle.
"""

from __future__ import annotations

import sys

# for the start log (logging is set up after this runs)
SKIPPED = ("triton: not imported (no CUDA here; its only users, xgrammar's and torch.compile's GPU kernels, would not "
           "run, and loading it costs about 70 MiB of resident memory)")


def skip_triton_without_cuda(device: str) -> bool:
    """Before the server's imports: make `import triton` fail unless this process may compute on CUDA (`device`:
    the DEVICE setting, auto/cpu/cuda). Returns whether it was skipped; a triton imported already is left alone."""
    if device == "cuda" or "triton" in sys.modules:
        return False
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return False
    sys.modules["triton"] = None  # Python's own "not importable" entry: `import triton` raises ImportError
    return True


def triton_skipped() -> bool:
    return "triton" in sys.modules and sys.modules["triton"] is None
