"""Cross-encoders: a sequence-classification model that reads a query and a document together and gives one score.

Rerankers such as ms-marco-MiniLM are of this kind: unlike a bi-encoder, which embeds each text alone and compares
vectors, the model attends across the pair, which usually ranks better and gives no embedding. The score equals
`sentence_transformers.CrossEncoder(dir).predict(pairs)`: the logit of a one-label head through a sigmoid. Pairs are
tokenized as the tokenizer pairs them (`[CLS] a [SEP] b [SEP]` with token types 0 and 1 for BERT), padded on the
right, and masked, so a pair's score does not depend on its batch. A pair may hold `token_limit` tokens (RoBERTa-family
rerankers such as bge-reranker: two fewer than `max_position_embeddings`, app/models/pooling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from app.errors import ConfigError
from app.models.pooling import check_width, token_limit
from app.models.tokenizer_memory import drop_build_inputs


class PairRow(list):
    """A pair's token ids (a list, as the embedding engine batches rows by length), with its token types."""

    def __init__(self, ids: list[int], token_type_ids: list[int] | None):
        super().__init__(ids)
        self.token_type_ids = token_type_ids


@dataclass
class CrossEncoderModel:
    model: Any  # a transformers *ForSequenceClassification with one label
    tokenizer: Any
    name: str
    max_context: int  # tokens per pair, special tokens included
    dtype_reason: str = "chosen by the caller"
    prepack: str = "off: pooling models run the plain transformers forward"
    ranks: Any = None
    kind = "embedding"  # served by the embedding engine and endpoints
    scores_pairs = True  # /v1/rerank and /v1/score only: it gives no embeddings

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode_pair(self, first: str, second: str, limit: int | None = None) -> PairRow:
        """`limit` cuts the longer text first with the special tokens kept, as sentence-transformers' CrossEncoder
        does, but keeping each text's last tokens, as vLLM's `truncate_prompt_tokens` does. The cut is made here,
        never by the tokenizer's own truncation: that is state on the shared tokenizer, and a prepare worker's
        concurrent call could run with another request's setting (a pair cut to 32 came back whole)."""
        backend = self.tokenizer.backend_tokenizer
        texts = [backend.encode(text, add_special_tokens=False) for text in (first, second)]
        if limit is not None:
            room = limit - backend.num_special_tokens_to_add(True)
            if room < 2:
                raise ValueError(f"a pair cut to {limit} tokens leaves no room for both texts")
            for encoding, keep in zip(texts, longest_first(len(texts[0].ids), len(texts[1].ids), room)):
                encoding.truncate(keep, direction="left")
        pair = backend.post_process(texts[0], texts[1], add_special_tokens=True)
        types = list(pair.type_ids) if "token_type_ids" in self.tokenizer.model_input_names else None
        return PairRow(list(pair.ids), types)

    @torch.inference_mode()
    def embed(self, rows: list[PairRow]) -> torch.Tensor:
        """Pairs -> [len(rows), 1] scores in (0, 1), one padded pass."""
        check_width(rows, self.max_context)
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(list(row), dtype=torch.long)
            mask[i, :len(row)] = 1
            if row.token_type_ids is not None:
                types[i, :len(row)] = torch.tensor(row.token_type_ids, dtype=torch.long)
        kwargs = {"token_type_ids": types.to(self.device)} if rows[0].token_type_ids is not None else {}
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs).logits
        return torch.sigmoid(logits.float()).cpu()  # [B, 1]


def longest_first(first: int, second: int, room: int) -> tuple[int, int]:
    """How many tokens of each text to keep within `room`: the longer text is cut first, down to the shorter's
    length, then both alike (the first keeps the odd one), as the tokenizers' `longest_first` truncation does."""
    if first + second <= room:
        return first, second
    if min(first, second) <= room // 2:
        return (first, room - first) if first <= second else (room - second, second)
    return room - room // 2, room // 2


def load_cross_encoder(source: str, name: str, device: torch.device, dtype: torch.dtype, dtype_reason: str,
                       max_model_len: int | None = None) -> CrossEncoderModel:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        drop_build_inputs(tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype, device_map=device)
    except OSError as err:
        raise ConfigError(f"could not load cross-encoder {name!r}: {err}", param="model") from err
    if model.config.num_labels != 1:  # an NLI head, say: which of its labels would be "relevance"?
        raise ConfigError(f"{name!r} has {model.config.num_labels} labels; only one-label cross-encoders (a "
                          "relevance score) are served", param="model")
    model.eval()
    limit = token_limit(model, tokenizer)
    if max_model_len is not None:
        if max_model_len > limit:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {limit}", param="max_model_len")
        limit = max_model_len
    return CrossEncoderModel(model=model, tokenizer=tokenizer, name=name, max_context=limit, dtype_reason=dtype_reason)
