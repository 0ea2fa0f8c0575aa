"""``jaxserve predictor train|eval``: fit the length probe on a trace's text
segments, and report its held-out accuracy next to a constant baseline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxserve.cli import check_output_dir
from jaxserve.predictor.checkpoint import ProbeCheckpointError, load_probe, save_probe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="predictor_command", required=True)
    t = subs.add_parser("train", help="train a probe on the served model's hidden states")
    t.add_argument("--model", required=True, help="'demo', a checkpoint directory, or a built-in model name")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--trace", default=None, help="trace with text-form segments (default: bundled multi-API)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--epochs", type=int, default=200)
    t.add_argument("--probe-hidden", type=int, default=256, help="MLP width (0: a linear probe)")
    t.add_argument("--max-context", type=int, default=None,
                   help="use only requests whose whole context is at most this many tokens (a CPU budget; "
                        "eval uses the same subset)")
    e = subs.add_parser("eval", help="held-out Acc-5 / Acc-15 / MAE of a probe and of a constant baseline")
    e.add_argument("--model", required=True)
    e.add_argument("--checkpoint", required=True, help="directory written by `predictor train`")
    e.add_argument("--trace", default=None)
    e.add_argument("--json", default=None, help="also write the numbers to this JSON file")


def _report(probe, base) -> str:
    return "\n".join([
        f"{'':10s} {'Acc-5':>7s} {'Acc-15':>7s} {'MAE bins':>9s} {'MAE tokens':>11s}",
        f"{'probe':10s} {probe.acc5:7.1%} {probe.acc15:7.1%} {probe.mae_bins:9.2f} {probe.mae_tokens:11.1f}",
        f"{'constant':10s} {base.acc5:7.1%} {base.acc15:7.1%} {base.mae_bins:9.2f} {base.mae_tokens:11.1f}",
        f"(n_test = {probe.n} segments)"])


def _check(args: argparse.Namespace) -> None:
    """Option values with a range, and an ``--out`` that can be a directory (``ValueError``)."""
    if args.predictor_command != "train":
        return
    for flag, value, least in (("--epochs", args.epochs, 1), ("--probe-hidden", args.probe_hidden, 0),
                               ("--max-context", args.max_context, 1)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    check_output_dir("--out", Path(args.out).expanduser())


def main(args: argparse.Namespace) -> int:
    from jaxserve.cli import refuse
    try:
        _check(args)
    except ValueError as e:
        return refuse("predictor", e)
    # Heavy imports here so `jaxserve --help` stays fast.
    from jaxserve.predictor.dataset import TraceDataError
    from jaxserve.predictor.features import load_served_model
    from jaxserve.predictor.train import cached_examples, evaluate, fit_probe, split_examples
    try:
        served = load_served_model(args.model)
        if args.predictor_command == "train":
            out = Path(args.out).expanduser()
            ex, requests = cached_examples(served, args.trace, out, max_context=args.max_context, split=True)
            split = split_examples(ex, requests, args.seed)
            params, summary = fit_probe(split["train"], split["val"], hidden=args.probe_hidden,
                                        epochs=args.epochs, seed=args.seed)
            summary["max_context"] = args.max_context
            probe, base = evaluate(params, split["val"], summary["train_mean_tokens"])
            summary["val"] = probe.as_dict()
            path = save_probe(out, params, served.identity, args.probe_hidden, summary)
            print(f"probe for {served.identity.name} written to {path} "
                  f"({summary['n_train']} train / {summary['n_val']} val segments, best epoch "
                  f"{summary['best_epoch']})")
            print("validation:\n" + _report(probe, base))
            return 0
        ckpt = Path(args.checkpoint).expanduser()
        params, meta = load_probe(ckpt, served.identity)
        ex, requests = cached_examples(served, args.trace, ckpt, max_context=meta["summary"].get("max_context"),
                                       split=True)
        # (the test split does not depend on the seed: a probe without one, as `bench --length-probe random`
        # writes, is evaluated on the same held-out requests)
        test = split_examples(ex, requests, int(meta["summary"].get("seed", 0)))["test"]
        probe, base = evaluate(params, test, float(meta["summary"]["train_mean_tokens"]))
        print("held-out test:\n" + _report(probe, base))
        if args.json:
            Path(args.json).write_text(json.dumps({
                "acc5": probe.acc5, "acc15": probe.acc15, "mae_bins": probe.mae_bins,
                "baseline_mae_bins": base.mae_bins, "mae_tokens": probe.mae_tokens,
                "baseline_acc5": base.acc5, "baseline_acc15": base.acc15,
                "baseline_mae_tokens": base.mae_tokens, "n_test": probe.n, "model": served.identity.name},
                indent=2) + "\n")
        return 0
    except (ProbeCheckpointError, TraceDataError, FileNotFoundError, ValueError) as e:
        return refuse("predictor", e)
    except OSError as e:   # (reading the model, writing the checkpoint or --json)
        return refuse("predictor", f"{e.filename}: {e.strerror or e}" if e.filename else e)
