"""Where the time of a ``jax.profiler`` trace went: busy time and the costliest events of
every timeline, read with ``jax.profiler.ProfileData`` (no TensorBoard needed).

    python tools/step_time.py --shape llama-1b --steps 20 --trace /tmp/trace
    python tools/trace_summary.py /tmp/trace --steps 20 --json /tmp/trace.json

A trace holds planes (the host's threads, each device) and in each plane lines (a thread,
a GPU stream, XLA's op and module timelines), each a list of timed events. For every line
this prints its busy time (the union of its events' intervals, so nested host events count
once), its span (first start to last end) and the ``--top`` event names by summed duration
(inclusive: a host event's children count in it too). ``--steps`` divides every figure by
the number of timed steps. On a GPU, the compute stream's busy time per step against the
step's wall time says whether the device or the host is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def find_xplane(path: Path) -> Path:
    """``path`` itself if it is a file, else the newest ``*.xplane.pb`` under it."""
    if path.is_file():
        return path
    found = sorted(path.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no *.xplane.pb under {path}")
    return found[-1]


def busy_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_ns, end_ns)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(xplane: Path, top: int = 12, steps: int = 1) -> list[dict]:
    """One record per non-empty line: ``{"plane", "line", "events", "busy_ms", "span_ms",
    "top": [{"name", "count", "ms"}]}``; milliseconds divided by ``steps``."""
    from jax.profiler import ProfileData
    data = ProfileData.from_file(str(xplane))
    lines = []
    for plane in data.planes:
        for line in plane.lines:
            intervals, by_name, counts = [], defaultdict(float), defaultdict(int)
            for event in line.events:
                intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                by_name[event.name] += event.duration_ns
                counts[event.name] += 1
            if not intervals:
                continue
            ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
            lines.append({
                "plane": plane.name, "line": line.name, "events": len(intervals) / steps,
                "busy_ms": busy_ns(intervals) / 1e6 / steps,
                "span_ms": (max(e for _, e in intervals) - min(s for s, _ in intervals)) / 1e6 / steps,
                "top": [{"name": name, "count": counts[name] / steps, "ms": ns / 1e6 / steps} for name, ns in ranked]})
    return lines


def busiest_device_stream(lines: list[dict]) -> dict | None:
    """Of ``summarize``'s records, the device stream (a ``/device:`` plane's line named
    ``Stream #...``: kernels and copies, not XLA's module or op timelines, whose events
    span idle gaps) with the most busy time; None where the trace has none (CPU)."""
    streams = [rec for rec in lines if rec["plane"].startswith("/device:") and rec["line"].startswith("Stream")]
    return max(streams, key=lambda rec: rec["busy_ms"], default=None)


def render(lines: list[dict]) -> str:
    out = []
    for rec in lines:
        out.append(f"{rec['plane']} | {rec['line']}: {rec['events']:.1f} events, busy {rec['busy_ms']:.3f} ms, "
                   f"span {rec['span_ms']:.3f} ms")
        out += [f"    {t['ms']:9.3f} ms  x{t['count']:<7.1f} {t['name'][:100]}" for t in rec["top"]]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a jax.profiler trace directory or one .xplane.pb file")
    parser.add_argument("--top", type=int, default=12, help="event names listed per line")
    parser.add_argument("--steps", type=int, default=1, help="divide every figure by this many steps")
    parser.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = parser.parse_args(argv)
    lines = summarize(find_xplane(args.trace), top=args.top, steps=args.steps)
    print(render(lines))
    if args.json:
        args.json.write_text(json.dumps(lines, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
