"""`zerokern` command line: train | bench | estimate | build | info | consolidate."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from typing import List, Optional


def _process_start() -> float:
    """time.perf_counter() at which this process started (Linux), else now.

    `import zerokern` already imported torch (~2-3 s) before main() runs; a wall time that
    leaves it out would flatter `zerokern train`.
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.perf_counter() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def _cpu_features() -> dict:
    """x86 SIMD features from /proc/cpuinfo, without building anything."""
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    names = ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c"]
    return {n: n in flags for n in names}


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
            nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        else:
            return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"error ({e})"
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return f"{m.group(1)} ({m.group(2)}) at {nvcc}" if m else out.strip()[-80:]


def cmd_info(_: argparse.Namespace) -> int:
    import torch

    from .kernels import backend_status
    from .kernels.build import cache_root
    from .platform.device import accelerator
    from .version import __version__

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    print(f"zerokern {__version__}")
    print(f"torch    {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"triton   {triton_v}")
    print(f"nvcc     {_nvcc_version()}")
    acc = accelerator()
    if acc.is_accelerator:
        for i in range(acc.device_count()):
            print(f"gpu {i}    {acc.name(i)}")
    else:
        print("gpu      none visible to torch")
    feats = _cpu_features()
    print("cpu      " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()))
    isa = ("avx512" if all(feats[k] for k in ("avx512f", "avx512bw", "avx512vl", "avx512dq",
                                              "fma", "f16c"))
           else "avx2" if all(feats[k] for k in ("avx2", "fma", "f16c")) else "scalar")
    try:  # the path really in use, if the op is built; else what the CPU supports
        from .kernels.dispatch import _prebuilt_or_cached

        if _prebuilt_or_cached("cpu"):
            from .kernels import load_op

            isa = load_op("cpu").selected_isa()
    except Exception:  # noqa: BLE001 - info must print whatever it can
        pass
    print(f"isa      {isa} (cpu kernel path)")
    print(f"op cache {cache_root()}")
    print("backends:")
    for name, (ok, why) in backend_status().items():
        print(f"  {name:<10} {'available' if ok else 'unavailable':<12} {why}")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from .kernels.build import BuildError, load_op
    from .platform.device import handle

    ops = args.ops or (["cpu", "cuda"] if handle("cuda").is_available() else ["cpu"])
    rc = 0
    for op in ops:
        try:
            load_op(op)
            print(f"{op}: ok")
        except BuildError as e:
            print(f"{op}: FAILED\n{e}", file=sys.stderr)
            rc = 1
    return rc


def cmd_bench(args: argparse.Namespace, rest: List[str]) -> int:
    """--kernels (the default), --step, --offload, --engine and/or --activations; the
    remaining flags go to each."""
    rc = 0
    if args.kernels or not (args.step or args.offload or args.engine or args.activations):
        from .bench import kernels

        rc |= kernels.main(rest)
    if args.step:
        from .bench import step

        rc |= step.main(rest)
    if args.offload:
        from .bench import offload

        rc |= offload.main(rest)
    if args.engine:
        from .bench import engine

        rc |= engine.main(rest)
    if args.activations:
        from .bench import activations

        rc |= activations.main(rest)
    return rc


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser, t0: float) -> int:
    from . import train

    try:
        cfg = train.from_args(args)  # (a ValueError names the flag: usage line, exit 2)
        from .train import launch

        if not launch.under_torchrun():
            launch.plan(cfg)  # --nproc / --device against the GPUs, before anything starts
        else:  # --mesh against torchrun's world, before the process group starts
            launch.check_mesh(cfg, int(os.environ["WORLD_SIZE"]))
            train.config.accumulation(cfg, int(os.environ["WORLD_SIZE"]))
    except ValueError as e:
        parser.error(str(e))
    return train.run(cfg, t0)


def cmd_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from zerokern.accounting import cli as estimate_cli

    try:
        return estimate_cli.main(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerokern", description=__doc__)
    sub = p.add_subparsers(dest="cmd", metavar="{train,bench,estimate,build,info,consolidate}")
    sub.required = True
    from zerokern.accounting import cli as estimate_cli

    from .train import config as train_config

    tr = sub.add_parser("train", help="train a small GPT with ZeroAdamW on the Python stdlib's "
                                      "source (2 CPU ranks, or one rank per GPU, or torchrun)",
                        description="Train a small GPT (zerokern.tools.gpt, byte vocab) with "
                                    "ZeroAdamW on the Python standard library's source; print "
                                    "the loss, memory per rank and communication per step; "
                                    "write metrics.json and loss.png to --out.")
    train_config.add_arguments(tr)
    tr.set_defaults(subparser=tr)
    est = sub.add_parser("estimate", help="memory per rank for each ZeRO stage, exact for "
                                          "zerokern's layout, beside the formulas",
                         description="Per-rank bytes of params, grads, optimizer states, "
                                     "buckets and padding for each stage: exact for zerokern's "
                                     "layout (equal to opt.memory_report()), beside DESIGN "
                                     "§4's formula and DeepSpeed's (K = 12).")
    estimate_cli.add_arguments(est)
    est.set_defaults(subparser=est)
    sub.add_parser("info", help="versions, CPU features and backend availability")
    b = sub.add_parser("build", help="prebuild the native ops into the cache")
    b.add_argument("ops", nargs="*", choices=["cpu", "cuda"], help="default: cpu (+cuda on GPUs)")
    bench = sub.add_parser("bench", help="kernel / step microbenchmarks; other flags go to the "
                                         "suite (see `zerokern bench --kernels --help`)",
                           add_help=False)
    bench.add_argument("--kernels", action="store_true", help="kernel suite (default)")
    bench.add_argument("--step", action="store_true", help="optimizer-step suite")
    bench.add_argument("--offload", action="store_true", help="offload='cpu' and 'nvme' suite")
    bench.add_argument("--engine", action="store_true",
                       help="zerokern.initialize vs deepspeed.initialize, same config")
    bench.add_argument("--activations", action="store_true",
                       help="activation memory at stage 3: the largest sequence that fits a "
                            "per-rank budget and its time per token, zerokern's policies vs "
                            "DeepSpeed's checkpointing and FSDP2's checkpoint_wrapper")
    from .checkpoint import cli as checkpoint_cli

    checkpoint_cli.add_arguments(sub.add_parser("consolidate", help=checkpoint_cli.HELP))
    return p


def entry() -> None:
    """The `zerokern` command and `python -m zerokern`: main(), then the process ends.

    [Note: leaving a torchrun rank]
    A torchrun rank ends with `os._exit` after the atexit handlers, not through interpreter
    shutdown. Its gloo process group lives on after `destroy_process_group()`:
    - the first torch optimizer built after `init_process_group` imports torch._dynamo, which
      imports torch.distributed.nn.functional;
    - that module's functions take `group=group.WORLD` as a default argument, so they hold the
      group for good (10 references).
    Its gloo worker threads therefore outlive the run. One of them may release its last finished
    work while the main thread finalizes. The release takes the GIL, gets pthread_exit, and its
    unwind through a noexcept destructor aborts the process with "terminate called without an
    active exception" (SIGABRT, exit code -6). That happened to rank 1 of `zerokern train` under
    torchrun in 7 of 170 runs of its test's command (core dump: pt_gloo_runloop in ~AsyncWork ->
    gil_scoped_acquire -> take_gil -> pthread_exit, main thread in Py_FinalizeEx's last GC).
    So the rank runs what an orderly exit runs first, the atexit handlers (weakref finalizers:
    NVMe state files, tqdm), flushes its output, and leaves without finalizing. Spawned ranks
    do the same (spawn.py). `main()` called from Python returns as before. The library's own
    guard (comm/exit_guard.py [Note: the gloo exit race]) is a bounded wait for processes it
    does not own; this process is ours, so it skips the finalization outright. A rank that
    raised (PeerLost: a peer was killed) leaves the same way with exit code 1: torchrun
    restarts the job only once every worker has exited.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # not a torchrun rank
        sys.exit(main())
    from .comm.exit_guard import leave_rank

    leave_rank(main)


def main(argv: Optional[List[str]] = None) -> int:
    t0 = _process_start()  # train reports its wall time from here
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "consolidate":
        from .checkpoint import cli as checkpoint_cli

        return checkpoint_cli.run(args)
    if args.cmd in ("train", "estimate"):  # their errors print their own usage line
        if args.cmd == "train":
            return cmd_train(args, args.subparser, t0)
        return cmd_estimate(args, args.subparser)
    return {"info": cmd_info, "build": cmd_build}[args.cmd](args)
