"""LoRA adapters: peft's files read, checked against the served model, and kept by name.

An adapter is a directory as peft's `save_pretrained` writes it: `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, `use_rslora`) and `adapter_model.safetensors`, where each targeted linear `W` [out, in] has
`...<module>.lora_A.weight` [r, in] and `...<module>.lora_B.weight` [out, r]. The adapted layer computes
`W x + scale * B (A x)`, scale = alpha / r (alpha / sqrt(r) with rsLoRA), as peft's own unmerged forward does.

Nothing is merged into the base weights: each request names its adapter (or none), and the layers add each row's
own low-rank product (app/models/lora_layers.py), so requests of several adapters and the base share a pass.
An adapter is read and checked whole before it is registered, so a bad one changes nothing already loaded. A
request holds its `LoraAdapter` (its weights with it) for as long as it runs: unloading only forgets the name.

What is refused, with a message naming it: a module this model does not have as a linear layer of its body, shapes
that differ from the base's, a rank above MAX_LORA_RANK, and peft options this loop does not apply (DoRA, trained
biases, `modules_to_save`, per-module rank or alpha patterns, embedding adapters). A path with nothing loadable
there (missing, not a peft LoRA adapter, unreadable) is refused too: by name for the operator's LORA_MODULES, but
for a client's runtime load with one message whatever the cause, as for a path outside LORA_ADAPTER_ROOT, so that
loading is no oracle for what exists on the server's disk.

Ownership: an adapter loaded at runtime belongs to the tenant (API key) that loaded it, and its name is that tenant's
alone: only that tenant may select, list, replace (`load_inplace`) or unload it, and another tenant may load its own
adapter under the same name (vLLM's adapters are one global namespace; here one key's names would otherwise become
what another key's clients run). The start-up adapters (LORA_MODULES) belong to no tenant: every tenant sees them,
none may replace or unload them, and no runtime load may take their names. Besides MAX_LORAS for the whole server,
each tenant holds at most `max_per_owner` runtime adapters (MAX_LORAS_PER_KEY), so one key cannot take every slot.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from app.errors import InvalidRequest, ModelNotFound, ServeError
from app.models.lora_layers import wrap_linears

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_serials = itertools.count(1)


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> (A [r, in], B [out, r]), model dtype
    # unique per load: salts the prefix cache, so a reload under the same name never reuses the old one's KV
    key: str = field(default_factory=lambda: f"lora-{next(_serials)}")
    owner: str | None = None  # the tenant that loaded it at runtime; None: a start-up adapter, no tenant's
    # what /metrics shows for it (app/metrics.py `AdapterSeries`): kept here, so its series leave with it
    requests: int = 0
    generated_tokens: int = 0


class AdapterNotLoadable(InvalidRequest):
    """Nothing loadable at the path: missing, not a peft LoRA adapter, unreadable. A runtime load says only that."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path", code="invalid_lora_adapter")


class AdapterNotYours(ServeError):
    status = 403
    error_type = "permission_error"

    def __init__(self, message: str):
        super().__init__(message, param="lora_name", code="adapter_not_owned")


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="lora_path", code="invalid_lora_adapter")


def not_loadable(name: str, path: str) -> AdapterNotLoadable:
    """The one answer a runtime load gets for a path with nothing loadable, whatever the cause."""
    return AdapterNotLoadable(f"adapter {name!r}: no loadable peft LoRA adapter at {path[:256]!r} (the path must "
                              "name a directory under LORA_ADAPTER_ROOT holding adapter_config.json and "
                              "adapter_model.safetensors, readable by the server)")


def confined(root: Path, path: str) -> Path | None:
    """`path` (relative to `root`, or absolute) resolved, symlinks and `..` followed; None unless inside `root`."""
    try:
        resolved = (root / path).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return None
    return resolved if resolved.is_relative_to(root) else None


def read_adapter(name: str, path: str, targets: dict[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    """Read and check one adapter directory. `targets`: the model's adaptable linears, name -> (in, out)."""
    try:
        return _read_adapter(name, Path(path), path, targets, max_rank, dtype, device)
    except OSError as err:  # permission denied, say, anywhere below
        raise AdapterNotLoadable(f"adapter {name!r}: {path!r} cannot be read: {err.strerror or err}") from None


def _read_adapter(name: str, where: Path, path: str, targets: dict[str, tuple[int, int]], max_rank: int,
                  dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    if not where.exists():
        raise AdapterNotLoadable(f"adapter {name!r}: the path {path!r} does not exist on the server")
    if not (where / CONFIG_FILE).is_file():
        raise AdapterNotLoadable(f"adapter {name!r}: {path!r} is not a peft adapter (no {CONFIG_FILE})")
    try:
        config = json.loads((where / CONFIG_FILE).read_text())
    except ValueError as err:
        raise AdapterNotLoadable(f"adapter {name!r}: {CONFIG_FILE} cannot be read: {err}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterNotLoadable(f"adapter {name!r}: {path!r} is not a LoRA adapter (peft_type "
                                 f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _refuse(f"adapter {name!r}: {CONFIG_FILE} needs a positive integer `r` and a number `lora_alpha`")
    if rank > max_rank:
        raise _refuse(f"adapter {name!r} has rank {rank}, above MAX_LORA_RANK={max_rank}")
    unsupported = [key for key, plain in (("use_dora", False), ("bias", "none"), ("lora_bias", False),
                                          ("fan_in_fan_out", False), ("modules_to_save", None), ("rank_pattern", {}),
                                          ("alpha_pattern", {}), ("layer_replication", None),
                                          ("trainable_token_indices", None), ("target_parameters", None),
                                          ("alora_invocation_tokens", None))
                   if config.get(key, plain) not in (plain, None, {}, [], False)]
    if unsupported:
        raise _refuse(f"adapter {name!r} uses peft options this server does not apply: {', '.join(unsupported)}")
    if not (where / WEIGHTS_FILE).is_file():
        raise AdapterNotLoadable(f"adapter {name!r}: no {WEIGHTS_FILE} in {path!r} (only peft's safetensors format "
                                 "is read)")
    try:
        tensors = load_file(str(where / WEIGHTS_FILE))
    except Exception as err:  # noqa: BLE001 - a corrupt file is the caller's to fix
        raise AdapterNotLoadable(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {err}") from None
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraAdapter(name, path, rank, float(scale), _pairs(name, tensors, targets, rank, dtype, device))


def _pairs(name: str, tensors: dict[str, torch.Tensor], targets: dict[str, tuple[int, int]], rank: int,
           dtype: torch.dtype, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """peft's keys (`base_model.model.<module>.lora_A.weight`) -> module name -> (A, B), checked against the base."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, dot, rest = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not dot or rest not in ("A.weight", "B.weight"):
            raise _refuse(f"adapter {name!r}: tensor {key!r} is not a LoRA linear's A or B (embedding adapters "
                          "are not served)")
        halves.setdefault(module, {})[rest[0]] = tensor
    if not halves:
        raise _refuse(f"adapter {name!r} holds no LoRA weights")
    pairs = {}
    for module, half in halves.items():
        if module not in targets:
            raise _refuse(f"adapter {name!r} targets {module!r}, which is not a linear layer of this model's body")
        if set(half) != {"A", "B"}:
            raise _refuse(f"adapter {name!r}: {module!r} lacks its lora_{'B' if 'A' in half else 'A'} weight")
        n_in, n_out = targets[module]
        a, b = half["A"], half["B"]
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise _refuse(f"adapter {name!r} does not fit this base model: {module!r} is {n_out} x {n_in} here, "
                          f"the adapter's A is {tuple(a.shape)} and B is {tuple(b.shape)} (rank {rank})")
        pairs[module] = (a.to(device=device, dtype=dtype).contiguous(), b.to(device=device, dtype=dtype).contiguous())
    return pairs


class LoraAdapters:
    """The adapters a server holds, by owner and name: at most `max_loras` resident, at most `max_per_owner` of
    them any one tenant's (None: no bound but `max_loras`), each of rank at most `max_rank`.

    `attach` (on the engine's thread, once the model is loaded) makes the model's linears adaptable and loads the
    start-up adapters; `load` and `unload` may then run on any thread, while the engine runs passes. `root`
    (LORA_ADAPTER_ROOT): where `load` may read from; None: anywhere, with each problem named (the library's use).
    An `owner` of None is no tenant's: the start-up adapters, and the library's loads; every owner sees those."""

    def __init__(self, base_id: str, modules: dict[str, str] | None = None, max_loras: int = 4, max_rank: int = 16,
                 runtime_loading: bool = False, root: str | Path | None = None, max_per_owner: int | None = None):
        self.base_id, self.startup = base_id, dict(modules or {})
        self.max_loras, self.max_rank, self.runtime_loading = max_loras, max_rank, runtime_loading
        self.max_per_owner = max_per_owner
        self.root = Path(root).resolve() if root is not None else None
        self._by_name: dict[tuple[str | None, str], LoraAdapter] = {}  # (owner, name) -> adapter
        self._lock = threading.Lock()  # registration only: a load reads its files outside it
        self._targets: dict[str, tuple[int, int]] = {}
        self._dtype, self._device = torch.float32, torch.device("cpu")

    def attach(self, model: torch.nn.Module) -> None:
        self._targets = wrap_linears(model)
        param = next(model.parameters())
        self._dtype = param.dtype if param.is_floating_point() else torch.float32
        self._device = param.device
        for name, path in self.startup.items():
            self._add(name, path, owner=None, replace=False)

    def load(self, name: str, path: str, owner: str | None = None, replace: bool = False) -> LoraAdapter:
        """Load `name` from `path` for `owner` (a tenant id); `replace`: swap an adapter of that name the owner
        loaded (vLLM's `load_inplace`). Under a `root`, anything not loadable there gets one message."""
        if self.root is None:
            return self._add(name, path, owner, replace)
        where = confined(self.root, path)
        if where is None:
            raise not_loadable(name, path)
        try:
            return self._add(name, str(where), owner, replace, shown_path=path)
        except AdapterNotLoadable:
            raise not_loadable(name, path) from None

    def _add(self, name: str, path: str, owner: str | None, replace: bool, shown_path: str | None = None
             ) -> LoraAdapter:
        if not name or name == self.base_id:
            raise InvalidRequest(f"an adapter cannot be named {name!r}", param="lora_name")
        with self._lock:
            self._check_room(name, owner, replace)
        adapter = read_adapter(name, path, self._targets, self.max_rank, self._dtype, self._device)
        adapter.path, adapter.owner = shown_path or path, owner
        with self._lock:  # checked again: another load may have taken the name or the room meanwhile
            old = self._check_room(name, owner, replace)
            if old is not None:  # its counts go on under the same name; requests running with it keep it
                adapter.requests, adapter.generated_tokens = old.requests, old.generated_tokens
            self._by_name[(owner, name)] = adapter
        return adapter

    def _find(self, name: str, owner: str | None) -> LoraAdapter | None:
        """What `name` means to `owner`: its own adapter of that name, else one of no tenant's (call with the lock
        held). Another tenant's adapter is never found: to this owner that name is not loaded."""
        own = self._by_name.get((owner, name)) if owner is not None else None
        return own if own is not None else self._by_name.get((None, name))

    def _check_room(self, name: str, owner: str | None, replace: bool) -> LoraAdapter | None:
        """The adapter `name` would replace, if any; raises if it may not be loaded."""
        old = self._find(name, owner)
        if old is not None and not replace:
            raise InvalidRequest(f"an adapter named {name!r} is already loaded; unload it first, or send "
                                 "`load_inplace: true` to replace it", param="lora_name")
        if old is not None:
            self._check_owner(old, owner, "replace")
            return old
        held = sum(1 for who, _ in self._by_name if who == owner)  # this owner's; no tenant's are not bounded
        if owner is not None and self.max_per_owner is not None and held >= self.max_per_owner:
            raise InvalidRequest(f"this API key holds {held} adapters, MAX_LORAS_PER_KEY={self.max_per_owner}; "
                                 "unload one of them first", param="lora_name")
        if len(self._by_name) >= self.max_loras:
            raise InvalidRequest(f"{len(self._by_name)} adapters are loaded, MAX_LORAS={self.max_loras}; unload one "
                                 "first", param="lora_name")
        return None

    @staticmethod
    def _check_owner(adapter: LoraAdapter, owner: str | None, verb: str) -> None:
        # `_find` gives an owner only its own adapters and no tenant's: any other is a start-up one
        if adapter.owner != owner:
            raise AdapterNotYours(f"adapter {adapter.name!r} was loaded at start (LORA_MODULES): no API key may "
                                  f"{verb} it")

    def unload(self, name: str, owner: str | None = None) -> None:
        """Forget `owner`'s `name` (a start-up one may not be); requests already running with it keep its weights
        until they end."""
        with self._lock:
            adapter = self._find(name, owner)
            if adapter is None:
                raise ModelNotFound(f"no adapter named {name!r} is loaded", param="lora_name")
            self._check_owner(adapter, owner, "unload")
            del self._by_name[(adapter.owner, name)]

    def get(self, name: str, owner: str | None = None) -> LoraAdapter | None:
        """The adapter a request of `owner` (a tenant id; None: no tenant's) selects by `name`, if any."""
        with self._lock:
            return self._find(name, owner)

    def visible(self, owner: str | None = None) -> list[LoraAdapter]:
        """The adapters `owner` may select: no tenant's and its own, in the order they were loaded."""
        with self._lock:
            return [a for (who, _), a in self._by_name.items() if who is None or who == owner]

    def loaded(self) -> list[LoraAdapter]:
        """Every tenant's (what /metrics counts)."""
        with self._lock:
            return list(self._by_name.values())
