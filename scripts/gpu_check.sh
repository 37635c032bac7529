#!/usr/bin/env bash
# `make gpu-check`: on a CUDA machine, in under 10 minutes: the GPU-marked tests, `bench generate`, `bench step`
# (the eager decode step against DECODE_STEP=compiled, captured as CUDA graphs, at batch 1 and 8, each against the
# HBM floor), then `bench serve` (1 and 8 streams) on a server running the compiled step, with the share of its
# decode steps that replayed a graph. Without CUDA it stops at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-0.5b-instruct}
PORT=${PORT:-8765}
OUT=${OUT:-bench-results/gpu-check-$(date +%Y%m%d-%H%M%S)}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))." >&2
    echo "gpu-check: needs an NVIDIA GPU, its driver, and a CUDA build of torch; nothing was run." >&2
    exit 2
fi
mkdir -p "$OUT"
"$PY" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"gpu-check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")'

echo "== 1/4 GPU-marked tests (limit 180 s)"
timeout 180 "$PY" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -5

echo "== 2/4 bench generate (limit 120 s)"
timeout 120 "$PY" -m benchmarks generate --model "$MODEL" --device cuda --repeats 2 --kv-streams 0 \
    --out "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" | grep -v "Loading weights"

echo "== 3/4 bench step: eager against compiled + CUDA graphs, batch 1 and 8, against the HBM floor (limit 150 s)"
timeout 150 "$PY" -m benchmarks step --models "$MODEL" --device cuda --dtypes bfloat16 --batches 1,8 \
    --out "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "Loading weights"

echo "== 4/4 bench serve on DECODE_STEP=compiled: 1 stream, then 8 (limit 200 s)"
DECODE_STEP=compiled \
    "$PY" -m app serve --model "$MODEL" --device cuda --port "$PORT" --served-model-name "$MODEL" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    "$PY" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/ready').status != 200)" \
        > /dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "gpu-check: the server exited; see $OUT/server.log" >&2; exit 1; }
    sleep 1
done
for streams in 1 8; do
    timeout 100 "$PY" -m benchmarks serve --url "http://127.0.0.1:$PORT" --model "$MODEL" --stream \
        --concurrency "$streams" --requests $((streams * 4)) --prompt-len 128 --max-tokens 128 \
        --out "$OUT/serve-$streams.json" > "$OUT/serve-$streams.log" 2>&1
done

"$PY" -c "import urllib.request; open('$OUT/metrics.txt', 'wb').write(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read())"

echo "== summary ($OUT)"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
g = json.loads((out / "generate.json").read_text())
print(f"bench generate ({g['dtype']}): our loop {g['ours_tokens_per_s']:.1f} tok/s, generate() "
      f"{g['hf_generate_tokens_per_s']:.1f} tok/s, floor {g['floor_tokens_per_s']:.0f} tok/s "
      f"({g['ours_vs_floor']:.0%} of it), TTFT {g['ours_ttft_s'] * 1e3:.0f} ms")
for streams in (1, 8):
    s = json.loads((out / f"serve-{streams}.json").read_text())
    ttft = s["ttft_s"]["p50"]
    print(f"bench serve, {streams} stream(s): {s['output_tokens_per_s']['aggregate']:.1f} tok/s aggregate, "
          f"TTFT p50 {ttft * 1e3 if ttft else float('nan'):.0f} ms, errors {s['errors']['count']}")
for row in json.loads((out / "step.json").read_text())["results"]:
    print(f"bench step, batch {row['batch']}: eager {row['eager_tokens_per_s']:.0f} tok/s, compiled + graphs "
          f"{row['compiled_tokens_per_s']:.0f} tok/s; HBM floor {row['floor_tokens_per_s']:.0f} tok/s "
          f"({row['compiled_tokens_per_s'] / row['floor_tokens_per_s']:.0%} of it); "
          f"{row.get('graph_replay_share', 0):.0%} of its steps replayed from graphs")
from app.metrics import parse_samples
steps = {k: v for k, v in parse_samples((out / "metrics.txt").read_text()).items()
         if k.startswith("simple_serve_decode_steps_total")}
graph = sum(v for k, v in steps.items() if 'path="graph"' in k)
print(f"server: {graph:.0f} of {sum(steps.values()):.0f} decode-only steps replayed from CUDA graphs "
      f"({graph / max(1, sum(steps.values())):.0%}); the rest ran eagerly (more rows than the largest bucket, "
      "a full pool)")
PY
