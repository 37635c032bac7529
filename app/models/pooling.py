"""Pooling models: a sentence-transformers or Hugging Face encoder directory that turns texts into vectors.

The vectors must equal `sentence_transformers.SentenceTransformer(dir).encode(...)`, so the pipeline is read from
the directory the way sentence-transformers reads it: `modules.json` lists the modules (Transformer, Pooling,
Normalize), `1_Pooling/config.json` says how token states become one vector (mean, cls, max, mean over sqrt(len),
last token), and `sentence_bert_config.json` caps the tokens per input (`max_seq_length`). A plain Hugging Face
encoder directory (no `modules.json`) gets what sentence-transformers gives it: mean pooling, no normalisation.

Decoder embedding models (Qwen3-Embedding, gte-Qwen2) are the same path: their `1_Pooling/config.json` says
`lasttoken`, and `AutoModel` loads the causal LM's body. Rows are padded on the right and every pooling reads the
attention mask, so a row's vector does not depend on what it was batched with (a causal model's last real token
never sees the padding after it; an encoder's padding is masked out of attention).

How many tokens an input may hold is read from what the model is (`token_limit`): RoBERTa-family models number
positions from `pad_token_id + 1`, so their table of `max_position_embeddings` holds two fewer real positions, and
an input one token too long indexes past it (an IndexError on the CPU; on CUDA a device-side assert that fails
every later pass of the process). Truncation keeps an input's last tokens, as vLLM's `truncate_prompt_tokens` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.errors import ConfigError
from app.models.tokenizer_memory import drop_build_inputs

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")
# The 1_Pooling/config.json flags, in sentence-transformers' spelling; the first one set wins.
POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_lasttoken": "lasttoken"}
# What makes a directory a chat model rather than an encoder, when it has no modules.json.
GENERATIVE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# transformers' "no limit known" model_max_length is int(1e30); nothing real comes near a billion tokens.
UNSET_MODEL_MAX_LENGTH = 10**9


@dataclass
class PoolingConfig:
    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None  # sentence_bert_config.json's cap; None: the model's position limit
    matryoshka: bool = False  # trained so that a prefix of the vector is itself an embedding (`dimensions` allowed)


def is_cross_encoder_dir(path: Path) -> bool:
    """A sequence-classification model: AutoModel would load its encoder and drop the head it was trained with."""
    config = path / "config.json"
    architectures = (json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def is_pooling_dir(path: Path) -> bool:
    """A sentence-transformers directory, or a Hugging Face directory whose architecture is not a generator."""
    if (path / "modules.json").is_file():
        return True
    config = path / "config.json"
    if not config.is_file():
        return False
    architectures = json.loads(config.read_text()).get("architectures") or []
    return bool(architectures) and not any(a.endswith(GENERATIVE_SUFFIXES) for a in architectures)


def read_pooling_config(path: Path) -> PoolingConfig:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()  # sentence-transformers' default for a bare encoder
    modules = json.loads(modules_file.read_text())
    kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:  # a Dense projection, say: serving without it would give vectors that differ silently
        raise ConfigError(f"{path}: sentence-transformers modules {sorted(unknown)} are not supported; "
                          "supported: Transformer, Pooling, Normalize", param="model")
    config = PoolingConfig(normalize="Normalize" in kinds)
    if "Pooling" in kinds:
        pooling = json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text())
        modes = [mode for flag, mode in POOLING_FLAGS.items() if pooling.get(flag)]
        if pooling.get("pooling_mode_weightedmean_tokens") or len(modes) != 1:
            raise ConfigError(f"{path}: pooling {pooling} is not supported; exactly one of "
                              f"{', '.join(POOLING_MODES)} must be set", param="model")
        config.pooling = modes[0]
    bert_config = path / "sentence_bert_config.json"
    if bert_config.is_file():
        config.max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    st_config = path / "config_sentence_transformers.json"
    if st_config.is_file():
        config.matryoshka = bool(json.loads(st_config.read_text()).get("matryoshka_dims"))
    return config


def token_limit(model: Any, tokenizer: Any, max_seq_length: int | None = None) -> int:
    """The most tokens one input may hold, special tokens included, read from what the model is: the rows of its
    position table less the offset its positions start at (RoBERTa, XLM-R, MPNet: `padding_idx + 1`, so 514 rows
    hold 512 positions), else `max_position_embeddings` (rotary models); then the smaller of that and
    `sentence_bert_config.json`'s `max_seq_length` when the directory has one (what sentence-transformers
    truncates to), else the tokenizer's `model_max_length` when it is set (what CrossEncoder truncates to)."""
    table = next((m for name, m in model.named_modules()
                  if name.endswith("position_embeddings") and isinstance(m, torch.nn.Embedding)), None)
    if table is not None:
        positions = table.num_embeddings - (0 if table.padding_idx is None else table.padding_idx + 1)
    else:
        positions = getattr(model.config, "max_position_embeddings", None) or 512
    if max_seq_length is not None:
        return min(max_seq_length, positions)
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and 0 < declared < UNSET_MODEL_MAX_LENGTH:
        return min(declared, positions)
    return positions


def leading_special_tokens(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text (`[CLS]`, `<s>`, a BOS; none for most decoders)."""
    marked, bare = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    for start in range(len(marked) - len(bare) + 1):
        if marked[start:start + len(bare)] == bare:
            return list(marked[:start])
    return []


def check_width(rows: list[list[int]], limit: int) -> None:
    """A row past the model's positions must never reach it: on CUDA its out-of-range position index is a
    device-side assert that poisons the context, and every later pass fails. The serving layer refuses or cuts
    such rows first; this guards any other way in."""
    if (width := max(len(r) for r in rows)) > limit:
        raise ValueError(f"a row of {width} tokens is past the model's {limit}")


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Token states -> one vector per row. hidden: [B, T, H]; mask: [B, T], 1 for real tokens, padding on the
    right. Returns [B, H]."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    lengths = mask.sum(dim=1)  # [B]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if mode == "max":
        return hidden.masked_fill(weights == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    summed = (hidden * weights).sum(dim=1)
    counts = lengths.clamp(min=1).unsqueeze(-1).to(hidden.dtype)
    return summed / counts if mode == "mean" else summed / counts.sqrt()  # mean_sqrt_len


@dataclass
class PoolingModel:
    """An encoder (or a decoder's body) with the pooling its directory asks for. What the embedding worker runs."""

    model: Any  # a transformers AutoModel: returns last_hidden_state
    tokenizer: Any
    name: str
    config: PoolingConfig
    max_context: int  # tokens per input, special tokens included (token_limit)
    leading: tuple[int, ...] = ()  # the special tokens the tokenizer puts before a text (leading_special_tokens)
    dtype_reason: str = "chosen by the caller"
    prepack: str = "off: pooling models run the plain transformers forward"
    ranks: Any = None  # never tensor parallel; the attribute the server's health checks read
    kind = "embedding"
    scores_pairs = False  # a bi-encoder: rerank and score compare its vectors (a cross-encoder scores the pair)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def dimensions(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0  # masked out either way

    def encode_text(self, text: str, limit: int | None = None) -> list[int]:
        """With the tokenizer's special tokens ([CLS] ... [SEP] for BERT), as sentence-transformers tokenizes;
        `limit` keeps the text's last tokens, its special tokens kept (cut_ids). The cut is made here, never by the
        tokenizer's own truncation: that is state on the shared tokenizer, and a prepare worker's concurrent call
        could run with another request's setting."""
        ids = list(self.tokenizer(text)["input_ids"])
        return ids if limit is None else self.cut_ids(ids, limit)

    def cut_ids(self, ids: list[int], limit: int) -> list[int]:
        """A token-id list cut as encode_text cuts a text: its last `limit` tokens (so the EOS a last-token pooling
        reads stays), and the leading special tokens it starts with kept in front (the [CLS] a cls pooling reads)."""
        if len(ids) <= limit:
            return list(ids)
        lead = len(self.leading)
        if lead and lead < limit and tuple(ids[:lead]) == self.leading:
            return list(ids[:lead]) + list(ids[len(ids) - (limit - lead):])
        return list(ids[len(ids) - limit:])

    @torch.inference_mode()
    def embed(self, rows: list[list[int]]) -> torch.Tensor:
        """Token-id rows -> [len(rows), H] float32 vectors, one padded pass."""
        check_width(rows, self.max_context)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
        vectors = pool(hidden.float(), mask, self.config.pooling)
        if self.config.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.cpu()


def load_pooling_model(source: str, name: str, device: torch.device, dtype: torch.dtype, dtype_reason: str,
                       max_model_len: int | None = None) -> PoolingModel:
    from transformers import AutoModel, AutoTokenizer

    path = Path(source)
    config = read_pooling_config(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        drop_build_inputs(tokenizer)
        model = AutoModel.from_pretrained(source, dtype=dtype, device_map=device)
    except OSError as err:
        raise ConfigError(f"could not load embedding model {name!r}: {err}", param="model") from err
    model.eval()
    limit = token_limit(model, tokenizer, config.max_seq_length)
    if max_model_len is not None:
        if max_model_len > limit:
            raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {limit}", param="max_model_len")
        limit = max_model_len
    return PoolingModel(model=model, tokenizer=tokenizer, name=name, config=config, max_context=limit,
                        leading=tuple(leading_special_tokens(tokenizer)), dtype_reason=dtype_reason)
