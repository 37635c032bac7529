"""What `bench soak` prints: its report (benchmarks/soak.py) as a few lines a person reads, one per check."""

from __future__ import annotations

END_GRACE_S = 60.0  # how long the soak lets requests running at its deadline finish (benchmarks/soak.py)
KV_GAUGE = "simple_serve_kv_cache_used_bytes"


def print_report(r: dict) -> None:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    rss = r["rss"]
    print(f"\nbench soak: {r['config']['model']} @ {r['config']['url']}  {r['load_s'] / 60:.1f} min, "
          f"concurrency {r['config']['concurrency']}, bursts of {r['config']['burst']}")
    print(f"  requests by kind      {r['requests']}")
    print(f"  HTTP statuses         {r['statuses']}")
    print(f"  streams               {r['streams_ok']} ended with [DONE], {r['streams_clean_error']} with a clean "
          f"error; {r['cancelled_mid_stream']} cancelled mid-stream, {r['client_timeouts']} client timeouts, "
          f"{r['cut_at_end']} workers' requests cut {END_GRACE_S:.0f} s after the end")
    print(f"  429s                  {r['rejected_429']} in {r['bursts']} bursts    "
          f"completion tokens {r['completion_tokens']}")
    pct = lambda g: "-" if g is None else f"{g:+.2%}"  # noqa: E731
    print(f"  RSS                   {mib(rss['start_bytes'])} at {rss['from_s']:.0f} s -> {mib(rss['end_bytes'])} "
          f"at the end ({pct(rss.get('raw_growth'))}; peak {mib(rss.get('peak_bytes'))})")
    print(f"  prefix cache          {mib(rss.get('prefix_cache_start_bytes'))} -> "
          f"{mib(rss.get('prefix_cache_end_bytes'))}; RSS less the prefix cache {pct(rss['growth'])}")
    kv = "" if r["kv_gauge_exposed"] else f" ({KV_GAUGE} not exposed by this server: not checked)"
    settled = "never" if r["settled_s"] is None else f"{r['settled_s']:.1f} s"
    print(f"  after the load        {r['idle_gauges_after']}, settled in {settled}{kv}")
    h = r["health"]
    if h["probes"]:
        print(f"  /health               {h['probes']} probes: p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, "
              f"max {h['max_ms']:.1f} ms")
    for name, ok in r["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for failure in r["failures"][:10]:
        print(f"  failure: {failure}")
