"""`GET /health/generate`: a liveness probe that sees the engine, not only the event loop.

`/health` answers from the event loop, so it stays green while the worker thread is stuck in a forward pass and
every request hangs. This probe answers 200 only with proof that the engine makes progress, within
HEALTH_GENERATE_TIMEOUT_S (the bound):
- busy (requests queued or running): its steps are the proof. 200 while the step now running began, or the last
  one ended, within the bound; no generation is added, so the probe never queues behind a burst and answers at once.
- idle: a step ended within the bound, or a one-token greedy generation completes now within it (concurrent probes
  share one generation). That generation is not traffic: it stays out of the request metrics (TTFT, tokens,
  finish reasons), so an idle server's dashboards show no requests.
- 503 otherwise, and once the engine has died. While the model loads there is no engine to prove yet: 200 with
  status "loading" (a failed load exits the process; /ready gates traffic meanwhile).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from app.errors import ServeError
from app.core.sampling import SamplingParams


class GenerateProbe:
    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self._probing: asyncio.Task | None = None  # the one-token generation probes now share

    async def check(self, state) -> tuple[int, dict[str, Any]]:
        if error := state.engine_error:
            return 503, {"status": "dead", "error": error}
        engine = state.engine
        if not state.ready or engine is None:
            return 200, {"status": "loading"}
        now = time.monotonic()
        in_step = engine.step_started_at > engine.step_ended_at
        since = now - (engine.step_started_at if in_step else engine.step_ended_at)
        if since <= self.bound_s:
            return 200, {"status": "ok", "step_age_s": round(since, 3)}
        if in_step or engine.in_flight:
            return 503, {"status": "stalled", "step_age_s": round(since, 3),
                         "error": f"the engine has completed no step for {since:.1f} s with requests in flight"}
        if state.draining:
            return 200, {"status": "draining"}  # no new work may start; the worker is alive
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._generate_one(state))
        try:
            await asyncio.wait_for(asyncio.shield(self._probing), self.bound_s)
        except asyncio.TimeoutError:
            return 503, {"status": "stalled", "error": f"a one-token generation took over {self.bound_s:g} s"}
        except ServeError as err:
            return 503, {"status": "failed", "error": err.message}
        return 200, {"status": "ok", "generated": True}

    async def _generate_one(self, state) -> None:
        if state.kind == "embedding":  # an embedding model's proof: one pass over a one-word input
            await state.engine.embed([state.probe_prompt])
            return
        handle = state.engine.submit(state.probe_prompt, SamplingParams(max_tokens=1, do_sample=False),
                                     "health-probe", deadline=time.perf_counter() + self.bound_s, traffic=False)
        try:
            async for _ in handle:
                pass
        finally:
            handle.cancel(client_left=False)  # a no-op once finished
