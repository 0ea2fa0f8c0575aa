"""Instructions a command executes, this checkout against a git revision, under
valgrind's callgrind: a deterministic measure of CPU work for comparing two
versions of the simulator or the scheduler on a machine whose speed drifts
(wall and CPU seconds here move 5-45 % between runs of the same code; the
instruction count of the same code and input does not move).

    python3 tools/count_instructions.py --baseline 56435ed -- tools/sim_replicas.py --replicas 8 --duration 120 --routers affinity

The command (a Python script and its arguments, relative to the repository
root) runs once in this checkout and once in a temporary worktree of
``--baseline``, both at once (one process each) under
``valgrind --tool=callgrind``, about 40x slower than natively. Prints each
total, the interpreter's start-up and imports (``--startup``, counted the same
way and subtracted), and the ratio of what is left. Instructions are not time
(cache misses and branch mispredictions are not counted), but for pure Python
code the interpreter's instruction count follows its work closely. Needs
``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _callgrind(command: list[str], cwd: Path, out_dir: Path, tag: str) -> subprocess.Popen:
    """Start ``command`` (a Python script and its arguments) under callgrind in ``cwd``."""
    return subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir / tag}.out",
                             sys.executable, *command], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _instructions(process: subprocess.Popen, tag: str) -> int:
    """Wait for ``process``; its instruction count (exits with its output if it failed)."""
    output, _ = process.communicate()
    found = _COLLECTED.search(output)
    if process.returncode not in (0, 1) or found is None:   # (sim_replicas exits 1 when a run misses its goal)
        sys.exit(f"{tag}: the command failed (exit {process.returncode}):\n{output[-3000:]}")
    return int(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare with")
    ap.add_argument("--startup", default="-c import jaxserve.replay.cluster, jaxserve.profiles",
                    help="Python arguments whose count is subtracted from both (start-up and imports)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] (relative to the repository root)")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to count after --")
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="count-instructions-") as tmp:
        tmp_path = Path(tmp)
        base = tmp_path / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.baseline],
                       check=True)
        try:
            startup = args.startup.split(maxsplit=1)
            running = {"this": _callgrind(command, REPO, tmp_path, "this"),
                       args.baseline: _callgrind(command, base, tmp_path, "base")}
            counts = {tag: _instructions(p, tag) for tag, p in running.items()}
            fixed = _instructions(_callgrind(startup, REPO, tmp_path, "startup"), "startup")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    print(f"command: {' '.join(command)}")
    print(f"start-up and imports ({args.startup}): {fixed:,} instructions")
    for tag, n in counts.items():
        print(f"{tag:>14}: {n:,} instructions, {n - fixed:,} without start-up")
    this, baseline = counts["this"] - fixed, counts[args.baseline] - fixed
    print(f"this / {args.baseline}: {this / baseline:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
