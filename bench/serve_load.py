"""A bounded load test of `kiln serve`: N concurrent streaming clients on loopback, a fixed
number of requests, against the engine's own throughput offline with the same concurrency.

    .venv/bin/python bench/serve_load.py runs/demo-20261201-110757
    .venv/bin/python bench/serve_load.py MODEL --clients 8 --requests 64 --max-tokens 64

The server is a real `kiln serve MODEL --port 0` subprocess. Each client thread streams one
request at a time (SSE, `stream_options.include_usage`) until the fixed number of requests is
spent. Reported: requests/s, generated tokens/s, time to first token and the gap between
streamed tokens (p50/p99), failed requests, and the server's resident memory after a warm-up
and after the load. The offline figure runs the same requests through `Engine` in this process
(engine loop in a thread, the same number of client threads submitting and iterating handles,
no HTTP), so the ratio is what HTTP, JSON and SSE cost; one more row hands every request to
`engine.generate` at once. Offline and HTTP runs alternate for `--rounds` rounds, so load from
other processes hits both alike. The server's memory is read after every HTTP round: growth
that stops is the KV block pool's pages being written for the first time (the pool is
allocated empty; the bench prints its size) or glibc's per-thread malloc arenas keeping freed
memory (`--malloc-arena-max 2` caps them); growth that goes on would be a leak.

`--soak SECONDS` adds a long HTTP-only phase after the rounds (the clients keep streaming until
the time is spent). The server's RSS is sampled every `--sample-s` seconds from its start to
its end; the bench prints the series' start, max, end and the slope over its last third, and
`--plot` writes a PNG of RSS over time (requests done on a second axis):

    .venv/bin/python bench/serve_load.py MODEL --rounds 1 --soak 600 --plot rss.png --noisy

`--tracemalloc FRAMES` starts the server with KILN_SERVE_TRACEMALLOC=FRAMES and reads its
/debug/memory after the warm-up and at the end: the allocation sites and object types of the
server's Python heap that grew in between (the server runs slower: don't read speed from it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._load import add_noisy_flag, begin
from bench._rss import RssSampler, describe_trend, plot_rss, rss_mib, rss_trend
from kiln.io import write_json_atomic

PROMPTS = [
    "Once upon a time, there was a little dog named",
    "Lily and Tom went to the park. They saw",
    "One day, a small bird found a shiny",
    "The sun was warm and the sky was blue. A cat",
]


@dataclass
class Load:
    """What one load run measured."""

    wall_s: float = 0.0
    requests: int = 0
    failures: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive streamed tokens
    errors: list[str] = field(default_factory=list)

    def add(self, lock: threading.Lock, sent: float, stamps: list[float], tokens: int) -> None:
        """One finished request: sent at `sent`, text arriving at `stamps`, `tokens` in all."""
        with lock:
            self.requests += 1
            self.tokens += tokens
            self.ttft.append((stamps[0] if stamps else time.perf_counter()) - sent)
            self.gaps += [b - a for a, b in itertools.pairwise(stamps)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run_clients(clients: int, requests: int, one: callable) -> Load:  # type: ignore[valid-type]
    """`clients` threads call one(i, load) until `requests` calls are spent."""
    load, lock, counter = Load(), threading.Lock(), iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                one(i, load, lock)
            except Exception as exc:  # a failed request is counted, the load goes on
                with lock:
                    load.failures += 1
                    load.errors.append(repr(exc)[:200])

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load.wall_s = time.perf_counter() - start
    return load


def http_request(url: str, model: str, max_tokens: int, temperature: float):  # type: ignore[no-untyped-def]
    """One streaming client request against the server at `url`, recorded into a Load."""
    import httpx2 as httpx

    local = threading.local()

    def one(i: int, load: Load, lock: threading.Lock) -> None:
        http = getattr(local, "http", None) or httpx.Client(timeout=120)
        local.http = http
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": temperature, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        sent = time.perf_counter()
        stamps, used, done = [], None, False
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
        if not done or used is None:
            raise RuntimeError("stream ended without usage and [DONE]")
        load.add(lock, sent, stamps, used)

    return one


def engine_request(engine, max_tokens: int, temperature: float):  # type: ignore[no-untyped-def]
    """The same request straight on the engine (no HTTP), recorded into a Load."""
    from kiln.serve.engine import SamplingParams

    tok = engine.tokenizer

    def one(i: int, load: Load, lock: threading.Lock) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        sent = time.perf_counter()
        handle = engine.submit(tok.encode(PROMPTS[i % len(PROMPTS)]), params)
        stamps, count = [], 0
        for event in handle:
            count += 1
            if event.text:  # as the HTTP client sees it: tokens that released text
                stamps.append(time.perf_counter())
        load.add(lock, sent, stamps, count)

    return one


def engine_batch(engine, requests: int, max_tokens: int, temperature: float) -> Load:  # type: ignore[no-untyped-def]
    """Every request handed to engine.generate at once: the engine's best batched throughput."""
    from kiln.serve.engine import SamplingParams

    prompts = [engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(requests)]
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
              for i in range(requests)]  # fmt: skip
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    load = Load(wall_s=time.perf_counter() - start, requests=requests)
    load.tokens = sum(len(c.token_ids) for sample in done for c in sample)
    return load


def start_server(
    model: str, max_concurrent: int, arenas: int | None, tracemalloc_frames: int | None = None
) -> tuple[subprocess.Popen[str], str, str]:
    """`kiln serve MODEL --port 0` (glibc malloc arenas capped when asked); its process, base
    URL and model name."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    if arenas is not None:
        env["MALLOC_ARENA_MAX"] = str(arenas)
    if (
        tracemalloc_frames is not None
    ):  # the server's /debug/memory (kiln/serve/http/memory_probe.py)
        env["KILN_SERVE_TRACEMALLOC"] = str(tracemalloc_frames)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "serve", model, "--port", "0",
         "--max-concurrent", str(max_concurrent)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"model '([^']+)' at (http://127\.0\.0\.1:\d+)/", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, found.group(2), found.group(1)
    raise SystemExit(f"kiln serve did not start (exit {proc.wait()})")


def soak(args: argparse.Namespace, url: str, name: str, until: float, sampler: RssSampler,
         done: list[tuple[float, float]]) -> Load:  # fmt: skip
    """HTTP load in batches of 8 requests per client until the sampler's clock reaches `until`."""
    total = Load()
    one = http_request(url, name, args.max_tokens, args.temperature)
    while sampler.elapsed() < until:
        part = run_clients(args.clients, 8 * args.clients, one)
        total.wall_s += part.wall_s
        total.requests += part.requests
        total.failures += part.failures
        total.tokens += part.tokens
        total.ttft += part.ttft
        total.gaps += part.gaps
        total.errors += part.errors[: 3 - len(total.errors)]
        done.append((sampler.elapsed(), done[-1][1] + part.requests))
        print(f"  soak {sampler.elapsed():.0f}/{until:.0f} s: {done[-1][1]:.0f} requests, "
              f"server RSS {sampler.series[-1][1]:.0f} MiB", flush=True)  # fmt: skip
    return total


def memory_report(url: str) -> dict[str, object]:
    """The server's /debug/memory: what its Python heap grew by since the previous call."""
    import httpx2 as httpx

    return httpx.get(url + "/debug/memory", timeout=600).json()


def print_memory_report(report: dict[str, object], frames: int) -> None:
    """The heap's growth over the measured run: sites (innermost kiln frames) and types."""
    print(f"server Python heap (tracemalloc): {report['traced_mib']:.1f} MiB traced, "
          f"{report['tasks']} asyncio tasks pending; grown most since the warm-up:")  # fmt: skip
    for site in report["sites"][:8]:  # type: ignore[index]
        where = [f for f in site["traceback"] if "/kiln/" in f][-frames:] or site["traceback"][-1:]
        print(
            f"  {site['size_kib']:+8.1f} KiB {site['count']:+7d} blocks  {' <- '.join(where[::-1][:3])}"
        )
    types = ", ".join(f"{t['type']} {t['count']:+d}" for t in report["types"][:8])  # type: ignore[index]
    print(f"  live objects grown most: {types or 'none'}")


def summary(name: str, load: Load) -> dict[str, object]:
    """One table row's numbers."""
    return {
        "run": name, "requests": load.requests, "failed": load.failures,
        "req_per_s": load.requests / load.wall_s, "tok_per_s": load.tokens / load.wall_s,
        "ttft_p50_ms": 1e3 * percentile(load.ttft, 50), "ttft_p99_ms": 1e3 * percentile(load.ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(load.gaps, 50), "tpot_p99_ms": 1e3 * percentile(load.gaps, 99),
        "wall_s": load.wall_s,
    }  # fmt: skip


def main() -> None:
    """Parse the arguments, run the rounds, print the table."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="a model folder kiln loads (e.g. runs/demo-…)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=64, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--rounds", type=int, default=2, help="offline/HTTP pairs, alternating")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument(
        "--malloc-arena-max", type=int, default=None,
        help="MALLOC_ARENA_MAX for the server (glibc's per-thread arenas hold freed memory)",
    )  # fmt: skip
    p.add_argument(
        "--soak",
        type=float,
        default=0.0,
        help="then this many seconds more of HTTP load only (a leak check)",
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--plot", help="write a PNG of the server's RSS over time here")
    p.add_argument("--tracemalloc", type=int, metavar="FRAMES",
                   help="trace the server's Python allocations (FRAMES deep; slows it) and print "
                   "what grew between the warm-up and the end")  # fmt: skip
    add_noisy_flag(p)
    args = p.parse_args()
    measured = begin("bench/serve_load.py", args.noisy)

    import torch

    from kiln.loading import load_model
    from kiln.serve.engine import Engine
    from kiln.serve.engine.block_pool import block_bytes

    proc, url, name = start_server(
        args.model, args.clients, args.malloc_arena_max, args.tracemalloc
    )
    sampler = RssSampler(proc.pid, args.sample_s).start()
    done: list[tuple[float, float]] = [(0.0, 0)]  # (seconds, HTTP requests done) for the plot
    soaked = Load()
    try:
        loaded = load_model(args.model)
        engine = Engine.from_loaded(loaded)
        engine.start()
        print(f"model {loaded.source}; precision {loaded.precision.name}; torch threads "
              f"{torch.get_num_threads()}; {args.clients} clients x {args.requests} requests "
              f"of {args.max_tokens} tokens", flush=True)  # fmt: skip
        warm = http_request(url, name, args.max_tokens, args.temperature)
        run_clients(args.clients, args.clients, warm)  # warm-up: first-request costs, caches
        run_clients(
            args.clients, args.clients, engine_request(engine, args.max_tokens, args.temperature)
        )
        before = rss_mib(proc.pid)
        if args.tracemalloc:
            memory_report(url)  # the baseline: growth is read from here on
        rows, rss = [], []
        batched = engine_batch(engine, args.requests, args.max_tokens, args.temperature)
        rows.append(summary("engine.generate, all requests at once", batched))
        for r in range(args.rounds):
            offline = run_clients(args.clients, args.requests,
                                  engine_request(engine, args.max_tokens, args.temperature))  # fmt: skip
            rows.append(summary(f"engine offline (round {r + 1})", offline))
            http = run_clients(args.clients, args.requests,
                               http_request(url, name, args.max_tokens, args.temperature))  # fmt: skip
            rows.append(summary(f"HTTP kiln serve (round {r + 1})", http))
            for e in http.errors[:3]:
                print("  failure:", e)
            rss.append(rss_mib(proc.pid))
            done.append((sampler.elapsed(), done[-1][1] + http.requests))
        soaked = soak(args, url, name, sampler.elapsed() + args.soak, sampler, done)
        if soaked.requests:
            rows.append(summary(f"kiln serve soak ({args.soak:.0f} s)", soaked))
        after = rss_mib(proc.pid)
        heap = memory_report(url) if args.tracemalloc else None
        engine.stop()
    finally:
        series = sampler.stop()
        proc.terminate()
        code = proc.wait(timeout=60)

    cols = ["run", "requests", "failed", "req_per_s", "tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
            "tpot_p50_ms", "tpot_p99_ms", "wall_s"]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    off = statistics.mean(float(r["tok_per_s"]) for r in rows if "offline" in str(r["run"]))
    on = statistics.mean(float(r["tok_per_s"]) for r in rows if "HTTP" in str(r["run"]))
    print(f"HTTP / offline tokens/s: {on / off:.2f} (mean of {args.rounds} rounds each)")
    rounds = ", ".join(f"{m:.0f}" for m in rss)
    pool_mib = engine.pool.num_blocks * block_bytes(loaded.model.cfg, engine.pool.block_size,
                                                    engine.pool.k.dtype) / 2**20  # fmt: skip
    print(f"KV block pool: {engine.pool.num_blocks} blocks, {pool_mib:.0f} MiB (allocated empty: "
          "its pages join the RSS as blocks are first written)")  # fmt: skip
    print(f"server RSS: {before:.0f} MiB after warm-up; after each HTTP round: {rounds} MiB "
          f"({after - before:+.0f} MiB in all); server exit status on SIGTERM: {code}")  # fmt: skip
    trend = rss_trend(series)
    print(f"server {describe_trend(trend)}; {done[-1][1]:.0f} HTTP requests, "
          f"{soaked.failures + sum(int(r['failed']) for r in rows)} failed")  # fmt: skip
    if heap is not None:
        print_memory_report(heap, args.tracemalloc)
    if args.plot:
        title = f"kiln serve RSS: {args.clients} clients, {done[-1][1]:.0f} requests"
        print("plot:", plot_rss(series, Path(args.plot), title, done) or "matplotlib missing")
    print(measured.line())
    if args.json:
        doc = {"rows": rows, "rss_before_mib": before, "rss_after_rounds_mib": rss, "exit": code,
               "rss_series": series, "rss_trend": trend.__dict__, "requests_done": done}  # fmt: skip
        write_json_atomic(args.json, measured.stamp(doc))


if __name__ == "__main__":
    main()
