"""jaxserve vs transformers generate, same checkpoint, prompts and greedy settings.

    python tools/bench_engine.py                      # demo model, 64 prompts, CPU
    python tools/bench_engine.py --shape llama-1b --dtype bfloat16   # 1B-class shapes, random weights (GPU)
    python tools/bench_engine.py --shape llama-small --tensor-parallel-size 4 --host-devices 4 --skip-transformers
                                                      # tokens/s at TP 1, 2, 4 (here on 4 CPU host devices)

``--host-devices N`` forces N CPU host devices (XLA_FLAGS, set before JAX starts);
on GPUs or TPUs leave it out.
"""

import argparse
import os
import sys


def _force_host_devices(argv: list[str]) -> None:
    """Apply ``--host-devices N`` before anything imports JAX."""
    for i, arg in enumerate(argv):
        if arg.startswith("--host-devices"):
            n = arg.partition("=")[2] or argv[i + 1]
            os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"


if __name__ == "__main__":
    _force_host_devices(sys.argv[1:])
    from jaxserve.bench import add_arguments, main

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--host-devices", type=int, default=None, help="force this many CPU host devices")
    sys.exit(main(parser.parse_args()))
