"""Load test for ``jaxserve serve``: N concurrent streaming clients for M seconds.

Loopback only (127.0.0.1 / localhost) and bounded (at most 256 clients, 600 s).
Each client sends streaming chat or completion requests back to back; a
fraction of streams is dropped mid-way on purpose (client disconnects must
free their KV pages). Prints request rate, token rate, TTFT and inter-token
latency p50/p99, errors (must be 0) and KV pages still in use once the server
is idle again (leaked pages, must be 0); exits 1 if either is not 0.

    python tools/load_test.py --spawn demo --clients 8 --duration 30
    python tools/load_test.py --url http://127.0.0.1:8000 --clients 16 --duration 60 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from server.metrics import parse_metrics_text  # noqa: E402
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = ["Hello, world! How are you today?", "The quick brown fox jumps over the lazy dog.",
           "Once upon a time there was a small model", "What is 2 + 3 * (4 - 1)?",
           "def add(a, b):\n    return a + b\n", "The engine decodes a request, hits an API call"]


class Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.completed = 0
        self.dropped = 0
        self.tokens = 0
        self.errors: list[str] = []


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, args, model: str, rng: random.Random, stats: Stats) -> None:
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(max(1, args.max_tokens // 2), args.max_tokens)
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "stream": True, "ignore_eos": True}
    if rng.random() < 0.5:
        path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {**common, "prompt": prompt}
    drop_after = rng.randint(1, max_tokens) if rng.random() < args.drop_fraction else None
    start = time.perf_counter()
    last = None
    chunks = 0
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            stats.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                stats.errors.append(f"error event: {event['error'].get('message')}")
                return
            choice = event["choices"][0] if event.get("choices") else {}
            has_token = bool(choice.get("text") or choice.get("delta", {}).get("content"))
            if not has_token:
                continue
            now = time.perf_counter()
            if last is None:
                stats.ttft.append(now - start)
            else:
                stats.itl.append(now - last)
            last = now
            chunks += 1
            stats.tokens += 1
            if drop_after is not None and chunks >= drop_after:
                stats.dropped += 1
                return                           # leaving the block closes the connection mid-stream
        if not done:
            stats.errors.append("stream ended without [DONE]")
            return
    stats.completed += 1


async def client_loop(client, args, model, seed, deadline, stats) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < deadline:
        try:
            await one_request(client, args, model, rng, stats)
        except httpx.HTTPError as e:
            stats.errors.append(f"{type(e).__name__}: {e}")




async def run(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=120, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        stats = Stats()
        start = time.perf_counter()
        deadline = start + args.duration
        await asyncio.gather(*[client_loop(client, args, model, args.seed + i, deadline, stats)
                               for i in range(args.clients)])
        elapsed = time.perf_counter() - start
        # Leaked pages: once nothing runs, waits or is parked, no device page may be in use.
        settle = time.perf_counter() + 10
        while True:
            m = parse_metrics_text((await client.get("/metrics")).text)
            busy = m["jaxserve:num_requests_running"] + m["jaxserve:num_requests_waiting"] \
                + m.get("jaxserve:num_parked_tool_contexts", 0)
            if busy == 0 or time.perf_counter() > settle:
                break
            await asyncio.sleep(0.1)
        leaked = int(m['jaxserve:kv_pages_used{memory="device"}'] + m['jaxserve:kv_pages_used{memory="host"}'])
    total = stats.completed + stats.dropped
    print(f"clients={args.clients} duration={elapsed:.1f}s max_tokens<={args.max_tokens} "
          f"drop_fraction={args.drop_fraction}")
    print(f"requests: {total} ({stats.completed} completed, {stats.dropped} dropped mid-stream on purpose), "
          f"{total / elapsed:.2f} req/s, {stats.tokens / elapsed:.1f} streamed tokens/s")
    print(f"TTFT   p50 {percentile(stats.ttft, 50) * 1e3:.1f} ms   p99 {percentile(stats.ttft, 99) * 1e3:.1f} ms")
    print(f"ITL    p50 {percentile(stats.itl, 50) * 1e3:.1f} ms   p99 {percentile(stats.itl, 99) * 1e3:.1f} ms")
    print(f"errors: {len(stats.errors)}")
    for e in stats.errors[:5]:
        print(f"  {e}")
    print(f"KV pages leaked: {leaked}")
    return 0 if not stats.errors and leaked == 0 else 1


def spawn(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server did not become ready in 180 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (loopback only)")
    p.add_argument("--spawn", metavar="MODEL", help="start 'jaxserve serve MODEL' on a free loopback port instead")
    p.add_argument("--server-args", default="--max-num-batched-tokens 64 --num-pages 256 --max-model-len 512",
                   help="extra flags for the spawned server")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=64, help="per request (each asks for 50-100%% of it)")
    p.add_argument("--drop-fraction", type=float, default=0.1, help="streams the client drops mid-way")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 256 or not 0 < args.duration <= 600:
        p.error("--clients must be in [1, 256] and --duration in (0, 600]")
    proc = None
    if args.spawn:
        proc, args.url = spawn(args.spawn, args.server_args.split())
    elif urlparse(args.url).hostname not in LOOPBACK:
        p.error("--url must point at 127.0.0.1 / localhost")
    try:
        return asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)


if __name__ == "__main__":
    sys.exit(main())
