"""``jaxserve replay``: replay a workload trace under several scheduling
policies and request rates, on the simulator (``--simulate``, the default) or
the real engine (``--model``), and write ``results.json``, ``summary.md`` and
PNG plots to ``--out``.

Examples::

    jaxserve replay --simulate --rates 2,5,8 --duration 1800 --out out/
    jaxserve replay diverse_oneapi_merged_exp_uniform.json --policies fcfs,infercept,lamps \\
        --rate 6 --num-requests 2000 --arrival gamma --cv 1.5 --predictor noisy:0.3
    jaxserve replay --model demo --policies fcfs,infercept --rate 2 --num-requests 32
    jaxserve replay --mode resend --sim-cache both --policies infercept,lamps --rate 4 --duration 600
    jaxserve replay --mode resend --sim-cache on --replicas 8 --routers round_robin,least_loaded,affinity \
        --rate 32 --duration 600
    jaxserve replay mooncake.jsonl --arrival trace --profile llama3-8b-h100 --sim-cache on --policies fcfs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxserve.config import EngineConfig

DEFAULT_PROFILE = "gptj-6b-a100-40g"
DEFAULT_RATES = "2,5,8"
DEFAULT_DURATION_S = 1800.0       # the original InferCept driver's window
DEFAULT_MODEL_REQUESTS = 32       # --model without --num-requests/--duration
DEFAULT_CV = 1.5                  # gamma arrivals: coefficient of variation of the gaps
MIN_CV, MAX_CV = 0.01, 100.0      # --cv's range
ROUTERS_DEFAULT = "round_robin"
# Engine settings a replay sets per run (--policies), takes from --profile, or never uses.
REPLAY_EXCLUDES = ("policy", "cost_profile", "tool_call_parser", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("Examples::", 1)[1]
    parser.add_argument("trace", nargs="?", default=None,
                        help="InferCept/MARS JSON or JSONL trace, or a Mooncake-format JSONL trace "
                             "(timestamp, input_length, output_length, hash_ids; docs/replay.md) "
                             "(default: the bundled multi-API merged_exp_uniform.json; the bundled "
                             "single-API one is diverse_oneapi_merged_exp_uniform.json)")
    ex = parser.add_argument_group("executor")
    ex.add_argument("--simulate", action="store_true",
                    help="run on the simulator (the default when --model is not given)")
    ex.add_argument("--profile", default=None,
                    help=f"cost profile: built-in name or JSON from `jaxserve profile` "
                         f"(simulator default: {DEFAULT_PROFILE}; with --model it sets the SLO step time)")
    ex.add_argument("--model", default=None, help="run on the real engine: a checkpoint directory, a .gguf file, or a built-in name (demo, smollm2-135m)")
    ex.add_argument("--token-scale", type=float, default=1.0,
                    help="multiply every token count of the trace by this (e.g. 0.05 to fit a small "
                         "model's context; applies to --simulate too so both can be compared)")
    ex.add_argument("--api-time-scale", type=float, default=1.0,
                    help="multiply every API duration by this (shorter wall-clock runs with --model)")
    wl = parser.add_argument_group("workload")
    wl.add_argument("--policies", default=None,
                    help="comma-separated policies (default: all registered)")
    wl.add_argument("--rates", default=None, help=f"comma-separated request rates, req/s (default {DEFAULT_RATES})")
    wl.add_argument("--rate", type=float, default=None, help="a single request rate, req/s")
    wl.add_argument("--duration", type=float, default=None,
                    help=f"arrival window in seconds (default {DEFAULT_DURATION_S:g} when simulating)")
    wl.add_argument("--num-requests", type=int, default=None, help="a fixed number of arrivals instead of a window")
    wl.add_argument("--arrival", choices=("poisson", "gamma", "trace"), default="poisson",
                    help="arrival process; 'trace' uses the JSONL arrival_time fields")
    wl.add_argument("--cv", type=float, default=None,
                    help=f"gamma arrivals: coefficient of variation of the gaps (default {DEFAULT_CV:g})")
    wl.add_argument("--seed", type=int, default=0, help="workload and predictor seed")
    wl.add_argument("--batch-share", type=float, default=0.0,
                    help="fraction of arrivals that are batch work, in priority class 1 (interactive ones stay "
                         "in 0; results report each class's latencies)")
    wl.add_argument("--tokenizer", default=None,
                    help="tokenizer (HF name or dir) for text-form traces (default: 4 characters per token)")
    EngineConfig.add_cli_arguments(parser, exclude=REPLAY_EXCLUDES)
    sch = parser.add_argument_group("simulator")
    sch.add_argument("--step-model", choices=("linear", "buckets", "auto"), default="auto",
                     help="simulated step time: linear T_fwd(n), or the profile's measured time of the padded "
                          "token bucket (auto, the default: buckets when the profile has them)")
    sch.add_argument("--step-time-scale", type=float, default=1.0,
                     help="multiply every simulated step time (what-if a faster device; sensitivity checks)")
    sch.add_argument("--prefill-decode-split", action="store_true",
                     help="simulate Prophet's disaggregation: prefill and decode chunks on two executors in "
                          "parallel, each finished prefill shipping its KV over the host link")
    sch.add_argument("--mode", choices=("requests", "resend"), default="requests",
                     help="requests: each trace request pauses for its API calls (default); resend: each "
                          "segment arrives as a new request carrying the whole conversation, the next one "
                          "when it has finished plus the API time (as an OpenAI client drives an agent); "
                          "simulator and --model")
    sch.add_argument("--sim-cache", choices=("off", "on", "both"), default=None,
                     help="the prefix cache of the runs: off, on, or both side by side (default: off on the "
                          "simulator; with --model, the engine's --enable-prefix-caching)")
    sch.add_argument("--replicas", type=int, default=1,
                     help="simulated replicas behind a router (re-send mode)")
    sch.add_argument("--routers", default=ROUTERS_DEFAULT,
                     help="comma-separated routers for --replicas: round_robin, least_loaded, affinity")
    sch.add_argument("--horizon", type=float, default=None,
                     help="stop the simulation at this time (s); unfinished requests count as not completed")
    out = parser.add_argument_group("metrics and output")
    out.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, seconds")
    out.add_argument("--slo-norm-latency", type=float, default=None,
                     help="goodput SLO on normalized latency, s/token (default: --slo-step-factor x step time)")
    out.add_argument("--slo-step-factor", type=float, default=10.0,
                     help="normalized-latency SLO as a multiple of the reference step time")
    out.add_argument("--count", choices=("in-window", "all"), default="in-window",
                     help="which requests the latency statistics cover: those completed inside the arrival "
                          "window, as the papers count (default), or all of them (the run drains the queue); "
                          "results.json reports both under by_count")
    out.add_argument("--out", default="replay-out", help="output directory")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def _parse_rates(args: argparse.Namespace) -> list[float | None]:
    if args.arrival == "trace":
        if args.rate is not None or args.rates is not None:
            raise ValueError("--arrival trace takes its times from the trace; drop --rate/--rates")
        return [None]
    if args.rate is not None and args.rates is not None:
        raise ValueError("give --rate or --rates, not both")
    if args.rate is not None:
        return [args.rate]
    text = args.rates if args.rates is not None else DEFAULT_RATES
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates must be finite numbers > 0, got {text!r}")
    return rates


def _parse_policies(text: str | None) -> list[str]:
    from scheduler import available_policies

    known = available_policies()
    if text is None:
        return known
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise ValueError(f"unknown policy {', '.join(unknown) or text!r}; available: {', '.join(known)}")
    return names


def _tokenizer(name: str | None):
    """``--tokenizer``'s encode function, loaded at its first use (a token-form trace never
    loads it); ``ValueError`` when it cannot be loaded."""
    if name is None:
        return None
    loaded = []

    def encode(text: str) -> list[int]:
        if not loaded:
            from transformers import AutoTokenizer
            try:
                loaded.append(AutoTokenizer.from_pretrained(name))
            except Exception as e:  # noqa: BLE001 - a name that is no tokenizer here: the user's input
                raise ValueError(f"--tokenizer {name!r} cannot be loaded ({type(e).__name__}: {str(e)[:200]})") \
                    from None
        return loaded[0].encode(text, add_special_tokens=False)
    return encode


def _check_numbers(args: argparse.Namespace) -> None:
    """Options that are numbers with a range, and ``--cv`` only with gamma arrivals."""
    if args.cv is not None and args.arrival != "gamma":
        raise ValueError("--cv sets the gaps of --arrival gamma; add --arrival gamma or drop --cv")
    positive = {"--rate": args.rate, "--duration": args.duration, "--horizon": args.horizon,
                "--token-scale": args.token_scale, "--slo-ttft": args.slo_ttft,
                "--slo-norm-latency": args.slo_norm_latency, "--slo-step-factor": args.slo_step_factor,
                "--step-time-scale": args.step_time_scale}
    for flag, value in positive.items():
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")
    if not 0 <= args.api_time_scale < float("inf"):
        raise ValueError(f"--api-time-scale must be a finite number >= 0, got {args.api_time_scale!r}")
    if args.cv is not None and not MIN_CV <= args.cv <= MAX_CV:   # (gamma's shape is 1/cv²: past these, 0 or inf)
        raise ValueError(f"--cv must be between {MIN_CV:g} and {MAX_CV:g}, got {args.cv!r}")
    if not 0 <= args.batch_share <= 1:
        raise ValueError(f"--batch-share must be a fraction between 0 and 1, got {args.batch_share!r}")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")


def _check_combinations(args: argparse.Namespace) -> None:
    """Settings that would be silently ignored where they are given."""
    if args.model is not None:
        simulator_only = {"--horizon": args.horizon is not None, "--prefill-decode-split": args.prefill_decode_split,
                          "--step-time-scale": args.step_time_scale != 1.0, "--step-model": args.step_model != "auto",
                          "--replicas": args.replicas != 1}
        given = [flag for flag, on in simulator_only.items() if on]
        if given:
            them = "it" if len(given) == 1 else "them"
            raise ValueError(f"{', '.join(given)}: only the simulator reads {them}, not the real engine; "
                             f"drop {them} or --model")
    if args.mode == "resend" and args.prefill_decode_split:
        raise ValueError("--prefill-decode-split is simulated in requests mode only; drop it or --mode resend")
    if args.routers != ROUTERS_DEFAULT and args.replicas == 1:
        raise ValueError("--routers chooses among --replicas; with one replica there is nothing to route")


def _check_out(out: Path) -> None:
    """``--out`` is a directory that can be made and written, checked before the runs."""
    from jaxserve.cli import check_output_dir
    from jaxserve.replay.experiment import OUTPUT_FILES

    check_output_dir("--out", out)
    for name in OUTPUT_FILES:
        if (out / name).is_dir():
            raise ValueError(f"--out {out}: {out / name} is a directory; the replay writes a file there")


def build_config(args: argparse.Namespace):
    """``(EngineConfig, ReplayConfig)`` from parsed arguments (``ValueError`` on bad combinations)."""
    from jaxserve.replay.experiment import ReplayConfig
    from jaxserve.replay.simulate import SimConfig
    from scheduler import Handling

    _check_numbers(args)
    _check_combinations(args)
    rates = _parse_rates(args)
    policies = _parse_policies(args.policies)
    engine = EngineConfig.from_cli(args, model=args.model or "demo", seed=args.seed)   # validates every setting
    if args.num_requests is not None and args.duration is not None and args.arrival != "trace":
        raise ValueError("give --num-requests or --duration, not both")
    duration, num = args.duration, args.num_requests
    if args.arrival != "trace" and duration is None and num is None:
        if args.model is not None:
            num = DEFAULT_MODEL_REQUESTS
        else:
            duration = DEFAULT_DURATION_S
    cache = args.sim_cache or ("off" if args.model is None or not engine.enable_prefix_caching else "on")
    caches = {"off": (False,), "on": (True,), "both": (False, True)}[cache]
    routers = tuple(r.strip() for r in args.routers.split(",") if r.strip())
    sim = SimConfig(page_size=engine.page_size, num_device_pages=engine.num_pages,
                    num_host_pages=engine.num_host_pages, max_num_batched_tokens=engine.max_num_batched_tokens,
                    max_num_seqs=engine.max_num_seqs, swap_budget_tokens=engine.swap_budget_tokens,
                    handling=Handling.parse(engine.handling), check_invariants=engine.check_invariants,
                    step_model=args.step_model, step_time_scale=args.step_time_scale,
                    prefill_decode_split=args.prefill_decode_split, priority_aging_s=engine.priority_aging_s)
    return engine, ReplayConfig(policies=policies, rates=rates, arrival=args.arrival,
                                cv=DEFAULT_CV if args.cv is None else args.cv, num_requests=num,
                        duration_s=duration, seed=args.seed, predictor=engine.predictor,
                        handling=sim.handling, sim=sim, horizon_s=args.horizon, slo_ttft_s=args.slo_ttft,
                        slo_norm_latency_s=args.slo_norm_latency, slo_step_factor=args.slo_step_factor,
                        count=args.count, mode=args.mode, prefix_cache=caches, replicas=args.replicas,
                        routers=routers, batch_share=args.batch_share)


def main(args: argparse.Namespace) -> int:
    from jaxserve.cli import refuse
    from jaxserve.replay.experiment import simulate, write_outputs
    from jaxserve.replay.trace import load_trace, resolve_trace_path, scale_entries
    from jaxserve.profiles import load_profile

    if args.model is not None and args.simulate:
        return refuse("replay", "give --simulate or --model, not both")
    try:
        _check_out(Path(args.out))
        engine, config = build_config(args)
        trace_path = resolve_trace_path(args.trace)
        entries = load_trace(trace_path, _tokenizer(args.tokenizer))
        if args.model is None and config.predictor.startswith("learned"):   # probe predictions, cached
            from jaxserve.predictor.sim_cache import learned_entries
            entries = learned_entries(trace_path, config.predictor)
        if args.token_scale != 1.0 or args.api_time_scale != 1.0:
            entries = scale_entries(entries, args.token_scale, args.api_time_scale)
        profile = args.profile or (DEFAULT_PROFILE if args.model is None else None)
        cost = load_profile(profile) if profile else None
    except (ValueError, FileNotFoundError) as e:
        return refuse("replay", e)
    start = time.perf_counter()
    title = f"{trace_path.name}, " + (f"simulated on {cost.name}" if args.model is None else f"model {args.model}")
    try:
        if args.model is None:
            runs = simulate(entries, cost, config, progress=not args.quiet)
        else:
            from jaxserve.replay.engine_replay import EngineOptions, run_engine
            runs = run_engine(entries, config, EngineOptions(engine), cost=cost, progress=not args.quiet)
    except ValueError as e:
        return refuse("replay", e)
    try:
        paths = write_outputs(runs, args.out, title=title, plots=not args.no_plots)
    except OSError as e:
        return refuse("replay", f"--out {args.out}: cannot write the results ({e.strerror or e})")
    wall = time.perf_counter() - start
    print(paths["summary"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {wall:.1f} s")
    return 0


if __name__ == "__main__":   # python -m jaxserve.replay.cli ... (same as `jaxserve replay ...`)
    _parser = argparse.ArgumentParser(prog="jaxserve replay", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
