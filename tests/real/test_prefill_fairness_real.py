"""A short request's first token never waits for a long prompt's whole prefill, on the real model over HTTP.

Before the prefill budget was shared, a 3-token request sent 0.5 s after a 7,188-token prompt got its first token
after 193.6 s on SmolLM2 (0.34 s alone): the oldest prefilling request took every step's whole budget."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from conftest import ThreadServer

pytestmark = [pytest.mark.real_model, pytest.mark.server, pytest.mark.alone]


def test_a_short_request_behind_a_7000_token_prompt_gets_its_first_token_within_2_s(smollm_fp32):
    with ThreadServer(create_app(Settings(model="smollm2-135m-instruct"), lm=smollm_fp32)) as server:
        long_text = " ".join(f"word{i % 97}" for i in range(2450))  # ~7,000 tokens on SmolLM2's tokenizer
        long_len = len(smollm_fp32.tokenizer(long_text)["input_ids"])
        assert 6500 < long_len < 7600
        engine = server.state.engine

        async def both() -> tuple[float, str, dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                seen: dict = {}

                async def long_request() -> None:
                    body = {"model": "smollm2-135m-instruct", "prompt": long_text, "max_tokens": 1, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        seen["status"] = response.status_code
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                seen.setdefault("first", line)

                long_task = asyncio.create_task(long_request())
                await asyncio.sleep(0.5)  # the long prompt is admitted and prefilling
                start = time.perf_counter()
                short = {"model": "smollm2-135m-instruct", "prompt": "Hi there", "max_tokens": 4, "stream": True}
                async with client.stream("POST", "/v1/completions", json=short) as response:
                    first = await anext(line async for line in response.aiter_lines() if line.startswith("data: {"))
                    ttft = time.perf_counter() - start
                seen["long_prefilling"] = engine.in_flight >= 1 and "first" not in seen
                # The long prompt's remaining ~50 s of prefill prove nothing more (a long prompt's own answer is
                # checked in tests/fast/test_engine.py): its client leaves, which cancels it.
                long_task.cancel()
                await asyncio.gather(long_task, return_exceptions=True)
                return ttft, first, seen

        ttft, first, seen = asyncio.run(both())
        assert '"text"' in first
        assert ttft < 2.0, f"the short request's first token came {ttft:.2f} s after it was sent"
        assert seen["status"] == 200 and seen["long_prefilling"]  # it went first, not after the long prefill
        deadline = time.monotonic() + 10
        while engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.in_flight == 0  # the cancelled prefill is freed
