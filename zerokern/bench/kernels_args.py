"""The command line of the kernel microbenchmarks (`zerokern bench --kernels`, kernels.main).

Split from kernels.py to keep each module under ~400 lines."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Sequence

from .kernel_cases import DTYPES, PROVIDERS
from .kernel_rules import RULES
from .kernel_rules_ns import DEFAULT_SHAPES


def _int_list(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None
    if not vals or any(not 1 <= x <= 40 for x in vals):
        raise argparse.ArgumentTypeError(f"log2 sizes must be in 1..40, got {text!r}")
    return vals


def _choice_list(choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        vals = [x for x in text.replace(",", " ").split() if x]
        bad = [x for x in vals if x not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return vals

    return parse


def _shape_list(text: str) -> List[tuple]:
    out = []
    for x in text.replace(",", " ").split():
        try:
            a, b = (int(v) for v in x.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected shapes like 512x2048, got {x!r}") \
                from None
        if not (1 <= a <= 1 << 16 and 1 <= b <= 1 << 16):
            raise argparse.ArgumentTypeError(f"shape sides must be in 1..65536, got {x!r}")
        out.append((a, b))
    if not out:
        raise argparse.ArgumentTypeError(f"expected shapes like 512x2048, got {text!r}")
    return out


def _flatten(groups) -> List | None:
    return None if groups is None else list(dict.fromkeys(x for g in groups for x in g))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_kernels",
        description="Time zerokern adam_step_ / grad_stats_ per backend against the torch "
                    "paths and the measured copy / read-modify-write ceilings (DESIGN §6).")
    p.add_argument("--sizes", type=_int_list, nargs="+", metavar="LOG2",
                   help="log2 element counts, e.g. 20 22 or 20,22 (default: CPU 20 22 24 26; "
                        "GPU 20 22 ... 30; --quick: 12 14)")
    p.add_argument("--providers", type=_choice_list(PROVIDERS), nargs="+", metavar="P",
                   help=f"subset of {', '.join(PROVIDERS)} (default: all that run on the "
                        "device; triton on CPU only if named, under TRITON_INTERPRET=1); the "
                        "rules' peers (lion-pytorch, bitsandbytes, ...) run unless only zk "
                        "backends are named")
    p.add_argument("--dtype-cases", type=_choice_list(tuple(DTYPES)), nargs="+", metavar="C",
                   help="grad dtype cases: bf16/fp16 (16-bit grad + param_out), fp32 "
                        "(no param_out) (default: bf16 fp32)")
    p.add_argument("--reps", type=int, help="timed repetitions (default: CPU 15, GPU 50; "
                                            "--quick: 2)")
    p.add_argument("--warmup", type=int, help="untimed repetitions first (default 2; --quick: 1)")
    p.add_argument("--rules", type=_choice_list(("adamw",) + RULES), nargs="+", metavar="R",
                   help="optimizer rules to time: adamw (adam_step_, grad_stats_), lion, "
                        "adamw8bit, muon (the element-wise pieces; Newton-Schulz per matrix "
                        "with --ns-shapes) (default: all)")
    p.add_argument("--ns-shapes", type=_shape_list, nargs="+", metavar="AxB",
                   help="matrix shapes of the Newton-Schulz and one-matrix Muon step rows "
                        f"(default: {' '.join(f'{a}x{b}' for a, b in DEFAULT_SHAPES)}; "
                        "--quick: 64x64 64x256)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                   help="results folder (default: benchmarks/results)")
    p.add_argument("--stem", help="result file name without extension (default: "
                                   "kernels-<cpu|cuda>, with -quick under --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and 2 reps, for smoke tests (writes kernels-<kind>-quick.*)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda if available, else cpu")
    return p
