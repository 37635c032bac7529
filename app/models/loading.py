"""Load one model and its tokenizer: an embedded model name, a local HF directory, a .gguf file, or a hub id.

`LoadedModel` bundles what the rest of the service needs to know about the model: its device, dtype, context
window, EOS ids, the sampling defaults from its generation_config.json, how to turn chat messages into ids, and
why its dtype and prepacking are what they are (reported by /ready and /v1/models).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import psutil
import torch

from app.config import prepack_mode
from app.errors import ConfigError, InvalidRequest
from app.models.chat_template import render_chat, template_variables
from app.models.architectures import unservable
from app.models.batch_rows import copy_bytes, copy_bytes_held, use_batch_rows
from app.models.cpu import CpuFeatures, auto_dtype, prepack_support
from app.models.decode_attention import choose_attention_kernel
from app.models.distributed import Ranks, tp_plan_problem
from app.models.fetch import EMBEDDED
from app.models.cross_encoder import CrossEncoderModel, load_cross_encoder
from app.models.pooling import PoolingModel, is_cross_encoder_dir, is_pooling_dir, load_pooling_model
from app.models.prepack import (PrepackFailed, choice_key, load_choice, measure_packing, prepack_linears,
                                save_choice)
from app.models.fuse import join_projections
from app.models.invariance import cannot_hold, make_linears_invariant, resolve_batch_invariant, invariant_splits
from app.models.quant import dynamic_int8_supported, keep_own_copies
from app.models.streamed_load import load_weights, locate, resolve_quant
from app.models.tokenizer_memory import drop_build_inputs
from app.models.vision import is_vision, load_vision, vision_problem
from app.models.weight_memory import describe, weight_bytes_by_format

log = logging.getLogger("app.models.loading")

# The generation_config.json keys that map onto sampling parameters. They live with the loading code so that
# models/ never imports core/; core/sampling.py has a built-in default for each.
GENERATION_CONFIG_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# fp32 prepacking's copies are the linears' size again; past this share of the RAM left after loading, `auto`
# leaves them out rather than squeeze the KV budget (half of what is left then) and everything else.
FP32_COPY_RAM_FRACTION = 0.5
PREPACK_CHOICES = "prepack-choices.json"  # in the model cache: the measured bf16 prepack choice per model and CPU
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: Any  # a transformers *ForCausalLM with .model (the body) and .lm_head
    tokenizer: Any
    name: str
    max_context: int
    eos_ids: tuple[int, ...]
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    dtype_reason: str = "chosen by the caller"  # why these weights have their dtype (dtype=auto explains itself)
    prepack: str = "off: not loaded by load_model"  # "on: N linear layers[, why and the figures]" or "off: why"
    ranks: Any = None  # tensor parallel: this shard's app.models.distributed.Ranks (None: the whole model here)
    weight_bytes: dict[str, int] = field(default_factory=dict)  # by format (app/models/weight_memory.py)
    batch_invariant: bool = False  # BATCH_INVARIANT resolved (app/models/invariance.py)
    invariance: str = "off: not loaded by load_model"  # why it is on or off
    kv_int8: bool = False  # KV_CACHE_DTYPE=int8: each request's cache keeps 8-bit keys and values
    decode_attention: Any = None  # app.models.decode_attention.AttentionKernel on a CPU (None: the torch version)
    vision: Any = None  # app.models.vision.VisionEncoder: the model takes images (None: text alone)
    kind = "chat"  # what the server serves with it (app/models/pooling.py's PoolingModel: "embedding")

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @cached_property
    def template_variables(self) -> frozenset[str] | None:
        """What the chat template reads: the only request kwargs passed to it (app/models/chat_template.py)."""
        return template_variables(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """The messages rendered by the tokenizer's own chat template (app/models/chat_template.py), tokenized."""
        return self.encode_text(self.render_chat(messages, template_kwargs, tools, add_generation_prompt))

    def render_chat(self, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
        return render_chat(self.tokenizer, self.template_variables, messages, template_kwargs, tools,
                           add_generation_prompt)

    def encode_text(self, text: str) -> list[int]:
        # The chat template already wrote any BOS it wants; plain prompts are taken as given.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def invariance_cannot_hold(self, why: str) -> None:
        """The engine found BATCH_INVARIANT cannot hold for this model (`why`): `on` raises ConfigError, `auto` turns
        off and says why (app/models/invariance.py `cannot_hold`)."""
        self.invariance = cannot_hold(self.invariance, why)
        self.batch_invariant = False
        log.warning("batch invariance off: %s", self.invariance)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for, but torch sees no CUDA GPU", param="device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The weights' dtype and why: as asked, or for `auto` from the device's features alone (app/models/cpu.py).

    Never from a timing: a timed probe chose fp32 on one start and bf16 on the next on the same machine, and the
    same greedy request then gave different text after a restart.
    """
    if dtype != "auto":
        return DTYPES[dtype], f"dtype={dtype} was asked for"
    return auto_dtype(device)


def quant_auto_dtype(quant: str, device: torch.device,
                     features: CpuFeatures | None = None) -> tuple[torch.dtype, str] | None:
    """`dtype=auto` with QUANT on a CPU that has fbgemm's dynamic int8 kernels, and why; None: as without QUANT.

    Those kernels take fp32 activations (app/models/quant.py), so QUANT=int8 runs in fp32. QUANT=int4 does too where
    the CPU has no native bf16, for its int8 lm_head. Where it has (the defaults run bf16 there), QUANT=int4 runs in
    bf16: its 4-bit kernel takes bf16 activations anyway, and the lm_head takes them in fp32 on the dynamic kernel
    (app/models/quant.py `LinearQuantizer`). On a Zen 5, one run of `bench scaling` at the 0.5B shape, the head then
    weight-only on the table's int8 rows: RSS after one answer 0.61x of the defaults' against 0.72x in fp32, tokens/s
    at one stream the same (1.01x), at 8 streams 0.96x, idle TTFT the same (docs/performance.md "Memory")."""
    if quant == "none" or not dynamic_int8_supported(device, torch.float32):
        return None
    native, why = auto_dtype(device, features)
    if quant == "int4" and native == torch.bfloat16:
        return torch.bfloat16, (f"QUANT=int4 and {why}: bf16 activations, the 4-bit kernel's own; the lm_head on "
                                "dynamic int8, in fp32")
    return torch.float32, f"QUANT={quant}: its dynamic int8 kernels take fp32 activations"


def load_model(name_or_path: str, device: str = "auto", dtype: str = "auto",
               cache_dir: Path | str = Path.home() / ".cache" / "simple-serve",
               max_model_len: int | None = None, prepack: str | bool = "auto", quant: str = "none",
               tensor_parallel: int = 1, int4_wide_copy: bool = False, int4_kernel: str = "auto",
               batch_invariant: str = "auto", decode_step: str = "eager",
               lora: bool = False, kv_cache_dtype: str = "auto",
               decode_attention: str = "auto") -> LoadedModel | PoolingModel | CrossEncoderModel:
    """`tensor_parallel` > 1: this process is one of that many ranks started by torchrun, and loads its shard
    (app/models/distributed.py). `lora`: LoRA adapters will be served (BATCH_INVARIANT=auto weighs them)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.distributed import DistributedConfig

    prepack = prepack_mode(prepack)
    torch_device = resolve_device(device)
    quant, own_bits = resolve_quant(quant, name_or_path, torch_device, tensor_parallel)
    if dtype == "auto" and (chosen := quant_auto_dtype(quant, torch_device)) is not None:
        torch_dtype, dtype_reason = chosen
    else:
        torch_dtype, dtype_reason = resolve_dtype(dtype, torch_device)
    if prepack == "true" and (why := prepack_support(torch_device, torch_dtype)):  # before minutes of loading
        raise ConfigError(f"PREPACK=true, but {why} (dtype: {dtype_reason}); set PREPACK=auto to prepack only "
                          "where it runs", param="prepack")
    if tensor_parallel > 1 and quant != "none":
        raise ConfigError(f"QUANT={quant} replaces the linear layers that tensor parallelism shards; use one or "
                          "the other", param="quant")
    if tensor_parallel > 1 and prepack == "true":
        raise ConfigError("PREPACK=true, but tensor parallelism shards the linear layers that prepacking copies; "
                          "set PREPACK=auto (off under tensor parallelism)", param="prepack")
    source, kwargs = locate(name_or_path, Path(cache_dir))
    if not kwargs and Path(source).is_dir() and is_pooling_dir(Path(source)):
        return _load_pooling(source, name_or_path, torch_device, dtype, max_model_len, quant, tensor_parallel)
    log.info("dtype %s: %s", str(torch_dtype).removeprefix("torch."), dtype_reason)
    ranks = invariant = vision = None
    if quant != "none":  # weighs no weights: resolved first, as the linears are quantized while they load
        invariant, invariance = resolve_batch_invariant(batch_invariant, torch_device, torch_dtype, quant,
                                                         decode_step, lora=lora)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        if why := unservable(config) or vision_problem(config, quant, tensor_parallel):  # before loading weights
            raise ConfigError(f"cannot serve {name_or_path!r}: {why}", param="quant" if "QUANT" in why else "model")
        if kv_cache_dtype == "int8" and getattr(config.get_text_config(decoder=True), "kv_lora_rank", None):
            raise ConfigError(f"KV_CACHE_DTYPE=int8 keeps keys and values per head; {name_or_path!r} caches a "
                              "compressed latent (MLA); set KV_CACHE_DTYPE=auto", param="kv_cache_dtype")
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        drop_build_inputs(tokenizer)  # its Python vocabulary and merges: 64 MiB for Qwen2's (tokenizer_memory.py)
        if tensor_parallel > 1:
            if why := tp_plan_problem(config, tensor_parallel, name_or_path):  # before joining the other ranks
                raise ConfigError(why, param="tensor_parallel")
            ranks = Ranks(tensor_parallel, torch_device)
            # Each rank reads only its shard; transformers puts it on this rank's device (LOCAL_RANK).
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=torch_dtype, distributed_config=DistributedConfig(tp_size=tensor_parallel), **kwargs)
        elif is_vision(config):  # the engine serves its language model; images become embeddings before it
            model, vision = load_vision(source, kwargs, torch_device, torch_dtype, tokenizer)
        else:  # streamed where it can be, quantized as it loads (app/models/streamed_load.py)
            model = load_weights(source, kwargs, config, torch_device, torch_dtype, quant,
                                 {"wide_copy": int4_wide_copy, "batch_invariant": invariant, "own_bits": own_bits,
                                  "int4_kernel": int4_kernel})
    except OSError as err:  # hub id not found, hub unreachable, files missing in a directory
        raise ConfigError(f"could not load model {name_or_path!r}: {err}", param="model") from err
    model.eval()
    if invariant is None:
        no_copies = (_no_fp32_copies(model, prepack, torch_device, torch_dtype)  # what `auto` weighs on a CPU, fp32
                     if batch_invariant == "auto" and tensor_parallel == 1 else None)
        invariant, invariance = resolve_batch_invariant(batch_invariant, torch_device, torch_dtype, quant,
                                                         decode_step, sharded=tensor_parallel > 1,
                                                         no_fp32_copies=no_copies, lora=lora)
    if ranks is not None:
        # The prepacked copies and batched-row kernels swap the linears' weights, which are DTensor shards here.
        prepack_state = f"off: tensor parallel over {tensor_parallel} ranks"
    elif quant != "none":  # quantized as it loaded: every linear, lm_head included, none to prepack
        prepack_state = f"off: QUANT={quant} replaced every linear layer"
        if decode_step == "eager" and (joined := join_projections(model)):
            log.info("q/k/v and gate/up on our kernels: %d groups each read in one call (app/models/fuse.py)", joined)
    else:
        prepack_state = _prepack(model, prepack, torch_device, torch_dtype, Path(cache_dir) / PREPACK_CHOICES,
                                 choice_key(name_or_path, torch_dtype), invariant)
        if prepack_state.startswith("on") and torch_dtype != torch.float32:
            # bf16 packed in place: the packed weights are new memory, and what is left (the embedding table, norms,
            # plain layers) gets its own too, so that the checkpoint's mapping closes. A view of it (the embedding
            # table) had kept every page that packing read in the server's RSS: about 950 MiB of a bf16 0.5B
            # checkpoint's, on a Zen 5 (docs/performance.md).
            keep_own_copies(model)
    log.info("prepack %s", prepack_state)
    if invariant:
        invariance = f"{invariance}; {make_linears_invariant(model, torch_dtype, ranks is not None)}"
    log.info("batch invariance %s: %s", "on" if invariant else "off", invariance)
    attention = None  # decode rows of the fp32 oracle (fp32, no QUANT) keep SDPA; on a GPU too (packed.py)
    if torch_device.type == "cpu" and (torch_dtype != torch.float32 or kv_cache_dtype == "int8" or quant != "none"):
        attention = choose_attention_kernel(decode_attention)
        log.info("decode attention: %s", attention.describe())
    weight_bytes = {} if ranks is not None else weight_bytes_by_format(model)  # a rank's shards: not counted here
    if weight_bytes:
        log.info("weights in memory: %s", describe(weight_bytes))
    defaults = _generation_defaults(model, source)
    eos = defaults.pop("eos_token_id", None)
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    model_len = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) or 4096
    if max_model_len is not None and max_model_len > model_len:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {model_len}", param="max_model_len")
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path, max_context=max_model_len or model_len,
                       eos_ids=tuple(sorted(eos_ids)), generation_defaults=defaults, dtype_reason=dtype_reason,
                       prepack=prepack_state, ranks=ranks, weight_bytes=weight_bytes,
                       batch_invariant=invariant, invariance=invariance, kv_int8=kv_cache_dtype == "int8",
                       vision=vision, decode_attention=attention)


def _load_pooling(source: str, name: str, device: torch.device, dtype: str, max_model_len: int | None, quant: str,
                  tensor_parallel: int) -> PoolingModel | CrossEncoderModel:
    """An embedding model (app/models/pooling.py): the server serves /v1/embeddings, /v1/rerank and /v1/score; or a
    cross-encoder (app/models/cross_encoder.py): /v1/rerank and /v1/score."""
    if quant != "none" or tensor_parallel > 1:
        raise ConfigError(f"{name!r} is an embedding model; QUANT and TENSOR_PARALLEL apply to chat models only",
                          param="quant" if quant != "none" else "tensor_parallel")
    if dtype == "auto":  # small models, whose vectors clients compare against the float32 reference's
        torch_dtype, why = torch.float32, "dtype=auto: embedding models run in float32, as sentence-transformers does"
    else:
        torch_dtype, why = resolve_dtype(dtype, device)
    log.info("embedding model; dtype %s: %s", str(torch_dtype).removeprefix("torch."), why)
    if is_cross_encoder_dir(Path(source)):
        return load_cross_encoder(source, name, device, torch_dtype, why, max_model_len)
    return load_pooling_model(source, name, device, torch_dtype, why, max_model_len)


def _prepack(model, mode: str, device: torch.device, dtype: torch.dtype, choices: Path | None = None,
             key: str = "", invariant: bool = False) -> str:
    """Prepack where it runs: bf16 in place where it measures faster (app/models/prepack.py),
    fp32 as a copy for the engine's batched rows (app/models/batch_rows.py); returns what was done, for the log,
    /ready and /v1/models. `invariant` (BATCH_INVARIANT): only kernels that compute a row the same way at any row
    count, checked here (app/models/row_check.py)."""
    if mode == "false":
        state = "off: PREPACK=false"
    elif why := prepack_support(device, dtype):  # auto; `true` was refused before loading
        state = f"off: {why}"
    elif dtype == torch.float32:
        return _pack_fp32_copies(model, strict=mode == "true", invariant=invariant)
    else:
        return _pack_bf16(model, mode, choices, key, invariant)
    if device.type == "cpu" and dtype == torch.float32:
        # a batch's wide linears as `W @ x.T`, which needs no copy; invariant: every linear, on a kernel checked here
        use_batch_rows(model, packed=False, invariant=invariant)
    return state


def _pack_bf16(model, mode: str, choices: Path | None = None, key: str = "", invariant: bool = False) -> str:
    """PREPACK=true: every linear; auto: the shapes whose packed kernel measured faster here (app/models/prepack.py).
    The measurement is kept in `choices` (in the model cache): a restart on the same CPU packs the same layers,
    whatever else the machine is doing while it starts."""
    only, measured = None, ""
    timings = load_choice(choices, key) if mode == "auto" else None
    if timings is None and mode == "auto":
        timings = measure_packing(model)
        save_choice(choices, key, timings)
    elif timings is not None:
        log.info("prepack: the choice measured at an earlier start on this CPU (%s; delete it to measure again)",
                 choices)
    if mode == "auto" and timings:
        wins = {(t.in_features, t.out_features) for t in timings if t.packs}
        only = lambda linear: (linear.in_features, linear.out_features) in wins  # noqa: E731
        measured = "; ".join(t.describe() for t in timings)
        log.info("prepack: plain against packed, ms per layer call: %s", measured)
        if not wins:
            return f"off: plain measured faster on every shape ({measured})"
    try:
        count = prepack_linears(model, strict=mode == "true", only=only, invariant=invariant,
                                splits=invariant_splits(torch.bfloat16, torch.device("cpu")))
    except PrepackFailed as err:
        raise ConfigError(f"PREPACK=true, but {err}", param="prepack") from err
    if not count:
        variant = ", or its kernel computed a row differently at different row counts (BATCH_INVARIANT)"
        return f"off: oneDNN refused the reorder{variant if invariant else ''} (see the log)"
    where = f", the shapes where packed measured faster ({measured})" if measured else ""
    return f"on: {count} linear layers{where}"


def _copies_do_not_fit(model) -> str | None:
    """Why the fp32 copies for batched rows are left out for the RAM (None: they fit)."""
    need, available = copy_bytes(model), psutil.virtual_memory().available
    if need > available * FP32_COPY_RAM_FRACTION:
        return (f"fp32 copies for batched rows would take {_size(need)}, more than half the {_size(available)} of RAM "
                "available")
    return None


def _no_fp32_copies(model, prepack: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this CPU fp32 model will get no packed fp32 copies (None: it will try to make them)."""
    if dtype != torch.float32 or device.type != "cpu":
        return None
    if prepack == "false":
        return "PREPACK=false"
    return prepack_support(device, dtype) or _copies_do_not_fit(model)


def _pack_fp32_copies(model, strict: bool, invariant: bool = False) -> str:
    need, why = copy_bytes(model), _copies_do_not_fit(model)
    if why is None:
        try:
            count = use_batch_rows(model, packed=True, invariant=invariant)
        except RuntimeError as err:  # the reorder raised, or its products were off: nothing was swapped
            why = str(err)
    if why is None:
        kept, variant = copy_bytes_held(model), ("oneDNN's packed fp32 kernel did not compute a row the same way at "
                                                 "every row count here (BATCH_INVARIANT)")
        if not kept:
            return f"off: {variant}"
        left = "" if kept == need else f"; {_size(need - kept)} of them left out, where {variant}"
        return f"on: {count} linear layers, with fp32 copies for batched rows ({_size(kept)}){left}"
    if strict:
        raise ConfigError(f"PREPACK=true, but {why}", param="prepack")
    log.warning("prepack: %s; batched rows stay on MKL", why)
    use_batch_rows(model, packed=False, invariant=invariant)
    return f"off: {why}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def serves_embeddings(name_or_path: str) -> bool:
    """Whether MODEL names an embedding model (decided before loading, from names and files only): the embedded
    embedding model, or a local directory that app/models/pooling.py takes for an encoder."""
    if name_or_path in EMBEDDED:
        return EMBEDDED[name_or_path].archive == "zipped_dir"
    path = Path(name_or_path).expanduser()
    return path.is_dir() and is_pooling_dir(path)


def _generation_defaults(model, source: str) -> dict[str, Any]:
    """Only keys the model's generation_config.json actually sets; transformers' own fallbacks (top_k=50) are not
    the model author's advice."""
    config_file = Path(source) / "generation_config.json"
    if config_file.is_file():
        raw = json.loads(config_file.read_text())
    else:
        raw = model.generation_config.to_diff_dict() if model.generation_config is not None else {}
    return {k: v for k, v in raw.items() if k in GENERATION_CONFIG_KEYS or k == "eos_token_id"}
