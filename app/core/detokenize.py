"""Incremental detokenization: token ids in, text deltas out, never half a UTF-8 character.

Byte-level BPE tokenizers (Qwen, Llama 3, SmolLM) split one Chinese character or emoji over several tokens.
Decoding a lone token then yields U+FFFD. We decode a small window of recent ids and only release text once the
window no longer ends in an incomplete character, the approach vLLM and TGI use. Held text is not dropped:
`flush()` releases whatever is left at the end, even bytes the model left truly incomplete.

The window is bounded. A UTF-8 character is at most 4 bytes, so at most 4 tokens; a tail that still ends in U+FFFD
after `MAX_HELD_TOKENS` tokens holds bytes that will never all become characters (a model pushed onto a lone
continuation byte by `logit_bias` emits them forever). Then the held text is released up to the newest token
boundary where it splits cleanly (the text before the cut, plus the text after it decoded alone, is the whole
window's text), so each invalid byte comes out as the U+FFFD that `decode` gives it, and the streamed text still
equals the one-shot decode. vLLM's and HF's incremental detokenizers hold such a tail until its end, and decode
all of it again on every token: 8,000 such tokens cost 5.6 s of engine time, growing with the square. A tail with no
clean boundary among its last tokens (no real text does that) is cut anyway after `MAX_WINDOW_TOKENS`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Prompt tokens decoded ahead of the output, so the first output token decodes as it would mid-text
# (SentencePiece-style tokenizers drop a leading space at the start of a decode).
PROMPT_CONTEXT_TOKENS = 4
INCOMPLETE = "\ufffd"
MAX_HELD_TOKENS = 4  # a held tail this long is searched for a clean cut (a character's bytes span at most 4 tokens)
MAX_WINDOW_TOKENS = 16  # a held tail this long is cut whatever it holds, so each add() decodes a bounded window


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
        if len(window) > len(released) and not window.endswith(INCOMPLETE):
            return self._release(released, window, len(self.ids))
        if len(self.ids) - self.read_offset >= MAX_HELD_TOKENS:
            return self._release_held(released, window)
        return ""

    def _release(self, released: str, text: str, upto: int) -> str:
        """Release `text` (the decode of ids[prefix_offset:upto]) past what `released` already showed."""
        self.prefix_offset, self.read_offset = self.read_offset, upto
        return text[len(released):]

    def _release_held(self, released: str, window: str) -> str:
        """A long held tail: release it up to the newest clean cut among its last few boundaries. Each boundary is
        looked at while it is one of the newest, so checking these few covers them all at a bounded cost."""
        end = len(self.ids)
        for cut in range(end - 1, max(self.read_offset, end - MAX_HELD_TOKENS), -1):
            left = decode(self.tokenizer, self.ids[self.prefix_offset : cut])
            if len(left) > len(released) and left + decode(self.tokenizer, self.ids[cut:]) == window:
                return self._release(released, left, cut)
        if end - self.read_offset < MAX_WINDOW_TOKENS:
            return ""
        cut = end - (MAX_HELD_TOKENS - 1)  # the newest tokens may still start a real character: they stay held
        return self._release(released, decode(self.tokenizer, self.ids[self.prefix_offset : cut]), cut)

    def flush(self) -> str:
        released = decode(self.tokenizer, self.ids[self.prefix_offset : self.read_offset])
        window = decode(self.tokenizer, self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return window[len(released):]
