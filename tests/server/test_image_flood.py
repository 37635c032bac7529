"""Four clients sending 2 MB images stall no probe: a live server on a tiny random LLaVA loaded from its checkpoint
directory (tests/vision_models.py); 4 clients at once, each sending chat completions one after another, every one
carrying an 820x820 PNG of random noise (2,018,753 bytes: noise does not compress; 2,691,897 bytes of body as a
base64 data URL, under MAX_VISION_REQUEST_BYTES), while `/health` is probed every 20 ms from a process of its own.

Every answer is a 200: a request's body is parsed, and its image base64-decoded, decoded by Pillow, resized by the
processor and run through the vision tower, on a prepare worker (app/api.py, app/openai/serving.py,
app/prepare.py), each step one pending job; 4 clients hold at most 4 of MAX_PREPARING's 16, so none is refused
(no 429). `/health`'s p99 over the probes in flight during the flood stays under 200 ms: 25-46 ms here (2 shared
cores, 20 requests answered in 1.0-1.2 s), p50 10-14 ms.

What the bound catches: a request's image costs ~25 ms of CPU here (base64 7 ms, Pillow's decode and the digest
12 ms, the processor 6 ms, the tiny vision tower 1 ms), so with all of it moved onto the event loop p99 was 81 ms
and p50 40 ms: under the bound. It catches a stall of the loop several requests long (a lock, a synchronous fetch,
a real vision tower on the loop), not one request's image work at this size.

The machine is shared, so one quiet round is enough: up to three rounds, the answers 200 in every one, and
/health's p99 under 200 ms in one. The bodies are encoded once and go out from plain sockets: the client's
json.dumps of 2.7 MB and httpx's per-request work would compete with the server for the same two cores.
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from conftest import serve_process
from test_body_flood import Probe

pytestmark = [pytest.mark.server, pytest.mark.alone]
CHAT = "/v1/chat/completions"
CLIENTS, REQUESTS, ROUNDS = 4, 5, 3
SIDE = 820  # 820 x 820 x 3 = 2,017,200 bytes of noise


def noise_png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(SIDE, SIDE, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=1)  # noise: any level gives ~2 MB
    return out.getvalue()


def body(png: bytes, text: str) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return json.dumps({"model": "tiny-llava", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": text}]}]}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vision_models import build, save_checkpoint

    folder = tmp_path_factory.mktemp("image-flood")
    save_checkpoint(*build("llava"), folder / "model")
    # one token a step (no n-gram drafts), torch on one thread, fp32 as saved: nothing to convert or prepack
    env = {"SERVED_MODEL_NAME": "tiny-llava", "SPECULATIVE": "off", "OMP_NUM_THREADS": "1"}
    with serve_process(folder / "model", folder / "serve.log", "--dtype", "float32", "--no-prepack", env=env) as url:
        yield url


def post(port: int, payload: bytes) -> tuple[int, dict]:
    """One chat completion from a plain socket: the status and the JSON answer."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(head + payload)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n\r\n")
    return int(status.split(b" ", 2)[1]), json.loads(rest)


def flood(port: int, bodies: list[bytes]) -> dict:
    """CLIENTS clients at once, each sending its REQUESTS bodies one after another."""
    def client(mine: list[bytes]) -> list[tuple[int, dict]]:
        return [post(port, b) for b in mine]

    started = time.time()
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = [a for mine in pool.map(client, [bodies[i::CLIENTS] for i in range(CLIENTS)]) for a in mine]
    return {"answers": answers, "started": started, "ended": time.time()}


def measured(probe: Probe, started: float, ended: float) -> dict:
    """/health's p50 and p99 over the probes in flight at any time between `started` and `ended`."""
    rows = [line.split() for line in probe.out.read_text().splitlines()]
    during = sorted(float(s) for _, t, s in rows if float(t) <= ended and float(t) + float(s) >= started)
    return {"p50": during[len(during) // 2], "p99": during[int(0.99 * (len(during) - 1))], "probes": len(during)}


def test_4_clients_sending_2_mb_images_stall_no_probe(server, tmp_path):
    t0 = time.time()
    pngs = [noise_png(seed) for seed in range(CLIENTS)]
    assert all(2_000_000 < len(p) < 2_100_000 for p in pngs)
    bodies = [body(pngs[i % CLIENTS], f"what is in picture {i}?") for i in range(CLIENTS * REQUESTS)]
    assert all(2_600_000 < len(b) < 32 * 2**20 for b in bodies)  # MAX_VISION_REQUEST_BYTES
    port = int(server.rsplit(":", 1)[1])
    status, warm = post(port, bodies[0])  # imports, the first vision pass
    assert status == 200, warm
    probe = Probe(server, tmp_path)
    time.sleep(1)  # its interpreter has started
    rounds = []
    try:
        for _ in range(ROUNDS):
            r = {**flood(port, bodies), "load": os.getloadavg()[0]}
            time.sleep(0.2)  # the probes in flight at its end are answered
            rounds.append(r | measured(probe, r["started"], r["ended"]))
            if rounds[-1]["p99"] < 0.2 or any(a[0] != 200 for a in r["answers"]):
                break  # a quiet round, or one that fails anyway
    finally:
        probe.finish()
    report = []
    for r in rounds:
        statuses = [a[0] for a in r["answers"]]
        counts = ", ".join(f"{statuses.count(s)} x {s}" for s in sorted(set(statuses)))
        report.append(f"{CLIENTS} clients x {REQUESTS} requests of {len(bodies[0]):,} B answered {counts} in "
                      f"{r['ended'] - r['started']:.2f} s; /health p50 {r['p50'] * 1000:.0f} ms, "
                      f"p99 {r['p99'] * 1000:.0f} ms over {r['probes']} probes (load {r['load']:.1f})")
    print("\n" + "\n".join(report) + f"\nwall {time.time() - t0:.1f} s, images included")
    for r in rounds:
        assert [a[0] for a in r["answers"]] == [200] * len(bodies), r["answers"]
        assert all(a[1]["usage"]["completion_tokens"] == 4 for a in r["answers"])
        assert r["probes"] >= min(5, int((r["ended"] - r["started"]) / 0.05)), report
    assert rounds[-1]["p99"] < 0.2, report
