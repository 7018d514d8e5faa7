"""`zerokern train --mesh PPxTPxDP`: the demo GPT split into pipeline stages (issue 38).

[Note: the pipelined demo job]
A 3-part mesh PPxTPxDP is laid out as the DeviceMesh ("pp", "dp", "tp") of shape (pp, dp, tp):
tp innermost (consecutive ranks: one node's fast links, as torchtitan orders it), then dp,
then pp; rank r is pipeline stage r // (dp x tp). Each rank builds only its stage of the GPT
(tools/gpt_stages.py [Note: a GPT pipeline stage]: the whole model's param names, so a
checkpoint loads at any other split), with tp > 1 the MLP of each block split over tp (`fc`
column-wise, `out` row-wise, DTensor; attention stays replicated over tp: its fused qkv is
not laid out by head), and one ZeroAdamW over the stage with `mesh=` the world mesh: ZeRO
over dp, the grad norm, the overflow skip and the loss scale agreed over pp x tp x dp
(comm/plan.py [Note: one parallel plan]). The schedule (`--schedule`, 1F1B by default)
runs `--micro-batches` M micro-batches of `--batch` sequences
per step through `ZeroPipelineStage` (zerokern.pipelining), whose data-parallel reduction
runs once per step.

Data: the dp rank picks the windows (data.Batches seeded by the dp rank), so every stage and
tp rank of one pipeline replica sees the same M x batch sequences; the step's global batch is
M x batch x dp. The loss is the last stage's mean over the micro-batches, averaged over dp:
the same number a single process would report for that global batch. Checkpoints
(--save-every / --resume) hold every stage (checkpoint/parts.py) and load by name.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerokern.pipelining import ZeroPipelineStage
from zerokern.platform.device import handle
from zerokern.tools.gpt import PRESETS, GPTConfig
from zerokern.tools.gpt_stages import GPTStage, stage_layers

from . import events
from .config import TrainConfig
from .data import VOCAB, Batches, load_corpus
from .loop import (
    HYPER,
    MAX_GRAD_NORM,
    _Progress,
    lr_lambda,
    resume,
    run_result,
    save,
    wait_for_save,
)

SCHEDULES = ("1f1b", "gpipe")


def check_pipeline(cfg: TrainConfig, world: int) -> None:
    """--mesh PPxTPxDP against the job and the other flags: ValueErrors naming them."""
    pp, tp, dp = cfg.mesh
    if pp * tp * dp != world:
        raise ValueError(f"--mesh {pp}x{tp}x{dp} has {pp * tp * dp} ranks but the job has "
                         f"{world}; give --nproc {pp * tp * dp} or another mesh")
    n_layers = PRESETS[cfg.model_size].n_layers
    if pp > n_layers:
        raise ValueError(f"--mesh {pp}x{tp}x{dp}: the {cfg.model_size} GPT has {n_layers} "
                         f"layers, so at most {n_layers} pipeline stages")
    d = PRESETS[cfg.model_size].d_model
    if (4 * d) % tp:
        raise ValueError(f"--mesh {pp}x{tp}x{dp}: tp must divide the MLP width {4 * d}")
    for flag, bad in (("--compare", cfg.compare), ("--hpz", cfg.hpz),
                      ("--global-batch", cfg.global_batch is not None),
                      ("--quantize", cfg.quantize != "none"),
                      ("--activation-checkpointing", cfg.activation_checkpointing != "none")):
        if bad:
            raise ValueError(f"{flag} is not supported with a pipeline mesh (--mesh PPxTPxDP); "
                             "run without it, or with --mesh RxS / no mesh")
    if cfg.micro_batches is not None and cfg.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {cfg.micro_batches}")


def world_mesh(cfg: TrainConfig, device: torch.device):
    """The ("pp", "dp", "tp") DeviceMesh of --mesh PPxTPxDP ([Note: the pipelined demo
    job]: tp innermost)."""
    from torch.distributed.device_mesh import init_device_mesh

    pp, tp, dp = cfg.mesh
    return init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def stage_config(cfg: TrainConfig) -> GPTConfig:
    """The preset's width and depth with the byte vocab and --seq positions."""
    return GPTConfig(**{**PRESETS[cfg.model_size].__dict__, "vocab": VOCAB, "seq": cfg.seq})


def stage_specs(cfg: TrainConfig) -> list:
    """Every stage's ModelSpec (built on the meta device): what `zerokern train`'s report
    estimates per stage."""
    from zerokern.accounting.estimate import spec_from_model

    pp = cfg.mesh[0]
    with torch.device("meta"):
        return [spec_from_model(GPTStage(stage_config(cfg), s, pp), f"gpt stage {s}")
                for s in range(pp)]


def build_stage(cfg: TrainConfig, mesh, device: torch.device) -> GPTStage:
    """This rank's stage of the GPT, seeded as the whole model would be per stage, with the
    MLPs split over tp when tp > 1."""
    pp, tp, _ = cfg.mesh
    s = mesh["pp"].get_local_rank()
    c = stage_config(cfg)
    torch.manual_seed(cfg.seed * 1_000 + s)  # the same stage on every tp and dp rank
    stage = GPTStage(c, s, pp).to(device)
    if tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for blk in stage.blocks:
            parallelize_module(blk, mesh["tp"], {"fc": ColwiseParallel(),
                                                 "out": RowwiseParallel()})
    return stage


def train_pipelined(cfg: TrainConfig, device: torch.device, corpus: torch.Tensor, show: bool,
                    desc: str, checkpoints: bool = True) -> Dict[str, Any]:
    """Train the pipelined GPT ([Note: the pipelined demo job]); returns train_once's keys."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    import zerokern as zk

    rank, world = dist.get_rank(), dist.get_world_size()
    check_pipeline(cfg, world)
    pp, tp, dp = cfg.mesh
    mesh = world_mesh(cfg, device)
    s, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = build_stage(cfg, mesh, device)
    opt = zk.ZeroAdamW(model, lr=cfg.lr, stage=cfg.stage, precision=cfg.precision,
                       offload=cfg.offload, max_grad_norm=MAX_GRAD_NORM,
                       bucket_mb=cfg.bucket_mb, state_bits=cfg.state_bits, mesh=mesh, **HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.steps))
    micro = cfg.micro_batches or pp
    stage = ZeroPipelineStage(model, s, pp, device, opt, group=mesh["pp"].get_group())

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    kind = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, micro, loss_fn=loss_fn)
    batches = Batches(corpus, cfg.batch * micro, cfg.seq, cfg.seed, dp_rank)
    losses = torch.zeros(cfg.steps, dtype=torch.float32, device=device)
    tokens_per_step = cfg.batch * micro * cfg.seq * dp
    start = resume(cfg, model, opt, sched, losses, device) if checkpoints else 0
    stop = min(cfg.steps, cfg.stop_after or cfg.steps)
    bar = _Progress(show, cfg.steps, desc)
    bar.update(start)
    last = s == pp - 1
    t0 = time.perf_counter()
    for step in range(start, stop):
        x, y = (t.to(device) for t in batches.get(step))
        out = []
        schedule.step(*([x] if s == 0 else []), **({"target": y, "losses": out}
                                                   if last else {}))
        opt.step()
        opt.zero_grad()
        sched.step()
        if last:
            losses[step] = torch.stack([v.detach().float() for v in out]).mean()
        if checkpoints and cfg.save_every and (
                (step + 1) % cfg.save_every == 0 or step + 1 == stop):
            save(cfg, model, opt, sched, losses, step + 1, device)
        events.record("step", step=step + 1, rank=rank)
        bar.update(1)
    if checkpoints:
        wait_for_save(cfg)
    zk.checkpoint.wait()
    handle(device).synchronize(device)
    train_s = max(time.perf_counter() - t0, 1e-9)
    bar.close()
    losses = losses[:stop]
    # the curve: the last stage's losses, their mean over dp (its tp ranks hold the same)
    mine = losses if (last and mesh["tp"].get_local_rank() == 0) else torch.zeros_like(losses)
    dist.all_reduce(mine)
    mine /= dp
    return run_result(opt, cfg.stage, mine, train_s, tokens_per_step, stop - start,
                      dims={**opt.comm.dims, "pp": pp, "tp": tp},
                      pipeline={"stages": [list(r) for r in stage_layers(
                          PRESETS[cfg.model_size].n_layers, pp)], "micro_batches": micro,
                          "schedule": cfg.schedule})


def run_rank_pipelined(cfg: TrainConfig, device: torch.device) -> Dict[str, Any]:
    """The whole job on this rank with --mesh PPxTPxDP (loop.run_rank's result)."""
    t0 = time.perf_counter()
    corpus = load_corpus()
    main = train_pipelined(cfg, device, corpus, show=dist.get_rank() == 0,
                           desc=f"stage {cfg.stage} pp {cfg.mesh[0]}")
    return {"main": main, "compare": None, "world_size": dist.get_world_size(),
            "device": str(device), "corpus_bytes": int(corpus.numel()),
            "rank_s": time.perf_counter() - t0}


def mesh_dims(mesh: Tuple[int, ...]) -> str:
    """The mesh as the report names it."""
    if len(mesh) == 3:
        return "pp {} x tp {} x dp {}".format(*mesh)
    return "replicate {} x shard {}".format(*mesh)
