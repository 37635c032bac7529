"""QUANT=int8 and QUANT=int4: the input embedding table as int8 rows with a scale each, dequantized on gather, and
a tied lm_head that multiplies the same rows.

Why: a step gathers a few rows of the table, so its format costs no speed, but the table is large: a fifth of
Qwen2.5-0.5B's weights, and once the linears were quantized the largest thing the server held (in bf16, 272 MB of
the int4 server's 633 MB of weights on the embedded 0.5B model; docs/performance.md "Memory"). So it is int8 with
one fp32 scale per row, as QUANT=int8's linears are: each value within half a step of its row's grid. Not 4 bits
with QUANT=int4: on the tiny test model a 4-bit table took greedy agreement with the unquantized model from 42 to
38 of 48 tokens, and its cost on real models is not measured. A row comes back in the model's dtype.

A tied lm_head (Qwen2.5 up to 3B, SmolLM2) is the same table, multiplied instead of gathered. Where it runs
weight-only int8 its int8 rows are this table's, held once (130 MiB saved on the 0.5B model): with bf16 or fp16
activations (QUANT=int4 on a CPU with native bf16, `DTYPE=bfloat16` with QUANT, a CPU without fbgemm), and under
QUANT=int8's fp32 too where the CPU multiplies bf16 natively, the head alone then computing in bf16. fbgemm's
dynamic int8 kernel packs its weight into a layout of its own that a gather cannot read, and the one kernel that
could multiply the shared rows with int8 activations, torch's `torch._int_mm`, took about twice fbgemm's time at 2
to 16 rows on a Zen 5 (docs/performance.md "Memory"). So only a CPU without native bf16, where the weight-only
kernel has no fast path, gives the head int8 rows of its own, as llama.cpp's GGUF files keep `output.weight` beside
`token_embd.weight`.
"""

from __future__ import annotations

import torch
from torch import nn


ROWS_AT_ONCE = 4096


@torch.no_grad()
def per_row_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] float -> int8 [rows, cols] and fp32 scales [rows]: symmetric, the largest |w| of a row maps to
    127. ROWS_AT_ONCE rows at a time: a whole 7B embedding table in fp32 with its temporaries took 6 GB at load."""
    codes = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        w = weight[start:start + ROWS_AT_ONCE].to(torch.float32, copy=True)  # a copy: divided in place below
        scale = (w.abs().amax(dim=1) / 127).clamp_(min=1e-12)
        codes[start:start + ROWS_AT_ONCE] = w.div_(scale[:, None]).round_().clamp_(-127, 127)
        scales[start:start + ROWS_AT_ONCE] = scale
    return codes, scales


class Int8Embedding(nn.Module):
    """The table as int8 [vocab, dim] with an fp32 scale per row. Buffers, not parameters: transformers takes a
    model's dtype from its first floating parameter, and the model still runs in `dtype`. `codes` and `scales`
    given: the rows of an int8 lm_head that is this table, held once."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype, codes: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = embedding.num_embeddings, embedding.embedding_dim, dtype
        if codes is None:
            codes, scales = per_row_int8(embedding.weight)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.weight_bytes = codes.numel() + scales.numel() * 4

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., dim] in self.dtype
        return (self.codes[ids].float() * self.scales[ids].unsqueeze(-1)).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        return self(torch.arange(self.num_embeddings))
