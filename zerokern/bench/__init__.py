"""Benchmarks: `common` (timing, cache flushing, result files) and `kernels` (adam_step_,
grad_stats_ against the torch paths and the machine's measured ceilings, DESIGN §6).

Run with `python benchmarks/bench_kernels.py --help` (or `zerokern bench`).
"""
