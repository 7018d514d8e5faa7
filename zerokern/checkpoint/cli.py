"""`zerokern consolidate DIR OUT`: a checkpoint directory to one full state-dict file.

Wired into `zerokern/cli.py` as a subcommand through `add_arguments(parser)` and `run(args)`;
also runs as `python -m zerokern.checkpoint consolidate DIR OUT`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import List, Optional

HELP = "checkpoint directory -> one full state dict file (.pt or .safetensors)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="checkpoint directory written by zerokern.checkpoint.save")
    parser.add_argument("out", help="output file; .safetensors selects that format")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of params and floating buffers (default fp32, from the "
                             "fp32 masters)")
    parser.add_argument("--format", dest="fmt", choices=["pt", "safetensors"], default=None,
                        help="default: from OUT's suffix (.safetensors), else pt")


def run(args: argparse.Namespace) -> int:
    """Consolidate; 0 on success, 1 with a one-line error on stderr otherwise."""
    from . import CheckpointError, consolidate

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = consolidate(args.dir, args.out, dtype=args.dtype, fmt=args.fmt)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"zerokern consolidate: error: {e}", file=sys.stderr)
        return 1
    for w in caught:  # e.g. frozen params a save with exclude_frozen_parameters left out
        print(f"zerokern consolidate: warning: {w.message}", file=sys.stderr)
    size = os.path.getsize(out)
    dt = time.perf_counter() - t0
    print(f"wrote {out} ({size / 1e6:.3g} MB, {args.dtype}) in {dt:.2f} s")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zerokern.checkpoint")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_arguments(sub.add_parser("consolidate", help=HELP))
    args = p.parse_args(argv)
    return run(args)
