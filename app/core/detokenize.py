"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

Byte-level BPE tokenizers (Qwen, Llama 3, SmolLM) split one Chinese character or emoji over several tokens.
Decoding a lone token then yields U+FFFD. We decode a small window of recent ids and only release text once the
window no longer ends in an incomplete character, the approach vLLM and TGI use. Held text is not dropped:
`flush()` releases whatever is left at the end, even bytes the model left truly incomplete.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Prompt tokens decoded ahead of the output, so the first output token decodes as it would mid-text
# (SentencePiece-style tokenizers drop a leading space at the start of a decode).
PROMPT_CONTEXT_TOKENS = 4
INCOMPLETE = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], **kwargs) -> str: ...


def decode(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The one decode call everyone uses, so streamed and one-shot text are built the same way."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        # Ids that decode to nothing (skip_special_tokens) never enter the window: a long run of them (EOS ignored,
        # say) would otherwise grow it without bound and make every add() decode all of them again.
        self.skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] is already-released text, kept as context
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (often "", while a character is still incomplete)."""
        if token_id in self.skipped:
            return ""
        self.ids.append(token_id)
        released = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.tokenizer, self.ids[self.prefix_offset :])
        if len(window) <= len(released) or window.endswith(INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return window[len(released):]

    def flush(self) -> str:
        released = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.tokenizer, self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(released):]
