"""Where a command's time goes, by function, from a sampling profile: self time
(the function itself) and inclusive time (it and what it calls), as shares of
the samples under a root function.

    py-spy record -r 250 -f raw -o /tmp/prof.txt -- python3 tools/sim_replicas.py --replicas 64 --duration 200 --routers affinity
    python3 tools/profile_self_time.py /tmp/prof.txt --root run_resend --top 25

``py-spy`` (``pip install py-spy``; not a dependency of the project) samples the
process from outside, so unlike ``cProfile`` it does not slow small functions
down more than large ones. Its raw format is one line per distinct stack,
``frame;frame;...;frame count``, each frame ``function (file:line)``.
"""

from __future__ import annotations

import argparse
from collections import Counter


def shares(lines, root: str | None) -> tuple[int, Counter, Counter]:
    """``(samples, self, inclusive)`` over the stacks that pass through ``root`` (all if None);
    counters keyed by ``function (file)``."""
    self_time, inclusive, total = Counter(), Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        names = [f"{f.split(' (')[0]} ({f.rpartition('(')[2].split(':')[0].rsplit('/', 1)[-1]})" for f in frames]
        if root is not None and not any(n.startswith(root + " ") for n in names):
            continue
        n = int(count)
        total += n
        self_time[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    return total, self_time, inclusive


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a py-spy raw profile (-f raw)")
    ap.add_argument("--root", default=None, help="count only stacks through this function (e.g. run_resend)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with open(args.profile) as f:
        total, self_time, inclusive = shares(f, args.root)
    if not total:
        raise SystemExit(f"no samples{f' under {args.root}' if args.root else ''} in {args.profile}")
    print(f"{total} samples{f' under {args.root}' if args.root else ''}")
    for title, counter in (("self", self_time), ("inclusive", inclusive)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{n / total:7.1%}  {name}")


if __name__ == "__main__":
    main()
