"""LoRA adapters over HTTP, as vLLM serves them: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` with
vLLM's bodies (`lora_name`, `lora_path`), and the adapters' entries in `/v1/models`, each with its base as
`parent`. The routes exist only with LORA_RUNTIME_LOADING=true: a path in a request is read on the server, so
loading is an operator's choice (404 otherwise, as for a route that is not there). A request then selects an
adapter by naming it in `model` (app/openai/serving.py's `check_model`)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.errors import ServeError
from app.models.lora import LoraAdapters


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM clients may send more (`load_inplace`): accepted, not used
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


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


async def load_adapter(adapters: LoraAdapters, body: LoadLoraAdapterRequest) -> dict[str, Any]:
    """Read and check the adapter off the event loop (its files may be large); 400 naming the problem."""
    adapter = await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
    return {"object": "lora_adapter", "lora_name": adapter.name, "lora_path": adapter.path, "rank": adapter.rank,
            "status": "loaded"}


def unload_adapter(adapters: LoraAdapters, body: UnloadLoraAdapterRequest) -> dict[str, Any]:
    adapters.unload(body.lora_name)  # 404 naming it if it is not loaded; requests running with it finish
    return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}


def adapter_models(adapters: LoraAdapters | None, base_id: str) -> list[dict[str, Any]]:
    """The adapters' `/v1/models` entries, as vLLM lists them: `root` the path, `parent` the base model."""
    if adapters is None:
        return []
    return [{"id": a.name, "object": "model", "created": 0, "owned_by": "simple-serve", "root": a.path,
             "parent": base_id} for a in adapters.loaded()]
