"""Replicas on Ray Serve: 1 vs 2 replicas, disaggregated vs colocated, affinity vs round robin.

One run, one workload, one local Ray cluster; the applications run one after
another (each alone on the machine) on the same port:

- ``one``: ``--data-parallel-size 1`` (the front and one replica);
- ``two``: ``--data-parallel-size 2``, affinity routing (colocated);
- ``two-rr``: ``--data-parallel-size 2 --replica-router round_robin``;
- ``pd``: ``--prefill-replicas 1 --decode-replicas 1`` (disaggregated).

Workload: ``--conversations`` agent conversations run concurrently, each
``--turns`` turns in sequence (a turn = the whole conversation so far + a
new user message, streamed, greedy, ``--max-tokens`` tokens, EOS ignored);
each conversation has its own system prompt. Printed per application:
requests/s, TTFT and ITL p50/p99 (client clock, streamed chunks), and the
affinity hit rate: follow-up turns whose
``usage.prompt_tokens_details.cached_tokens`` covers the previous turn's
prompt (all but its last partial page), i.e. that found their
conversation's KV; and the ratios against the baselines of the same run.
On CPU these figures are about overhead and routing, not speed.

    python3 tools/bench_replicas.py --conversations 8 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

APPS = {
    "one": ["--data-parallel-size", "1"],
    "two": ["--data-parallel-size", "2"],
    "two-rr": ["--data-parallel-size", "2", "--replica-router", "round_robin"],
    "pd": ["--prefill-replicas", "1", "--decode-replicas", "1"],
}
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-batched-tokens", "128", "--max-num-seqs", "32",
               "--policy", "fcfs"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, text, usage, replica = [], [], None, None
    body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        replica = r.headers.get("x-jaxserve-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
                    text.append(choice["delta"]["content"])
    return {"start": start, "stamps": stamps, "text": "".join(text), "usage": usage, "replica": replica}


async def conversation(client: httpx.AsyncClient, url: str, index: int, turns: int, max_tokens: int,
                       page_size: int) -> list[dict]:
    system = (f"Agent {index}: you are a travel agent. Quote prices in euros, name the city and the dates of every "
              f"option, keep answers short and never invent a booking reference for customer {index * 7919}.")
    messages = [{"role": "system", "content": system}]
    results, previous_prompt = [], None
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: what about option {t + 1} for trip {index}?"})
        out = await one_turn(client, url, list(messages), max_tokens)
        usage = out["usage"] or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out["follow_up"] = previous_prompt is not None
        out["hit"] = previous_prompt is not None and cached >= (previous_prompt // page_size) * page_size
        previous_prompt = usage.get("prompt_tokens", 0)
        messages.append({"role": "assistant", "content": out["text"]})
        results.append(out)
    return results


def app_cpu_seconds(app: str) -> float:
    """User + system CPU seconds so far of the app's Ray Serve replicas (front, engines) and the HTTP proxy."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if f"ServeReplica:{app}:" in cmd or "ProxyActor" in cmd:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    return total


def counters(url: str) -> dict[str, float]:
    from server.metrics import parse_metrics_text
    return parse_metrics_text(httpx.get(url + "/metrics", timeout=60).text)


async def workload(url: str, app: str, conversations: int, turns: int, max_tokens: int, page_size: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        # The same workload once untimed, other conversations (compiles this app's step shapes; the
        # persistent compilation cache would otherwise favour the apps that run later).
        await asyncio.gather(*(conversation(client, url, 1000 + i, turns, max_tokens, page_size)
                               for i in range(conversations)))
        before = await asyncio.to_thread(counters, url)
        cpu_before = app_cpu_seconds(app)
        start = time.perf_counter()
        runs = await asyncio.gather(*(conversation(client, url, i, turns, max_tokens, page_size)
                                      for i in range(conversations)))
        wall = time.perf_counter() - start
        cpu = app_cpu_seconds(app) - cpu_before
        after = await asyncio.to_thread(counters, url)
    turns_out = [t for run in runs for t in run]
    ttft = [t["stamps"][0] - t["start"] for t in turns_out if t["stamps"]]
    itl = [b - a for t in turns_out for a, b in zip(t["stamps"], t["stamps"][1:])]
    follow = [t for t in turns_out if t["follow_up"]]
    served = {}
    for t in turns_out:
        served[t["replica"]] = served.get(t["replica"], 0) + 1
    return {"requests": len(turns_out), "wall_s": wall, "req_per_s": len(turns_out) / wall,
            "cpu_s": cpu, "cpu_ms_per_request": 1e3 * cpu / len(turns_out),
            "transfer": transfer_figures(before, after),
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "affinity_hit_rate": sum(t["hit"] for t in follow) / max(1, len(follow)), "served_by": served}


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The KV moved during the timed pass (disaggregated apps), from the decode replicas' counters."""
    def delta(prefix: str, label: str = "") -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix) and label in k)

    prompts = delta("jaxserve:remote_prefills_total")
    if not prompts:
        return None
    seconds = {stage: delta("jaxserve:kv_transfer_seconds_total", f'stage="{stage}"')
               for stage in ("prefill", "export", "transfer", "import")}
    moved = delta("jaxserve:kv_transfer_bytes_total")
    move_s = seconds["export"] + seconds["transfer"] + seconds["import"]
    return {"prompts": prompts, "pages": delta("jaxserve:kv_transfer_pages_total"), "mbytes": moved / 1e6,
            "seconds": seconds, "move_ms_per_prompt": 1e3 * move_s / prompts,
            "move_mb_per_s": moved / 1e6 / move_s if move_s else float("nan"),
            "fallbacks": delta("jaxserve:remote_prefill_fallbacks_total")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--apps", default=",".join(APPS), help="which of " + ", ".join(APPS))
    parser.add_argument("--num-pages", type=int, default=512,
                        help="KV pages per replica (default: room for every conversation of both passes, so the hit "
                             "rate measures routing, not eviction)")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import ray
    from ray import serve

    from jaxserve.distributed import launch
    from server.cli import add_arguments

    serve_parser = argparse.ArgumentParser()
    add_arguments(serve_parser)
    launch.tolerate_busy_hosts()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": launch.REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"}})
    results = {}
    try:
        for name in args.apps.split(","):
            settings = vars(serve_parser.parse_args(["demo", "--port", str(args.port), "--log-level", "warning",
                                                     "--num-pages", str(args.num_pages), *ENGINE_ARGS,
                                                     *APPS[name]]))
            launch.start(settings, route_prefix=f"/{name}", name=name)
            url = f"http://127.0.0.1:{args.port}/{name}"
            results[name] = asyncio.run(workload(url, name, args.conversations, args.turns, args.max_tokens,
                                                 settings["page_size"]))
            print(name, json.dumps(results[name]), flush=True)
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()

    def ratio(a: str, b: str, key: str) -> str:
        if a in results and b in results:
            return f"{results[a][key] / results[b][key]:.2f}"
        return "n/a"

    print(f"\nconversations={args.conversations} turns={args.turns} max_tokens={args.max_tokens}")
    print(f"{'app':8} {'req/s':>7} {'CPU ms/req':>10} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
          f"{'hit rate':>9}  served by")
    for name, r in results.items():
        print(f"{name:8} {r['req_per_s']:7.2f} {r['cpu_ms_per_request']:10.0f} {r['ttft_p50_ms']:9.0f} "
              f"{r['ttft_p99_ms']:7.0f} {r['itl_p50_ms']:8.1f} {r['itl_p99_ms']:7.1f} "
              f"{100 * r['affinity_hit_rate']:8.0f}%  {r['served_by']}")
    print(f"throughput two/one = {ratio('two', 'one', 'req_per_s')}; pd/two (disaggregated/colocated) = "
          f"{ratio('pd', 'two', 'req_per_s')}; CPU per request two/one = {ratio('two', 'one', 'cpu_ms_per_request')},"
          f" pd/two = {ratio('pd', 'two', 'cpu_ms_per_request')}")
    if "two" in results and "two-rr" in results:
        print(f"affinity hit rate: affinity {100 * results['two']['affinity_hit_rate']:.0f}% vs round robin "
              f"{100 * results['two-rr']['affinity_hit_rate']:.0f}% (goal >= 95% vs ~50%)")
    if results.get("pd", {}).get("transfer"):
        t = results["pd"]["transfer"]
        stages = ", ".join(f"{k} {v:.2f}" for k, v in t["seconds"].items())
        print(f"pd KV moved in the timed pass: {t['prompts']:.0f} prompts, {t['pages']:.0f} pages, {t['mbytes']:.2f} MB "
              f"({t['fallbacks']:.0f} fallbacks); seconds by stage: {stages}; {t['move_ms_per_prompt']:.1f} ms/prompt "
              f"to move (export+transfer+import), {t['move_mb_per_s']:.1f} MB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
