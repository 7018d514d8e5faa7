"""One rank of `zerokern train`: build the GPT, train it with ZeroAdamW, collect the metrics.

Runs identically in a spawned rank, under torchrun, or alone (world size 1, no process group).
The step loop never reads a device value on the host except for the progress display (below).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from zerokern.platform.device import handle
from zerokern.tools.gpt import build_gpt

from . import chaos_kill, events
from .config import QUANTIZE, TrainConfig, accumulation, offload_dir, save_dir
from .data import VOCAB, Batches, GlobalBatches, load_corpus

# Loss and loss scale are read on the host (a device sync) only to refresh the progress bar,
# every DISPLAY_EVERY steps: on a GPU a per-step .item() would stall the launch queue. The
# loss curve itself stays on the device until the end of the run.
DISPLAY_EVERY = 5
HYPER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_GRAD_NORM = 1.0
WARMUP_FRAC = 0.1   # linear warm-up over the first 10% of steps, then cosine to 10% of lr
FINAL_LR_FRAC = 0.1
FINAL_WINDOW = 10   # "final loss" = mean over the last steps (one batch is noisy)
# [Note: resumable runs]
# A checkpoint of `zerokern train` (--save-every) is a zerokern checkpoint whose client_state
# holds the rest of the run's state: the steps done (the data order is a function of the step:
# data.Batches), the LR scheduler, and per rank torch's CPU RNG, the accelerator's (the
# device handle) and the losses so far; with RESUME_KEYS, the settings the run must keep.
# So `--resume auto` continues bitwise as if never stopped (tests/test_train_resume.py).
# At another world size (elastic: torchrun restarted with another --nproc-per-node) a run
# resumes only with --global-batch G: the checkpoint reshards on load, the micro-batches per
# rank become G / (batch x world) (DeepSpeed's elastic config keeps its train_batch_size the
# same way) and step s trains on the same G windows (data.GlobalBatches), so the run is the
# same run up to the reduction order (not bitwise); --batch may change then too. The RNG
# streams are per rank and do not map to another world size (rank r takes saved rank
# min(r, old - 1)'s: the tiny GPT draws none), and the losses so far become the ranks' mean.
TRAIN_KEY = "zerokern.train"
RESUME_KEYS = ("model_size", "seq", "batch", "seed", "steps", "lr", "stage", "precision",
               "state_bits", "global_batch")


def lr_lambda(steps: int):
    warm = max(1, int(steps * WARMUP_FRAC))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return FINAL_LR_FRAC + (1 - FINAL_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The preset's width and depth with the byte vocab and --seq positions, seeded."""
    return build_gpt(cfg.model_size, seed=cfg.seed, vocab=VOCAB, seq=cfg.seq).to(device)


def _world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _Progress:
    """tqdm bar on rank 0 (loss, tokens/s, loss scale); silent elsewhere."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            import threading

            from tqdm.auto import tqdm

            # tqdm's default lock is a multiprocessing semaphore; a spawned rank exits with
            # os._exit, so the resource tracker would warn that it leaked. One thread draws.
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True,
                            mininterval=0.5)

    def update(self, n: int, **post) -> None:
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def make_mesh(cfg: TrainConfig, device: torch.device):
    """--mesh RxS: the (replicate, shard) DeviceMesh over every rank, dim 1 the consecutive
    ranks (torchrun numbers a node's ranks consecutively, so a shard group is one node)."""
    if cfg.mesh is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, tuple(cfg.mesh), mesh_dim_names=("replicate", "shard"))


def train_once(cfg: TrainConfig, stage: int, device: torch.device, corpus: torch.Tensor,
               show: bool, desc: str, mesh=None, checkpoints: bool = False) -> Dict[str, Any]:
    """Train a fresh model at `stage`; returns the loss curve (mean over ranks) and reports.
    checkpoints: this run saves (--save-every) and resumes (--resume); not --compare's."""
    import zerokern as zk

    rank, world = _world()
    model = build_model(cfg, device)
    # --compare's stage-0 run keeps its state on the device: ZeroAdamW offloads at stages 1-3.
    offload = cfg.offload if stage > 0 else None
    nvme = {"offload_path": offload_dir(cfg, rank)} if offload == "nvme" else {}
    opt = zk.ZeroAdamW(model, lr=cfg.lr, stage=stage, precision=cfg.precision,
                       offload=offload, max_grad_norm=MAX_GRAD_NORM, **nvme,
                       bucket_mb=cfg.bucket_mb, state_bits=cfg.state_bits, mesh=mesh,
                       hpz=cfg.hpz and stage == 3, **HYPER,
                       activation_checkpointing=cfg.activation_checkpointing,
                       **(QUANTIZE[cfg.quantize] if stage > 0 else {}))  # (--compare: exact)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps))
    accum = accumulation(cfg, world)
    batches = Batches(corpus, cfg.batch, cfg.seq, cfg.seed, rank) if cfg.global_batch is None \
        else GlobalBatches(corpus, cfg.global_batch, cfg.batch, cfg.seq, cfg.seed, rank, world)
    losses = torch.zeros(cfg.steps, dtype=torch.float32, device=device)  # (steps,) on device
    tokens_per_step = cfg.batch * cfg.seq * world * accum
    start = resume(cfg, model, opt, sched, losses, device) if checkpoints else 0
    chaos_kill.install(opt, rank, start)  # $ZEROKERN_CHAOS_DIR only (the chaos run)
    stop = min(cfg.steps, cfg.stop_after or cfg.steps)
    bar = _Progress(show, cfg.steps, desc)
    bar.update(start)
    shown, t0 = start, time.perf_counter()
    for step in range(start, stop):
        if accum == 1:
            x, y = (t.to(device, non_blocking=True) for t in batches.get(step))
            loss = model.loss(x, y)
            opt.backward(loss)
        else:  # --global-batch: the mean over the micro-batches, reduced once (no_sync)
            loss = torch.zeros((), dtype=torch.float32, device=device)
            for micro in range(accum):
                x, y = (t.to(device, non_blocking=True) for t in batches.get(step, micro))
                with opt.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                    part = model.loss(x, y) / accum
                    opt.backward(part)
                loss += part.detach().float()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses[step] = loss.detach()
        if checkpoints and cfg.save_every and (
                (step + 1) % cfg.save_every == 0 or step + 1 == stop):
            save(cfg, model, opt, sched, losses, step + 1, device)
        events.record("step", step=step + 1, rank=rank)
        if show and ((step + 1) % DISPLAY_EVERY == 0 or step + 1 == stop):
            # The one host sync of the loop: for the display only (see DISPLAY_EVERY).
            elapsed = time.perf_counter() - t0
            bar.update(step + 1 - shown, loss=f"{losses[step].item():.3f}",
                       tok_s=f"{tokens_per_step * (step + 1 - start) / elapsed:,.0f}",
                       scale=f"{opt.loss_scale.item():g}")
            shown = step + 1
    if checkpoints:
        wait_for_save(cfg)  # the last async save commits (or stops the run) before the report
    zk.checkpoint.wait()
    handle(device).synchronize(device)
    train_s = max(time.perf_counter() - t0, 1e-9)
    bar.close()
    losses = losses[:stop]
    if world > 1:  # the curve is the global batch's loss: the mean of the ranks' losses
        dist.all_reduce(losses)
        losses /= world
    return run_result(opt, stage, losses, train_s, tokens_per_step, stop - start)


def run_result(opt, stage: int, curve_t: torch.Tensor, train_s: float, tokens_per_step: int,
               steps: int, **extra) -> Dict[str, Any]:
    """A training run's result (train_once's; the pipelined job's too, train/pipeline.py):
    the loss curve (the global batch's, already reduced over the ranks: one host read, after
    training), speed, the ranks' memory reports and the collectives per step; `extra` adds or
    overrides keys."""
    run = max(steps, 1)  # steps trained by this process (comm and speed per step)
    comm = opt.comm_stats()
    reports = _gather(opt.memory_report())
    curve: List[float] = curve_t.cpu().tolist()
    out = {"stage": stage, "loss_curve": curve,
           "loss_first": curve[0], "loss_last": curve[-1],
           "loss_final": sum(curve[-FINAL_WINDOW:]) / len(curve[-FINAL_WINDOW:]),
           "train_s": train_s, "tokens_per_step": tokens_per_step,
           "tokens_per_s": tokens_per_step * steps / train_s,
           "memory_reports": reports,
           "comm_per_step": {k: comm[k] / run
                             for k in ("all_reduce", "reduce_scatter", "all_gather", "total")},
           "comm_calls_per_step": {k: v / run for k, v in comm["calls"].items()},
           "comm_per_dim_per_step": {d: v["total"] / run
                                     for d, v in comm.get("dims", {}).items()},
           "dims": opt.comm.dims,
           "num_params": sum(g.layout.numel for g in opt.flat_groups),  # (stage 3: p is empty)
           "grad_norm_last": float(opt.grad_norm), "loss_scale_last": float(opt.loss_scale)}
    out.update(extra)
    return out


# ---- checkpoints (--save-every, --resume) ------------------------------------------------------
def _step_dir(cfg: TrainConfig, step: int) -> str:
    return os.path.join(save_dir(cfg), f"step{step:08d}")


def save(cfg: TrainConfig, model, opt, sched, losses: torch.Tensor, step: int,
         device: torch.device) -> None:
    """[Note: resumable runs]: an async save of model + optimizer with the train state
    (collective; this rank's RNG and losses gathered to rank 0 first, on this thread)."""
    import zerokern as zk

    dev = handle(device)
    mine = {"rng": torch.get_rng_state(),
            "device_rng": dev.get_rng_state() if dev.is_accelerator else None,
            "losses": losses[:step].cpu()}
    ranks = _gather(mine)
    state = {"step": step, "scheduler": sched.state_dict(), "ranks": ranks,
             "run": {k: getattr(cfg, k) for k in RESUME_KEYS}}
    try:  # raises the previous async save's failure (a full or failing disk), if any
        zk.checkpoint.save(_step_dir(cfg, step), model, opt, async_save=True,
                           client_state={TRAIN_KEY: state})
    except Exception as e:
        _save_failed(cfg, e, f"before saving step {step}")
        raise


def wait_for_save(cfg: TrainConfig) -> None:
    """The last async save commits, or its failure stops the run (with `_save_failed`)."""
    import zerokern as zk

    try:
        zk.checkpoint.wait()
    except Exception as e:
        _save_failed(cfg, e, "at the end of the run")
        raise


def _save_failed(cfg: TrainConfig, e: Exception, when: str) -> None:
    """A failed checkpoint write stops the run (issue 39: a disk that fails): training on
    without checkpoints would lose ever more work at the next fault. The error keeps its type
    (OSError with its errno, CheckpointError) and says where a restart resumes from. A lost
    peer (PeerLost, raised by the save's agreement) is left as it is: it is no disk's fault
    (the chaos run's log showed this note on a PeerLost before)."""
    import zerokern as zk

    if isinstance(e, (OSError, zk.checkpoint.CheckpointError)):  # not a lost peer's PeerLost
        try:
            last = zk.checkpoint.latest(save_dir(cfg), verify=False)
        except Exception:  # noqa: BLE001 - the disk itself may fail to list
            last = None
        e.add_note(f"zerokern train: stopped {when}: a checkpoint write failed. The newest "
                   f"committed checkpoint is {last or 'none (no save has committed)'}; "
                   "`--resume auto` continues from it once the disk is fixed.")


def resume(cfg: TrainConfig, model, opt, sched, losses: torch.Tensor,
           device: torch.device) -> int:
    """--resume: load the checkpoint and the train state; returns the steps already done."""
    import zerokern as zk

    rank, world = _world()
    if cfg.resume == "none":
        return 0
    path = cfg.resume
    if cfg.resume == "auto":  # rank 0 decides, so every rank loads the same one
        path = _gather(zk.checkpoint.latest(save_dir(cfg)) if rank == 0 else None)[0]
        if path is None:
            if rank == 0:
                print(f"zerokern train: no checkpoint under {save_dir(cfg)}; starting at step 0",
                      flush=True)
            return 0
    info = zk.checkpoint.load(path, model, opt)
    state = (info["client_state"] or {}).get(TRAIN_KEY)
    if state is None:
        raise ValueError(f"--resume {path}: the checkpoint holds no `zerokern train` state "
                         "(written by another program); load it with zerokern.checkpoint")
    elastic = cfg.global_batch is not None  # [Note: resumable runs]: another world size
    old_world = len(state["ranks"])
    differ = {k: (v, getattr(cfg, k)) for k, v in state["run"].items()
              if getattr(cfg, k) != v and not (elastic and k == "batch")}
    if differ or (old_world != world and not elastic):
        what = ", ".join(f"--{k.replace('_', '-')} {a} (now {b})" for k, (a, b) in differ.items())
        hint = "" if differ else (" (or pass --global-batch, with the run's global batch from "
                                  "its start, to resume at another world size)")
        raise ValueError(f"--resume {path}: saved by a run with {what or ''}"
                         f"{'; ' if what else ''}{old_world} ranks (now {world}): "
                         "a resumed run must be the same run (the schedule, data and RNG "
                         f"streams depend on these){hint}")
    sched.load_state_dict(state["scheduler"])
    mine = state["ranks"][min(rank, old_world - 1)]
    torch.set_rng_state(mine["rng"])
    if mine["device_rng"] is not None:
        handle(device).set_rng_state(mine["device_rng"])
    step = state["step"]
    if old_world == world:
        losses[:step] = mine["losses"].to(device)
    else:  # the curve is the ranks' mean (train_once): every rank holds the old mean
        losses[:step] = torch.stack([r["losses"] for r in state["ranks"]]).mean(0).to(device)
    if rank == 0:
        how = "" if old_world == world else (
            f" on {world} ranks (saved on {old_world}): {accumulation(cfg, world)} "
            f"micro-batch(es) of {cfg.batch} per rank, global batch {cfg.global_batch} kept")
        print(f"zerokern train: resumed from {info['path']} at step {step}{how}", flush=True)
    return step


def _gather(obj: Any) -> List[Any]:
    """Every rank's `obj` (rank order) on every rank; [obj] without a process group."""
    rank, world = _world()
    if world == 1:
        return [obj]
    # watched for a lost rank: a survivor raises PeerLost naming it, not gloo's "Connection
    # reset by peer" (the chaos run caught that once in 3 runs: a kill while the survivor
    # gathered the train state of a save)
    from zerokern.checkpoint.collective import Collective

    return Collective(dist.group.WORLD, rank, world).all_gather(obj)


def run_rank(cfg: TrainConfig, device: torch.device) -> Dict[str, Any]:
    """The whole job on this rank: the main run, then (--compare) the stage-0 run."""
    rank, world = _world()
    t0 = time.perf_counter()
    corpus = load_corpus()
    mesh = make_mesh(cfg, device)
    main = train_once(cfg, cfg.stage, device, corpus, show=rank == 0,
                      desc=f"stage {cfg.stage}", mesh=mesh, checkpoints=True)
    out = {"main": main, "compare": None, "world_size": world, "device": str(device),
           "corpus_bytes": int(corpus.numel())}
    if cfg.compare:
        out["compare"] = train_once(cfg, 0, device, corpus, show=rank == 0,
                                    desc="stage 0 (--compare)", mesh=mesh)
    out["rank_s"] = time.perf_counter() - t0
    return out
