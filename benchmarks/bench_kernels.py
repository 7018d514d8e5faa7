"""Kernel microbenchmarks: adam_step_ and grad_stats_ per backend vs torch, with ceilings.

    python benchmarks/bench_kernels.py                # full default run for this machine
    python benchmarks/bench_kernels.py --quick        # seconds; for smoke tests
    python benchmarks/bench_kernels.py --help

Results go to benchmarks/results/kernels-<device-kind>.{json,md,png}.
"""

import sys
from pathlib import Path

# Run from a checkout without installing: put the repo root first on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerokern.bench.kernels import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
