"""PNG plots of a replay (matplotlib, Agg backend): latency and TTFT against
rate, the E2E latency CDF, and KV-cache occupancy over time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class RunCurves:
    """What the plots need from one (policy, rate) run."""

    policy: str
    rate: float | None
    row: dict                                   # the results.json row
    e2e_s: list[float] = field(default_factory=list)
    occupancy_time_s: list[float] = field(default_factory=list)
    device_frac: list[float] = field(default_factory=list)   # used / total device pages
    host_frac: list[float] = field(default_factory=list)     # used / total host pages


def _policies(runs: Sequence[RunCurves]) -> list[str]:
    seen: dict[str, None] = {}
    for r in runs:
        seen.setdefault(r.policy, None)
    return list(seen)


def _rate_label(rate: float | None) -> str:
    return "trace" if rate is None else f"{rate:g} req/s"


def plot_vs_rate(runs: Sequence[RunCurves], path: Path) -> None:
    """Mean/p99 E2E latency, mean/p99 TTFT, throughput and goodput against rate."""
    panels = [("mean_e2e_s", "mean E2E latency (s)"), ("p99_e2e_s", "p99 E2E latency (s)"),
              ("mean_ttft_s", "mean TTFT (s)"), ("p99_ttft_s", "p99 TTFT (s)"),
              ("throughput_req_s", "throughput (req/s)"), ("goodput_req_s", "goodput (req/s)")]
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    for ax, (key, label) in zip(axes.flat, panels):
        for policy in _policies(runs):
            pts = sorted((r.rate if r.rate is not None else 0.0, r.row.get(key))
                         for r in runs if r.policy == policy and r.row.get(key) is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=policy)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if key in ("mean_ttft_s", "p99_ttft_s", "mean_e2e_s", "p99_e2e_s") and ax.lines:
            ax.set_yscale("log")   # latencies span orders of magnitude across policies
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Latency, TTFT and throughput vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_e2e_cdf(runs: Sequence[RunCurves], path: Path) -> None:
    """CDF of E2E latency per policy, one panel per rate."""
    rates = sorted({r.rate for r in runs}, key=lambda x: (x is None, x or 0.0))
    ncols = min(3, len(rates))
    nrows = -(-len(rates) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(rates):]:
        ax.set_visible(False)
    for ax, rate in zip(axes.flat, rates):
        for run in runs:
            if run.rate != rate or not run.e2e_s:
                continue
            xs = np.sort(np.asarray(run.e2e_s))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=run.policy)
        ax.set_xscale("log")
        ax.set_xlabel("E2E latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(_rate_label(rate))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_occupancy(runs: Sequence[RunCurves], path: Path) -> None:
    """Device and host KV pool use over time per policy, at the highest rate."""
    rates = [r.rate for r in runs if r.rate is not None]
    top = max(rates) if rates else None
    chosen = [r for r in runs if r.rate == top and r.occupancy_time_s]
    fig, (dev, host) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for run in chosen:
        dev.plot(run.occupancy_time_s, np.asarray(run.device_frac) * 100, label=run.policy, lw=1)
        host.plot(run.occupancy_time_s, np.asarray(run.host_frac) * 100, label=run.policy, lw=1)
    dev.set_ylabel("device KV pages used (%)")
    host.set_ylabel("host KV pages used (%)")
    host.set_xlabel("time (s)")
    dev.set_title(f"KV cache occupancy at {_rate_label(top)}")
    for ax in (dev, host):
        ax.grid(True, alpha=0.3)
    dev.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOT_FILES = ("latency_vs_rate.png", "e2e_cdf.png", "kv_occupancy.png")


def write_plots(runs: Sequence[RunCurves], out_dir: Path) -> list[Path]:
    """All plots into ``out_dir``; returns the files written."""
    out_dir = Path(out_dir)
    paths = [out_dir / name for name in PLOT_FILES]
    plot_vs_rate(runs, paths[0])
    plot_e2e_cdf(runs, paths[1])
    plot_occupancy(runs, paths[2])
    return paths
