"""Offload benchmark: `python benchmarks/bench_offload.py [--quick]`
(= `zerokern bench --offload`)."""

import sys

from zerokern.bench.offload import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
