"""`ZeroPipelineStage`: torch's `PipelineStage` whose data-parallel side is a zerokern optimizer.

torch's stage knows two data-parallel wrappers (stage.py, `backward_maybe_with_nosync` and
`perform_reduce_grad`): DDP (`no_sync()` except in the last backward) and FSDP2
(`set_requires_gradient_sync(False)`, then the reduction in `perform_reduce_grad`). This is the
same contract for a zerokern optimizer, which owns the stage's params (any ZeRO stage 0-3).

[Note: one reduction per schedule step]
A schedule step runs one backward per micro-batch and stage. Every backward but the rank's
last runs under `opt.no_sync()` (grads accumulate locally, torch's sum semantics); the last one
runs outside it, so the optimizer reduces (reduce-scatters at stages 1-3, all-reduces at 0)
everything accumulated, once. "The rank's last": with several stages on a rank (interleaved)
the optimizer is shared ([Note: one optimizer per rank]), and a stage's own last backward is
not the rank's last while another of the rank's stages still has backwards to run, so the
stages of one optimizer count their last backwards together (`_RankStages`).

[Note: one optimizer per rank]
With several stages per rank there is one optimizer over all of the rank's stage modules, not
one per module. The plan's agreement (comm/plan.py: the grad norm, the overflow flag) sums
over the pp group by position: each rank's first optimizer meets the other ranks' first. With
one optimizer per module, rank 0's optimizer of stage 0 would meet rank 1's of stage 1, and
rank 0's of stage 2 rank 1's of stage 3: two partial norms, neither global. One optimizer
per rank makes the sum over the pp group the sum over every stage. Two stages of one rank
holding different optimizers are refused (agreement.py).

[Note: stage 3 across micro-batches]
At stage 3 every micro-batch's forward and backward gather the units they run, as any
forward and backward does: measured on tests/pipeline's model (2 units per stage module),
2 all-gathers per micro-batch, 8 per step at 4 micro-batches, GPipe and 1F1B alike. With
`keep_gathered=True` the rank's optimizer gathers all of its params once when the step
begins (`gather_all`, the reference count that `gathered_params()` takes, so the runtime's
frees pass them by) and releases them after the rank's last backward (torch's
REDUCE_GRAD): one all-gather per unit per step, whatever the micro-batch count, for the
whole stage held through the step (torchtitan's choice for pipelining:
reshard_after_forward=False). The reduce-scatters do not change (one per step either way).
Stage modules of several units (the demo GPT's blocks, a unit each) rely on two rules of
stage 3's runtime: the unit fed the stage's input (a leaf torch makes) knows its backward
is over only at the end of it ([Note: a leaf input] in stage3/runtime.py), and the call
counts of the micro-batches' graphs alive at once are kept across the no_sync backwards
([Note: graphs alive across backwards]); the shape inference's calls are forgotten
(`_post_metadata_inference_cleanup`). tests/pipeline/test_stage3_units.py checks them.

[Note: the loss scale through the pipeline]
The last stage's backward starts from `opt.scale_loss(loss)`: the loss times the loss scale.
The grads it sends back carry that scale, so an earlier stage's grads are scaled by the same
factor; its backward starts from those output grads, and is marked as scaled (the hook
`scale_loss` puts on a loss, put here on the stage's outputs). Every rank's scale is the same:
they start from the same scale (agreement.py compares it) and update it from the same
agreed overflow flag (the plan's pp role), so one scale divides every stage's grads.
The schedule's `scale_grads` (divide the grads by the number of micro-batches) is folded into
the same product: the last stage's loss is divided by n before the backward, and every
stage's grads follow (they are linear in the loss). torch divides `p.grad` after the last
backward instead; at stages 1-3 `p.grad` is sharded, so it cannot be divided there.

[Note: several schedule steps before one opt.step()]
torch divides whatever `p.grad` holds at the end of every step with scale_grads=True, so two
such steps before one `opt.step()` give (g1 / n + g2) / n: the first step's grads divided
twice. The fold above gives (g1 + g2) / n instead: a plausible, silently different number.
So a schedule step with scale_grads=True (and a backward) while the optimizer holds grads of
an earlier backward (`grad_sync.micro_steps` > 0: no `opt.zero_grad()` since) raises
ValueError in `clear_runtime_states`, before the step's first communication, on every rank
that runs the same program (and posts it for the others, as a step inside `no_sync()` is):
the grads of the earlier steps stay as they were. With scale_grads=False nothing is divided,
in torch or here: the steps' micro-batch grads sum (g1 + g2), so accumulating over several
schedule steps is done with scale_grads=False and the loss divided by the user.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.pipelining import agreement

# optimizer -> the ZeroPipelineStages built with it on this rank
_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, _RankStages] = weakref.WeakKeyDictionary()


class _RankStages:
    """The stages of one optimizer on this rank, which of them ran their last backward of
    the current schedule step ([Note: one reduction per schedule step]), and the error one
    of them raised (the rank then drains: [Note: a failure inside the schedule])."""

    def __init__(self) -> None:
        self.stages: List[weakref.ref] = []
        self.done: set = set()
        self.error: Optional[BaseException] = None
        self.pinned = False  # keep_gathered: the params are gathered for this step
        self.reduced: set = set()  # stages past their REDUCE_GRAD in this step

    def live(self) -> list:
        return [s for s in (r() for r in self.stages) if s is not None]


def _tensors(value) -> list:
    """The tensors in a stage's output (a tensor, or nested tuples/lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nan_like(meta, device) -> torch.Tensor:
    """A tensor of torch's metadata, NaN where the dtype has one (zeros otherwise): what a
    drained stage sends, so a value computed from it can never pass as a real one."""
    t = _make_tensor_from_meta(meta, device)
    return t.fill_(float("nan")) if t.is_floating_point() else t.zero_()


class ZeroPipelineStage(PipelineStage):
    """A pipeline stage whose params a zerokern optimizer owns: torch's `PipelineStage` with
    the optimizer's gradient sync, loss scale and agreement (zerokern.pipelining).

    Args:
        submodule: this stage's module (its params are the optimizer's, or frozen).
        stage_index: this stage's index in the pipeline.
        num_stages: the number of stages in the pipeline.
        device: the device the stage runs on.
        optimizer: the zerokern optimizer (`ZeroAdamW`, ...) over this rank's stage modules,
            built with `mesh=` the world mesh (its "pp" dim: the plan's pp role). With several
            stages per rank, one optimizer over all of them, given to each stage.
        input_args: as torch's `PipelineStage` (example inputs; inferred when None).
        output_args: as torch's `PipelineStage`.
        group: the pipeline's process group (`world["pp"].get_group()`); it must be the
            optimizer's pp group.
        dw_builder: as torch's `PipelineStage` (not supported: must be None).
        keep_gathered: stage 3 only: gather the rank's params once when a schedule step
            begins and keep them whole until its last backward, instead of gathering each
            unit around every micro-batch's forward and backward (torchtitan's
            `reshard_after_forward=False` for pipelining); the same on every rank. Costs the
            rank's whole stage params in memory through the step.

    Raises:
        TypeError: optimizer is not a zerokern optimizer.
        ValueError: dw_builder given. Everything that needs the other ranks (the schedule,
            the stage layout, overlapping params, the optimizer's mesh) is checked at the
            first `schedule.step()`, on every rank at once (agreement.py). A schedule step
            with scale_grads=True while the optimizer holds grads of an earlier one (no
            `opt.zero_grad()` since) is refused at that step ([Note: several schedule steps
            before one opt.step()]): accumulate over steps with scale_grads=False.
    """

    def __init__(self, submodule: torch.nn.Module, stage_index: int, num_stages: int,
                 device: torch.device, optimizer: ZeroOptimizer, input_args=None,
                 output_args=None, group=None, dw_builder=None,
                 keep_gathered: bool = False) -> None:
        if not isinstance(keep_gathered, bool):
            raise TypeError(f"keep_gathered must be True or False, got "
                            f"{type(keep_gathered).__name__}")
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError("optimizer must be a zerokern optimizer (ZeroAdamW, ZeroLion, ...) "
                            f"over this stage's params, got {type(optimizer).__name__}")
        if dw_builder is not None:
            raise ValueError("dw_builder: a custom weight-gradient builder is not supported "
                             "with a zerokern optimizer (its grads must reach the optimizer's "
                             "hooks through autograd); pass dw_builder=None")
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.optimizer = optimizer
        self.owned_by_zerokern = True  # what the agreement recognises (agreement.py)
        self._rank_stages = _BY_OPTIMIZER.setdefault(optimizer, _RankStages())
        self._rank_stages.stages.append(weakref.ref(self))
        self._schedule: Optional[weakref.ref] = None  # the schedule running this stage
        self._fold = 1  # the schedule's scale_grads divisor, folded into the loss
        self.keep_gathered = keep_gathered  # [Note: stage 3 across micro-batches]

    # ---- the schedule step --------------------------------------------------------------------
    def clear_runtime_states(self) -> None:
        """Called by the schedule at the start of every step, before any communication: the
        first time a schedule runs this stage, the job's agreement (agreement.py)."""
        super().clear_runtime_states()
        self._rank_stages.done.discard(self.stage_index)
        schedule = agreement.calling_schedule()
        if schedule is not None and (self._schedule is None or self._schedule() is not schedule):
            agreement.agree_on_schedule(schedule, self)  # ValueError on every rank
        if not self.optimizer.grad_sync.sync:  # (at the first step: in the agreement)
            error = ValueError(f"ZeroPipelineStage: {agreement.NO_SYNC}")
            agreement.post_failure(self, error)
            raise error
        held = self.optimizer.grad_sync.micro_steps
        if (schedule is not None and schedule.scale_grads and schedule._has_backward
                and held > 0):  # [Note: several schedule steps before one opt.step()]
            error = ValueError(f"ZeroPipelineStage: {agreement.ACCUMULATED.format(n=held)}")
            agreement.post_failure(self, error)
            raise error
        rs, opt = self._rank_stages, self.optimizer
        if (self.keep_gathered and opt.stage == 3 and not rs.pinned and schedule is not None
                and schedule._has_backward):  # [Note: stage 3 across micro-batches]
            opt.grad_sync.gather_all()
            rs.pinned, rs.reduced = True, set()
        self._fold = 1
        if schedule is not None and schedule.scale_grads:
            self._fold = schedule._n_microbatches
        if schedule is not None:
            self._schedule = weakref.ref(schedule)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """torch's end of a stage's backwards in a step; with keep_gathered, the rank's last
        one releases the params gathered since the step began ([Note: stage 3 across
        micro-batches]).

        Args:
            grad_scale_factor: the schedule's divisor (folded into the loss: see scale_grads).
        """
        super().perform_reduce_grad(grad_scale_factor)
        rs = self._rank_stages
        if rs.pinned:
            rs.reduced.add(self.stage_index)
            if {s.stage_index for s in self._stages_of_step()} <= rs.reduced:
                rs.pinned = False
                self.optimizer.grad_sync.release_all(write_back=False)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Nothing to do: the factor is folded into the last stage's loss ([Note: the loss
        scale through the pipeline]).

        Args:
            grad_scale_factor: the schedule's divisor (its number of micro-batches, or 1).
        """

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None,
                          save_forward_output: bool = True):
        """torch's forward of one micro-batch; after an error on this rank, a drained one
        ([Note: a failure inside the schedule] in agreement.py).

        Args:
            fwd_chunk_id: the micro-batch index.
            args: the stage's inputs (the first stage's; the others receive theirs).
            kwargs: keyword inputs.
            save_forward_output: keep the last stage's output for the schedule's return.
        """
        if self._rank_stages.error is None:
            try:
                return super().forward_one_chunk(fwd_chunk_id, args, kwargs,
                                                 save_forward_output)
            except Exception as e:
                self._failed(e)
        outs = tuple(_nan_like(m, self.device) for m in self._stage_meta.outputs)
        self.fwd_cache[fwd_chunk_id] = (outs, [])
        out = outs[0] if len(outs) == 1 else outs
        if self.is_last and save_forward_output:
            self.output_chunks.append(out)
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        """torch's backward of one micro-batch; after an error on this rank, a drained one
        ([Note: a failure inside the schedule] in agreement.py).

        Args:
            bwd_chunk_id: the micro-batch index.
            loss: the micro-batch's loss (the last stage).
            full_backward: weights and inputs at once (the supported schedules' only kind).
            last_backward: the stage's last backward of the step (set by the schedule).
        """
        if self._rank_stages.error is None:
            try:
                return super().backward_one_chunk(bwd_chunk_id, loss, full_backward,
                                                  last_backward)
            except Exception as e:
                self._failed(e)
        self.fwd_cache.pop(bwd_chunk_id, None)
        n = len(self._stage_meta.inputs or ())
        self.bwd_cache[bwd_chunk_id] = tuple(self._nan_grad(i) for i in range(n))

    def _nan_grad(self, i: int):
        try:
            meta = self._get_grad_send_meta(i)
        except Exception:  # noqa: BLE001 (no recv allocated: torch sends nothing for it)
            return None
        return None if meta is None else _nan_like(meta, self.device)

    def _backward_metadata_inference(self, *args, **kwargs):
        """torch's shape inference at the first step runs a backward (autograd.grad to the
        inputs): under no_sync(), or stage 3's hooks would take it for a backward of the step
        and reduce-scatter its (zero) grads outside the step's one reduction. It gives no
        param a gradient, so it need not go through the loss scale either (fp16: stage 3's
        hooks would otherwise count it as an unscaled backward)."""
        gs = self.optimizer.grad_sync
        required, gs.require_scaled = gs.require_scaled, False
        try:
            with self.optimizer.no_sync():
                return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            gs.require_scaled = required

    def _post_metadata_inference_cleanup(self) -> None:
        """After the shape inference (all of the rank's stages): its forwards' graphs are
        gone, so stage 3 forgets their calls (a first stage's had no backward), or their
        counts outlive them into the step's synced backward (Stage3Runtime.forget_calls)."""
        super()._post_metadata_inference_cleanup()
        forget = getattr(self.optimizer.grad_sync, "forget_calls", None)
        if forget is not None:
            forget()

    def _failed(self, error: BaseException) -> None:
        """An error in this rank's forward or backward: post it, drain the rest of the
        schedule step, raise it at the next opt.step() (agreement.py [Note: a failure inside
        the schedule])."""
        if self._stage_meta.outputs is None:  # before shape inference: nothing to drain
            agreement.post_failure(self, error)
            raise error
        self._rank_stages.error = error
        agreement.post_failure(self, error)
        agreement.raise_at_next_step(self.optimizer, error)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        """One micro-batch's backward: under `opt.no_sync()` unless it is the rank's last of
        the step ([Note: one reduction per schedule step]), from the scaled loss at the last
        stage ([Note: the loss scale through the pipeline]).

        Args:
            backward_type: "full" (the supported schedules' only kind).
            bwd_kwargs: torch's stage output, output grads and input values.
            last_backward: the stage's last backward of the step (set by the schedule).

        Returns:
            torch's (input grads, param groups).
        """
        if backward_type != "full":
            raise ValueError(f"ZeroPipelineStage: a split backward ({backward_type!r}) is not "
                             "supported (zero-bubble schedules); use one of "
                             f"{agreement.SUPPORTED_SCHEDULES}")
        opt = self.optimizer
        bwd_kwargs = dict(bwd_kwargs)
        if self.is_last:
            loss = bwd_kwargs["stage_output"]
            if self._fold != 1:
                loss = loss / self._fold
            bwd_kwargs["stage_output"] = opt.scale_loss(loss)
        else:
            for t in _tensors(bwd_kwargs["stage_output"]):
                opt.grad_sync.mark_scaled_loss(t)
        sync = False
        if last_backward:
            rs = self._rank_stages
            rs.done.add(self.stage_index)
            mine = {s.stage_index for s in self._stages_of_step()}
            sync = mine <= rs.done
        if sync:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with opt.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _stages_of_step(self) -> list:
        """This optimizer's stages that the running schedule drives on this rank."""
        schedule = None if self._schedule is None else self._schedule()
        if schedule is None:
            return [self]
        return [s for s in agreement.schedule_stages(schedule)
                if getattr(s, "optimizer", None) is self.optimizer]
