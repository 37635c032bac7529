"""Run requests through a real Engine (no HTTP) and collect what each caller saw: for tests that compare engine
settings (prefix cache, speculation) on the same requests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from app.core.engine.engine import Engine
from app.core.sampling import SamplingParams


@dataclass
class Seen:
    tokens: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int


def run_engine(lm, requests: list[tuple], together: bool = False, **engine_kwargs) -> tuple[list[Seen], Engine]:
    """One engine per call; each request (prompt ids, SamplingParams[, its images' ImagePrompt]). `together`:
    submit all at once (they share steps); else one after another."""
    engine = Engine(lm, **engine_kwargs)

    async def one(ids, params, images=None) -> Seen:
        handle = engine.submit(ids, params, images=images)
        events = [event async for event in handle]
        return Seen([e.token_id for e in events], "".join(e.text for e in events), events[-1].finish_reason,
                    handle.cached_tokens)

    async def main() -> list[Seen]:
        engine.start()
        await asyncio.to_thread(engine.loaded.wait)
        if engine.load_error is not None:  # nobody would serve the requests: fail now rather than hang
            raise engine.load_error
        try:
            if together:
                return list(await asyncio.gather(*(one(*request) for request in requests)))
            return [await one(*request) for request in requests]
        finally:
            engine.stop()

    return asyncio.run(main()), engine
