"""`zerokern train` options: one dataclass, its argparse flags, and their validation.

Every value is checked by argparse (a `type=` function or `choices=`), so a bad one exits 2 with
the usage line and the flag's name before any process is spawned.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Tuple

from zerokern.options.args import PRECISIONS as _PRECISIONS
from zerokern.tools.argtypes import int_at_least, mesh_shape, positive_float
from zerokern.tools.gpt import PRESETS

# The precision table's names, the default (bf16) first as --help lists them.
PRECISIONS = ("bf16", *(p for p in _PRECISIONS if p != "bf16"))

# Defaults, measured on this project's 2-core CPU VM (2 gloo ranks, 1 thread each), shared with
# other jobs, so times vary ~2x with their load:
# - model "tiny" (d_model 64, 2 layers, 0.12M params with the byte vocab), seq 128, batch 16 per
#   rank: 200 steps take 27-54 s and bring the loss from 5.57 to 2.50 (mean of the last 10
#   steps); 300 steps reached 2.51, no better within the +-0.05 noise of that mean. A 4x larger
#   model (d 128, 4 layers) reached 2.48 after 200 steps at 2-4x the time per step, and the run
#   must fit 2 minutes with the first-use kernel build (38-45 s) in it.
# - lr 1e-2: 5e-3, 1e-2 and 2e-2 all ended at 2.45-2.51 after 300 steps.
# - bf16: 220 ms vs 253 ms per step at d 128 on one thread (this CPU has avx512_bf16); the
#   masters, m and v stay fp32.
DEFAULTS = dict(stage=2, precision="bf16", steps=200, model_size="tiny", batch=16, seq=128,
                lr=1e-2, seed=0)


@dataclass
class TrainConfig:
    stage: int = DEFAULTS["stage"]
    nproc: Optional[int] = None       # None: one rank per GPU, else 2 CPU ranks
    precision: str = DEFAULTS["precision"]
    offload: Optional[str] = None      # None | "cpu" | "nvme"
    offload_path: Optional[str] = None  # --offload nvme: the ranks' state files (offload_dir)
    steps: int = DEFAULTS["steps"]
    model_size: str = DEFAULTS["model_size"]
    batch: int = DEFAULTS["batch"]    # sequences per rank per step (per micro-step)
    global_batch: Optional[int] = None  # sequences per step over all ranks (accumulation)
    seq: int = DEFAULTS["seq"]
    lr: float = DEFAULTS["lr"]
    out: Optional[str] = None          # None: runs/train-<timestamp>
    compare: bool = False
    seed: int = DEFAULTS["seed"]
    device: str = "auto"              # "auto" | "cpu" | "cuda"
    bucket_mb: float = 25.0
    state_bits: int = 32              # ZeroAdamW's moments: 32 fp32, 8 block-quantized
    # (replicate, shard): HSDP (launch.py check_mesh); or (pp, tp, dp): the GPT pipelined
    mesh: Optional[Tuple[int, ...]] = None  # (pipeline.py [Note: the pipelined demo job])
    micro_batches: Optional[int] = None  # with a pipeline mesh: per step (default: pp)
    schedule: str = "1f1b"            # with a pipeline mesh: "1f1b" | "gpipe"
    hpz: bool = False                 # stage 3 on the mesh: ZeRO++'s hpZ
    quantize: str = "none"             # ZeRO++: "none" | "weights" | "grads" | "both"
    activation_checkpointing: str = "none"  # "none" | "full" | "selective" | "offload"
    save_every: int = 0               # steps between checkpoints (0: none); loop.py
    save_dir: Optional[str] = None     # None: runs/checkpoints (stable, so --resume auto finds it)
    resume: str = "none"              # "none" | "auto" (latest under save_dir) | a checkpoint
    stop_after: Optional[int] = None   # stop after this step (checkpointed); schedule of --steps

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_SAVE_DIR = str(Path("runs") / "checkpoints")


def save_dir(cfg: TrainConfig) -> str:
    return cfg.save_dir or DEFAULT_SAVE_DIR


def default_out_dir() -> str:
    return str(Path("runs") / _dt.datetime.now().strftime("train-%Y%m%d-%H%M%S"))


def _offload(text: str) -> Optional[str]:
    if text in ("none", "None"):
        return None
    if text not in ("cpu", "nvme"):
        raise argparse.ArgumentTypeError(f"must be 'cpu', 'nvme' or 'none', got {text!r}")
    return text


# [Note: the NVMe state of zerokern train]
# --offload nvme keeps each rank's master and AdamW moments in files (ZeroAdamW offload="nvme",
# state/offload_nvme.py) under its own directory, <--offload-path>/rank<R>: the world rank, so
# two ranks of one host never share a directory, and a restarted rank (torchrun --max-restarts)
# finds its predecessor's. The default root is under the save dir, hidden
# (<save dir>/.offload-nvme: checkpoint.latest skips names starting with "."), which is stable
# across restarts (--out's default is a new timestamp per run). The files are scratch: a step
# commits or rolls back as a whole in memory, and they are removed when the process ends; the
# durable state is the checkpoint (zerokern.checkpoint.save reads the files' current half,
# load writes it), so --resume is as bitwise with nvme as without. A rank SIGKILLed leaves its
# files behind (nothing runs at a SIGKILL): the next rank of that directory removes the files
# whose process (the pid in their name, zerokern-<pid>-<uuid>-...) is no longer alive on this
# host, so a job that restarts K times does not hold K copies of its state on disk.
OFFLOAD_DIR = ".offload-nvme"


def offload_root(cfg: TrainConfig) -> str:
    """The root of the ranks' NVMe directories: --offload-path, else <save dir>/.offload-nvme."""
    return cfg.offload_path or os.path.join(save_dir(cfg), OFFLOAD_DIR)


def offload_dir(cfg: TrainConfig, rank: int) -> str:
    """This rank's directory for its NVMe state files ([Note: the NVMe state of zerokern
    train]), created, with the files of dead processes removed.

    Raises:
        ValueError: the directory cannot be created (names --offload-path).
    """
    d = os.path.join(offload_root(cfg), f"rank{rank}")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--offload-path {offload_root(cfg)}: cannot create {d} "
                         f"({e.strerror})") from e
    _remove_dead_files(d)
    return d


def _remove_dead_files(d: str) -> None:
    """The state files in `d` of processes that are gone (a SIGKILLed rank's)."""
    for name in os.listdir(d):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "zerokern" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(d, name))


def _offload_path(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=d["stage"],
                   help=f"ZeRO stage (default {d['stage']})")
    p.add_argument("--nproc", type=int_at_least(1), default=None,
                   help="ranks to spawn (default: one per GPU, else 2 CPU ranks over gloo; "
                        "ignored under torchrun)")
    p.add_argument("--precision", choices=PRECISIONS, default=d["precision"],
                   help=f"model dtype; masters and moments stay fp32 (default {d['precision']})")
    p.add_argument("--offload", type=_offload, default=None, metavar="{cpu,nvme,none}",
                   help="ZeRO-Offload of master/m/v to the host (cpu) or to files streamed "
                        "through host memory each step (nvme, ZeRO-Infinity's optimizer half; "
                        "see --offload-path); default none")
    p.add_argument("--offload-path", type=_offload_path, default=None, metavar="DIR",
                   help="with --offload nvme: the state files' directory, one subdirectory "
                        "rank<R> per rank, created (default <--save-dir>/.offload-nvme)")
    p.add_argument("--steps", type=int_at_least(1), default=d["steps"],
                   help=f"optimizer steps (default {d['steps']})")
    p.add_argument("--model-size", choices=list(PRESETS), default=d["model_size"],
                   help="zerokern.tools.gpt preset, with the byte vocab "
                        f"(default {d['model_size']})")
    p.add_argument("--batch", type=int_at_least(1), default=d["batch"],
                   help=f"sequences per rank per step (default {d['batch']})")
    p.add_argument("--global-batch", type=int_at_least(1), default=None, metavar="G",
                   help="sequences per optimizer step over all ranks: each rank runs "
                        "G / (--batch x ranks) micro-batches (gradient accumulation), so a "
                        "run resumed at another world size (torchrun --nproc-per-node "
                        "changed) keeps the global batch, as DeepSpeed's elastic config does; "
                        "refused when G is not a multiple of --batch x ranks (default: none, "
                        "--batch per rank, one micro-batch)")
    p.add_argument("--seq", type=int_at_least(2), default=d["seq"],
                   help=f"tokens per sequence (default {d['seq']})")
    p.add_argument("--lr", type=positive_float, default=d["lr"],
                   help=f"peak learning rate (default {d['lr']:g}; warm-up, then cosine)")
    p.add_argument("--out", default=None,
                   help="output directory (default runs/train-<timestamp>)")
    p.add_argument("--compare", action="store_true",
                   help="also train at stage 0 (same seed and data) and compare the losses")
    p.add_argument("--seed", type=int_at_least(0), default=d["seed"],
                   help="model init and data seed (default 0)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA with NCCL if a GPU is visible, else CPU with gloo")
    p.add_argument("--state-bits", type=int, choices=[32, 8], default=32,
                   help="AdamW moments: 32 fp32, 8 block-quantized 8-bit (default 32)")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="ZeroAdamW communication bucket size (default 25)")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="RxS|PPxTPxDP",
                   help="RxS: 2-D data-parallel mesh, R replicas x S shard ranks (HSDP: shard "
                        "inside a node of S ranks, replicate across R nodes); PPxTPxDP: the "
                        "GPT split into PP pipeline stages, its MLPs over TP ranks, ZeRO over "
                        "DP (3-D); the product is the number of ranks")
    p.add_argument("--micro-batches", type=int_at_least(1), default=None, metavar="M",
                   help="with --mesh PPxTPxDP: micro-batches of --batch per step (default PP)")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
                   help="with --mesh PPxTPxDP: the pipeline schedule (default 1f1b)")
    p.add_argument("--hpz", action="store_true",
                   help="with --mesh and --stage 3: ZeRO++'s hpZ (params sharded over all "
                        "ranks, a secondary copy inside the node for the backward gathers)")
    p.add_argument("--quantize", choices=list(QUANTIZE), default="none",
                   help="ZeRO++ quantized collectives: weights (qwZ, int8 param gathers, "
                        "--stage 3), grads (qgZ, int8 gradient reduce-scatter, --stage 1-3) "
                        "or both (default none)")
    p.add_argument("--activation-checkpointing", choices=["none", "full", "selective",
                                                          "offload"], default="none",
                   help="ZeroAdamW activation_checkpointing= on the GPT's blocks: full "
                        "recompute, selective (matmul and attention outputs kept), offload "
                        "(saved tensors in host memory); default none")
    p.add_argument("--save-every", type=int_at_least(0), default=0, metavar="N",
                   help="save a checkpoint every N steps (and at the last step and at "
                        "--stop-after), asynchronously, under --save-dir as step<NNNNNNNN>/ "
                        "(default 0: no checkpoints)")
    p.add_argument("--save-dir", default=None,
                   help=f"checkpoint directory (default {DEFAULT_SAVE_DIR})")
    p.add_argument("--resume", default="none", metavar="{auto,none,PATH}",
                   help="auto: continue from the newest complete checkpoint under --save-dir "
                        "(zerokern.checkpoint.latest; a fresh run when there is none); PATH: "
                        "from that checkpoint; none: from step 0 (default). A resumed run is "
                        "bitwise the uninterrupted one (data order, RNG, schedule and loss "
                        "curve are in the checkpoint)")
    p.add_argument("--stop-after", type=int_at_least(1), default=None, metavar="K",
                   help="stop after step K of the --steps schedule, saving a checkpoint there "
                        "with --save-every (a job's time slot; --resume auto continues)")


# --quantize: ZeroAdamW's quantized_weights / quantized_gradients
QUANTIZE = {"none": {}, "weights": {"quantized_weights": True},
            "grads": {"quantized_gradients": "int8"},
            "both": {"quantized_weights": True, "quantized_gradients": "int8"}}


def from_args(args: argparse.Namespace) -> TrainConfig:
    """The config of the parsed flags.

    Raises:
        ValueError: --offload-path without --offload nvme, or --offload nvme with a pipeline
            mesh (the pipelined job keeps its state in memory or host memory).
    """
    if args.offload_path is not None and args.offload != "nvme":
        raise ValueError(f"--offload-path is for --offload nvme (the state files' directory), "
                         f"got --offload {args.offload or 'none'}")
    if args.offload == "nvme" and args.mesh is not None and len(args.mesh) == 3:
        raise ValueError("--offload nvme is not available with a pipeline mesh (--mesh "
                         "PPxTPxDP) yet: use --offload cpu, or a 1-D or RxS mesh")
    return TrainConfig(stage=args.stage, nproc=args.nproc, precision=args.precision,
                       offload=args.offload, offload_path=args.offload_path,
                       steps=args.steps, model_size=args.model_size,
                       batch=args.batch, global_batch=args.global_batch, seq=args.seq,
                       lr=args.lr, out=args.out,
                       compare=args.compare, seed=args.seed, device=args.device,
                       bucket_mb=args.bucket_mb, quantize=args.quantize,
                       state_bits=args.state_bits, mesh=args.mesh, hpz=args.hpz,
                       micro_batches=args.micro_batches, schedule=args.schedule,
                       activation_checkpointing=args.activation_checkpointing,
                       save_every=args.save_every, save_dir=args.save_dir, resume=args.resume,
                       stop_after=args.stop_after)


def accumulation(cfg: TrainConfig, world: int) -> int:
    """Micro-batches per step on each rank: G / (batch x world) with --global-batch G, else 1.

    Raises:
        ValueError: G is not a multiple of batch x world (the global batch cannot be kept
            exactly at this world size; names the flags and the sizes that would work).
    """
    if cfg.global_batch is None:
        return 1
    per = cfg.batch * world
    if cfg.global_batch % per:
        fits = [w for w in range(1, cfg.global_batch // cfg.batch + 1)
                if cfg.global_batch % (cfg.batch * w) == 0]
        raise ValueError(f"--global-batch {cfg.global_batch} cannot be kept at {world} ranks "
                         f"with --batch {cfg.batch}: it is not a multiple of {cfg.batch} x "
                         f"{world} = {per} (world sizes that keep it: "
                         f"{', '.join(map(str, fits))}; or change --batch)")
    return cfg.global_batch // per
