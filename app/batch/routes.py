"""Thin routes for OpenAI's Files and Batches API (`/v1/files`, `/v1/batches`), behind the API key like every API
route; service.py does the work. With BATCH_DIR unset they answer 404, naming the setting."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, BinaryIO, Iterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from app.api import State, body_schema, parsed, require_api_key
from app.batch.service import MAX_LIST_LIMIT, BatchService, NotFound, file_object
from app.batch.uploads import UPLOAD_OPENAPI, receive_upload

router = APIRouter(dependencies=[Depends(require_api_key)])


def get_batches(state: State) -> BatchService:
    if state.batches is None:
        raise NotFound("the Files and Batches API is off on this server: set BATCH_DIR to turn it on "
                       "(docs/batch.md)")
    return state.batches


Batches = Annotated[BatchService, Depends(get_batches)]
Limit = Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)]


def tenant(request: Request) -> str | None:
    return getattr(request.state, "tenant", None)


@router.post("/v1/files", openapi_extra=UPLOAD_OPENAPI)
async def upload_file(request: Request, batches: Batches) -> dict:
    # No `UploadFile` or `Form` parameter: FastAPI would read the whole form before the key check (uploads.py)
    return await receive_upload(request, batches, tenant(request))


@router.get("/v1/files")
async def list_files(request: Request, batches: Batches, purpose: str | None = None, after: str | None = None,
                     limit: Limit = 100) -> dict:
    return batches.files(tenant(request), purpose, after, limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, batches: Batches) -> dict:
    return file_object(batches.file(tenant(request), file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request, batches: Batches) -> StreamingResponse:
    size, f = await batches_call(batches.open_content, tenant(request), file_id)
    return StreamingResponse(read_chunks(f), media_type="application/jsonl", headers={"content-length": str(size)})


def read_chunks(f: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    """A file, 1 MiB at a time (starlette runs each read on a worker thread); closed at its end, or when the client
    leaves and the generator is closed."""
    with f:
        while chunk := f.read(size):
            yield chunk


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, batches: Batches) -> dict:
    return batches.delete(tenant(request), file_id)


class CreateBatchRequest(BaseModel):
    input_file_id: str = Field(max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field("24h", max_length=16)
    metadata: dict[str, str] | None = None


CreateBody = Annotated[CreateBatchRequest, parsed(CreateBatchRequest, get_batches)]


@router.post("/v1/batches", openapi_extra=body_schema(CreateBatchRequest))
async def create_batch(request: Request, batches: Batches, body: CreateBody) -> dict:
    return await batches_call(batches.create, tenant(request), body.input_file_id, body.endpoint,
                              body.completion_window, body.metadata)


@router.get("/v1/batches")
async def list_batches(request: Request, batches: Batches, after: str | None = None, limit: Limit = 20) -> dict:
    return batches.batches(tenant(request), after, limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, batches: Batches) -> dict:
    return batches.batch(tenant(request), batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, batches: Batches) -> dict:
    return batches.cancel(tenant(request), batch_id)


async def batches_call(fn, *args: Any):
    """Reading and checking a file of up to BATCH_MAX_FILE_BYTES takes a while, and SQLite waits on its lock and
    on fsyncs: in a thread, not on the loop."""
    return await asyncio.to_thread(fn, *args)

