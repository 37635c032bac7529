"""LoRA adapters over HTTP, as vLLM serves them: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` with
vLLM's bodies (`lora_name`, `lora_path`, `load_inplace`), and the adapters' entries in `/v1/models`, each with its
base as `parent` and no path. The routes exist only with LORA_RUNTIME_LOADING=true, which needs API_KEY and
LORA_ADAPTER_ROOT (app/config.py): a `lora_path` is read on the server, from under that root only (404 otherwise,
as for a route that is not there). The tenant (the API key) that loads an adapter owns it, and the name is that
key's alone: only it may select, list, replace or unload it, within MAX_LORAS_PER_KEY (app/models/lora.py). A
request then selects an adapter by naming it in `model` (app/openai/serving.py's `check_model`)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.errors import ServeError
from app.models.lora import LoraAdapters


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM clients may send more: accepted, not used
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    # vLLM's: replace an adapter of this name (one this key loaded) in place; without it an existing name is a 400
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's `lora_int_id`: accepted, the name is what counts
    lora_name: str = Field(min_length=1, max_length=256)


class RuntimeLoadingOff(ServeError):
    status = 404
    error_type = "invalid_request_error"

    def __init__(self):
        super().__init__("loading LoRA adapters at runtime is off on this server (LORA_RUNTIME_LOADING=false)",
                         code="not_found")


def runtime_adapters(adapters: LoraAdapters | None) -> LoraAdapters:
    if adapters is None or not adapters.runtime_loading:
        raise RuntimeLoadingOff()
    return adapters


async def load_adapter(adapters: LoraAdapters, body: LoadLoraAdapterRequest, tenant: str) -> dict[str, Any]:
    """Read and check the adapter off the event loop (its files may be large); 400 naming the problem."""
    adapter = await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path, tenant, body.load_inplace)
    return {"object": "lora_adapter", "lora_name": adapter.name, "lora_path": body.lora_path, "rank": adapter.rank,
            "status": "loaded"}


def unload_adapter(adapters: LoraAdapters, body: UnloadLoraAdapterRequest, tenant: str) -> dict[str, Any]:
    adapters.unload(body.lora_name, tenant)  # 404 unless this key's or a start-up one (403); running requests finish
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}


def adapter_models(adapters: LoraAdapters | None, base_id: str, tenant: str | None = None) -> list[dict[str, Any]]:
    """The `/v1/models` entries of the adapters `tenant` may select (the start-up ones and its own), as vLLM lists
    them but without `root`: where an adapter lies on the server is no client's business."""
    if adapters is None:
        return []
    return [{"id": a.name, "object": "model", "created": 0, "owned_by": "simple-serve", "parent": base_id}
            for a in adapters.visible(tenant)]
