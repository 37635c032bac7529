"""Tiny embedding models built in the test, offline, in a second: a random BERT with a WordPiece tokenizer that adds
[CLS] and [SEP], saved as a sentence-transformers directory (modules.json, 1_Pooling/config.json,
sentence_bert_config.json); the tiny chat model's directory turned into a last-token decoder embedder; and
RoBERTa-family (XLM-R) encoders and cross-encoders, whose positions start at pad_token_id + 1 as bge-reranker's do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from conftest import CORPUS

MAX_SEQ_LENGTH = 64


def build_wordpiece_tokenizer(roberta: bool = False):
    """BERT's specials and template; `roberta`: RoBERTa's (`<s>`, `<pad>` = 1, `</s>`, `<s> A </s></s> B </s>`)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 3, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials,
                                                                  show_progress=False))
    if roberta:
        tok.model.unk_token = "<unk>"
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                       eos_token="</s>", cls_token="<s>", sep_token="</s>", mask_token="<mask>",
                                       model_input_names=["input_ids", "attention_mask"])  # as XLM-R's
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])  # as BERT's


def write_sentence_transformers_files(path: Path, pooling: str, normalize: bool, dimension: int,
                                      max_seq_length: int | None = MAX_SEQ_LENGTH) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "lasttoken"}
    config = {"word_embedding_dimension": dimension, **{flag: mode == pooling for flag, mode in flags.items()}}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def build_tiny_bert_dir(path: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0,
                        sentence_transformers: bool = True, positions: int = 128) -> Path:
    from transformers import BertConfig, BertModel

    tokenizer = build_wordpiece_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=positions, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    BertModel(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    if sentence_transformers:
        write_sentence_transformers_files(path, pooling, normalize, config.hidden_size)
    return path


def decoder_embedder_dir(tiny_dir: Path, path: Path) -> Path:
    """The tiny chat model's directory, as a decoder embedding model: last-token pooling, normalised."""
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    write_sentence_transformers_files(path, "lasttoken", True, hidden, max_seq_length=None)
    return path


def build_tiny_cross_encoder_dir(path: Path, num_labels: int = 1, seed: int = 0, positions: int = 128) -> Path:
    """A random BERT with a one-label classification head: a cross-encoder (reranker) as sentence-transformers'
    CrossEncoder loads it."""
    from transformers import BertConfig, BertForSequenceClassification

    build_tiny_bert_dir(path, seed=seed, sentence_transformers=False, positions=positions)
    config = BertConfig.from_pretrained(path, num_labels=num_labels)
    torch.manual_seed(seed + 1)
    BertForSequenceClassification(config).eval().save_pretrained(path)
    return path


def build_tiny_xlm_roberta_dir(path: Path, positions: int = 32, cross_encoder: bool = True, seed: int = 0) -> Path:
    """A random XLM-R with `positions` real positions: `max_position_embeddings` is `positions + pad_token_id + 1`,
    as bge-reranker-base's 514 hold 512. With `cross_encoder`, a one-label classification head (a reranker);
    without, the bare encoder with no sentence_bert_config.json (mean pooling). Its tokenizer declares no
    model_max_length, so the limit must come from the model itself."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

    tokenizer = build_wordpiece_tokenizer(roberta=True)
    pad = tokenizer.pad_token_id
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=64, max_position_embeddings=positions + pad + 1, pad_token_id=pad,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              type_vocab_size=1, num_labels=1)
    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(config) if cross_encoder else XLMRobertaModel(config)
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
