"""Load one model and its tokenizer: an embedded model name, a local HF directory, a .gguf file, or a hub id.

`LoadedModel` bundles what the rest of the service needs to know about the model: its device, dtype, context
window, EOS ids, the sampling defaults from its generation_config.json, and how to turn chat messages into ids.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from app.errors import ConfigError
from app.models.fetch import EMBEDDED, fetch_model
from app.models.prepack import PackedLinear, prepack_linears, prepack_supported
from app.models.quant import dynamic_int8_supported, quantize_linears

log = logging.getLogger("app.models.loading")

# The generation_config.json keys that map onto sampling parameters. They live with the loading code so that
# models/ never imports core/; core/sampling.py has a built-in default for each.
GENERATION_CONFIG_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    model: Any  # a transformers *ForCausalLM with .model (the body) and .lm_head
    tokenizer: Any
    name: str
    max_context: int
    eos_ids: tuple[int, ...]
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def encode_chat(self, messages: Sequence[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render with the tokenizer's own chat template (and its way of showing `tools`), ending in the assistant's
        turn. `template_kwargs` are the template's own switches, such as Qwen3's `enable_thinking`."""
        text = self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=True, **(template_kwargs or {}))
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        # The chat template already wrote any BOS it wants; plain prompts are taken as given.
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda was asked for, but torch sees no CUDA GPU", param="device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, hidden_size: int, prepack: bool = True) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return _fastest_cpu_dtype(hidden_size, prepack)


def _fastest_cpu_dtype(hidden_size: int, prepack: bool) -> torch.dtype:
    """Decode is a matrix-vector product per layer; time one of the model's shape in bf16 and fp32, keep the faster.

    bf16 reads half the bytes, which wins wherever the CPU has native bf16 dot products (measured about 2x here);
    on CPUs without them the conversion cost can make fp32 faster. bf16 is timed as it will run: prepacked if on.
    """
    # Rows enough for ~64 MB of fp32 weights: bigger than the CPU caches, so the probe is memory-bound
    # like a real decode step (a cache-resident probe would time arithmetic and wrongly favour fp32).
    rows = max(4 * hidden_size, (64 << 20) // (4 * hidden_size))

    def seconds(dtype: torch.dtype) -> float:
        x = torch.ones(1, hidden_size, dtype=dtype)
        linear = torch.nn.Linear(hidden_size, rows, bias=False, dtype=dtype)
        torch.nn.init.constant_(linear.weight, 0.01)
        if prepack and prepack_supported(x.device, dtype):
            linear = PackedLinear(linear)
        linear(x)  # warm-up
        best = float("inf")
        for _ in range(5):  # the best of several, so a busy neighbour does not decide the dtype
            start = time.perf_counter()
            for _ in range(4):
                linear(x)
            best = min(best, time.perf_counter() - start)
        return best / 4

    bf16, fp32 = seconds(torch.bfloat16), seconds(torch.float32)
    chosen = torch.bfloat16 if bf16 < fp32 else torch.float32
    log.info("dtype=auto on cpu: bf16 %.2f ms, fp32 %.2f ms per probe; chose %s", bf16 * 1e3, fp32 * 1e3, chosen)
    return chosen


def load_model(name_or_path: str, device: str = "auto", dtype: str = "auto",
               cache_dir: Path | str = Path.home() / ".cache" / "simple-serve",
               max_model_len: int | None = None, prepack: bool = True, quant: str = "none") -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    source, kwargs = _locate(name_or_path, Path(cache_dir))
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        if quant != "none" and dtype == "auto" and dynamic_int8_supported(torch_device, torch.float32):
            torch_dtype = torch.float32  # int8 x uint8 dynamic kernels take fp32 activations (app/models/quant.py)
        else:
            torch_dtype = resolve_dtype(dtype, torch_device, config.hidden_size, prepack)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except OSError as err:  # hub id not found, hub unreachable, files missing in a directory
        raise ConfigError(f"could not load model {name_or_path!r}: {err}", param="model") from err
    model.to(torch_device).eval()
    if quant != "none":
        quantize_linears(model, quant)  # every linear, lm_head included; nothing is left for prepack below
    if prepack and prepack_supported(torch_device, model.dtype):
        prepack_linears(model)  # app/prepack.py: ~2.5x faster bf16 linears on CPU, bit-identical outputs
    defaults = _generation_defaults(model, source)
    eos = defaults.pop("eos_token_id", None)
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    model_len = getattr(config, "max_position_embeddings", None) or 4096
    if max_model_len is not None and max_model_len > model_len:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {model_len}", param="max_model_len")
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path, max_context=max_model_len or model_len,
                       eos_ids=tuple(sorted(eos_ids)), generation_defaults=defaults)


def _locate(name_or_path: str, cache_dir: Path) -> tuple[str, dict[str, Any]]:
    """Where from_pretrained should look, and with which extra arguments."""
    if name_or_path in EMBEDDED:
        return str(fetch_model(name_or_path, cache_dir)), {}
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}", param="model")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} is a directory but has no config.json", param="model")
        return str(path), {}
    if name_or_path.startswith(("/", "./", "../", "~")) or path.exists() or name_or_path.count("/") != 1:
        raise ConfigError(f"model path not found: {name_or_path} (nor is it an embedded model name: "
                          f"{', '.join(EMBEDDED)}; a hub id looks like org/name)", param="model")
    return name_or_path, {}  # a hub id such as Qwen/Qwen2.5-7B-Instruct


def _generation_defaults(model, source: str) -> dict[str, Any]:
    """Only keys the model's generation_config.json actually sets; transformers' own fallbacks (top_k=50) are not
    the model author's advice."""
    config_file = Path(source) / "generation_config.json"
    if config_file.is_file():
        raw = json.loads(config_file.read_text())
    else:
        raw = model.generation_config.to_diff_dict() if model.generation_config is not None else {}
    return {k: v for k, v in raw.items() if k in GENERATION_CONFIG_KEYS or k == "eos_token_id"}
