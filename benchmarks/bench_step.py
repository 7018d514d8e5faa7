"""Whole training-step benchmark: zerokern stages 0-2 vs DDP + AdamW(fused) vs
ZeroRedundancyOptimizer, on gloo ranks (CPU).

    python benchmarks/bench_step.py                   # 23M-param GPT, 2 ranks
    python benchmarks/bench_step.py --quick           # seconds; for smoke tests
    python benchmarks/bench_step.py --help

Results go to benchmarks/results/step-<model>-n<ranks>-<precision>.{json,md}.
"""

import sys
from pathlib import Path

# Run from a checkout without installing: put the repo root first on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerokern.bench.step import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
