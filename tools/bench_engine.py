"""jaxserve vs transformers generate, same checkpoint, prompts and greedy settings.

    python tools/bench_engine.py                      # demo model, 64 prompts, CPU
    python tools/bench_engine.py --shape llama-1b --dtype bfloat16   # 1B-class shapes, random weights (GPU)
"""

import argparse
import sys

from jaxserve.bench import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
