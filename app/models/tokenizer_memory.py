"""What a loaded tokenizer keeps that serving never reads again.

transformers 5's tokenizer classes build their Rust tokenizer (`_tokenizer`, a `tokenizers.Tokenizer`) from a Python
vocabulary and merge list, and keep both on the instance (`_vocab`, `_merges`). Qwen2Tokenizer does, for 151,936
entries and 151,387 merges: 64 MiB of small Python objects (Zen 5, the 0.5B shape; 105 MiB for the loaded tokenizer,
45 MiB for the same tokenizer.json read by `tokenizers` alone). Encoding, decoding, special tokens and the chat
template all go through the Rust tokenizer, so a server drops them once loaded: at 0.5B that is 4% of the defaults'
resident memory and 7% of QUANT=int4's, the same in every setting (docs/performance.md). Only a few classes read
them later, to write a vocabulary out (Whisper's `save_vocabulary`), which a server never does.
"""

from __future__ import annotations

BUILD_INPUTS = ("_vocab", "_merges")  # what the tokenizer classes of transformers 5 build `_tokenizer` from


def drop_build_inputs(tokenizer) -> None:
    """Delete the Python vocabulary and merges a tokenizer built its Rust tokenizer from; nothing where there is no
    Rust tokenizer to answer in their place."""
    if getattr(tokenizer, "_tokenizer", None) is not None:
        for name in BUILD_INPUTS:
            tokenizer.__dict__.pop(name, None)
