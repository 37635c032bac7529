"""A short request's first token never waits for a long prompt's whole prefill, on the real model over HTTP.

Before the prefill budget was shared, a 3-token request sent 0.5 s after a 7,188-token prompt got its first token
after 193.6 s on SmolLM2 (0.34 s alone): the oldest prefilling request took every step's whole budget."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.config import Settings
from app.main import create_app
from conftest import ThreadServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]


def test_a_short_request_behind_a_7000_token_prompt_gets_its_first_token_within_2_s(smollm_fp32):
    with ThreadServer(create_app(Settings(model="smollm2-135m-instruct"), lm=smollm_fp32)) as server:
        long_text = " ".join(f"word{i % 97}" for i in range(2450))  # ~7,000 tokens on SmolLM2's tokenizer
        long_len = len(smollm_fp32.tokenizer(long_text)["input_ids"])
        assert 6500 < long_len < 7600
        body = {"model": "smollm2-135m-instruct", "prompt": long_text, "max_tokens": 1}
        long_done = {}
        long_request = threading.Thread(
            target=lambda: long_done.update(r=httpx.post(server.url + "/v1/completions", json=body, timeout=600)))
        long_request.start()
        time.sleep(0.5)  # the long prompt is admitted and prefilling
        start = time.perf_counter()
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": "smollm2-135m-instruct", "prompt": "Hi there", "max_tokens": 4, "stream": True}) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: {"))
            ttft = time.perf_counter() - start
            long_still_prefilling = long_request.is_alive()
        assert '"text"' in first and response.status_code == 200
        assert ttft < 2.0, f"the short request's first token came {ttft:.2f} s after it was sent"
        assert long_still_prefilling  # it went first, not after the long prompt's prefill
        long_request.join(timeout=600)
        assert long_done["r"].status_code == 200
