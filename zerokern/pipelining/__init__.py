"""ZeRO on every pipeline stage: `torch.distributed.pipelining` with a zerokern optimizer
(issue 38).

The API, in full (the engine's PipelineModule support, zerokern/engine/pipeline_engine.py,
shares its mechanisms -- no_sync for all but the last backward, scaled non-last stages -- with
its own 1F1B over DeepSpeed's micro-batch iterator):

    world = init_device_mesh("cuda", (pp, dp), mesh_dim_names=("pp", "dp"))   # or (pp, dp, tp)
    module = build_my_stage(world["pp"].get_local_rank())     # this rank's part of the model
    opt = zk.ZeroAdamW(module, stage=3, mesh=world)           # the WORLD mesh: the pp role
    stage = ZeroPipelineStage(module, stage_index, num_stages, device, opt,
                              group=world["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)   # any torch schedule below
    for x, y in data:
        schedule.step(x, target=y, losses=losses)   # (x on the first stage, target on the last)
        opt.step(); opt.zero_grad()

Several stages per rank (`ScheduleInterleaved1F1B`, `ScheduleLoopedBFS`): ONE optimizer over
all of the rank's stage modules (`zk.ZeroAdamW(nn.ModuleList(modules), mesh=world)`), one
`ZeroPipelineStage` per module, all given that optimizer ([Note: one optimizer per rank] in
stage.py says why).

What `ZeroPipelineStage` adds to torch's `PipelineStage` (stage.py):
- the data-parallel reduction runs once per schedule step, in the rank's last backward (the
  others run under `opt.no_sync()`), as torch does for DDP and FSDP2;
- the loss goes through the optimizer's loss scale at the last stage, and the other stages'
  backwards are marked as scaled (their output grads carry that scale), so fp16 works;
- the schedule's `scale_grads` (divide by the number of micro-batches) is folded into the
  last stage's loss, because at stages 1-3 `p.grad` is sharded; so a second schedule step
  with scale_grads=True before `opt.zero_grad()` is refused (torch would divide the first
  step's grads twice); with scale_grads=False several schedule steps sum, as torch's;
- at the first step of each schedule, one agreement over the whole job (agreement.py): every
  rank's schedule, micro-batch count, stage layout, optimizer settings and params are compared,
  and a difference raises ValueError on every rank before anything changes; a schedule step
  inside `opt.no_sync()` is refused;
- an error in one rank's forward or backward drains that rank's schedule step (its peers'
  receives complete) and is raised at its next `opt.step()`; the others raise RankAborted;
- `keep_gathered=True` (stage 3): the rank's params gathered once per schedule step, not
  around every micro-batch.

Supported schedules: `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
`ScheduleLoopedBFS` (full backward passes). The split-backward ones (zero bubble, DualPipeV)
are refused with a ValueError at their first step.
"""

from zerokern.pipelining.agreement import SUPPORTED_SCHEDULES  # noqa: F401 (the names)
from zerokern.pipelining.stage import ZeroPipelineStage

__all__ = ["ZeroPipelineStage"]
