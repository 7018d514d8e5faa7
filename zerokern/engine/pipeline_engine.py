"""DeepSpeed's PipelineEngine surface over zerokern: `engine.train_batch(data_iter)` and
`engine.eval_batch(data_iter)` for a DeepSpeed `PipelineModule` ([Note: a PipelineModule in
zerokern.initialize], engine/pipeline_module.py).

    engine, _, _, _ = zerokern.initialize(model=PipelineModule(layers, num_stages=2,
                                          loss_fn=F.cross_entropy), config=ds_config)
    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches

[Note: one pipeline step]
`train_batch` pulls gradient_accumulation_steps micro-batches `(inputs, labels)` from the
iterator on the first and the last stage (inputs feed the first stage, labels the last
stage's loss_fn, as DeepSpeed), and runs them in the 1F1B order (pipeline_schedule.py):
- forward: the first stage runs its layers on the inputs, the others on the activations
  received from the previous stage (pipeline_p2p.py); the last computes
  loss = loss_fn(outputs, labels) (or takes the output as the loss without a loss_fn);
- backward: the last stage backpropagates loss / gradient_accumulation_steps (times the loss
  scale: `optimizer.backward`), the others their outputs with the gradients received from the
  next stage. The gradient is therefore DeepSpeed's: the sum over micro-batches of
  loss / accumulation, averaged over the data-parallel ranks;
- every backward but the last runs under the optimizer's `no_sync()`: the gradients
  accumulate locally and the last backward reduces them over the stage's data-parallel group
  once per step (stages 2-3: one reduce-scatter per step, not per micro-batch). With tied
  layers (stages 0-1) the last backward runs under no_sync() too, the tied weights' gradients
  are summed over their stages in place (DeepSpeed's ReduceTiedGrads), and `step()` reduces;
- the step: clip to gradient_clipping with the norm over every stage, step, schedule, zero the
  grads (ZeroEngine's boundary), on every rank;
- the returned loss: the mean over the micro-batches on the last stage, averaged over the
  data-parallel ranks and broadcast over the pipeline, so every rank returns the same 0-d
  float32 tensor (DeepSpeed's `agg_train_loss`).

[Note: stage 3 across the micro-batches]
By default stage 3 gathers the units each micro-batch's forward and backward run, as any
forward and backward does (per train_batch: about two all-gathers per unit per micro-batch),
and holds only the units in use. `engine.keep_gathered = True` gathers the stage's params once
when train_batch begins and releases them after its last backward (the optimizer's
gather_all / release_all, as zerokern.pipelining's ZeroPipelineStage(keep_gathered=True) and
torchtitan's reshard_after_forward=False for pipelining): one all-gather per unit per step
whatever the number of micro-batches, for the whole stage held through the step. The
reduce-scatters are once per step either way.

[Note: why not torch.distributed.pipelining here]
zerokern.pipelining's ZeroPipelineStage (torch's PipelineStage and schedules over a zerokern
optimizer) is for a model the user splits. A DeepSpeed PipelineModule comes with a contract
torch's schedules do not keep: micro-batches pulled one by one from an iterator (inputs on the
first stage, labels on the last; torch's `schedule.step` splits one batch into chunks), tuples
holding non-float tensors (masks) between stages, DeepSpeed's grid as the process groups, and
the tied weights' gradients summed between the last backward and the data-parallel reduction.
So the engine runs its own 1F1B (pipeline_schedule.py) with the same ZeRO mechanisms
ZeroPipelineStage uses: every backward but the last under no_sync(), the non-last stages'
backwards marked as scaled, the norm and overflow agreed over the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import EngineConfig
from .engine import ZeroEngine
from .pipeline_checkpoint import attach_stage_coord
from .pipeline_module import PipeLayout, reentrant_checkpointing
from .pipeline_p2p import StageLink, _as_tuple, floating
from .pipeline_schedule import FORWARD, train_order

log = logging.getLogger("zerokern.engine")


class PipelineModeError(RuntimeError):
    """forward/backward/step on a pipeline engine: only train_batch() and eval_batch() run a
    PipelineModule (DeepSpeed raises its PipelineError there)."""


def _repeat(loader):
    """DeepSpeed's RepeatingLoader: the loader again from its start when it runs out."""
    while True:
        yield from loader


class PipelineEngine(ZeroEngine):
    """ZeroEngine for a DeepSpeed PipelineModule: `train_batch` / `eval_batch` ([Note: one
    pipeline step]); build it with `zerokern.initialize(model=PipelineModule(...))`.

    Attributes (besides ZeroEngine's): `num_stages`, `stage_id`, `micro_batches`,
    `micro_batch_size`, `grid` (the module's PipelineParallelGrid), `agg_train_loss` (the last
    train_batch's loss), `data_iterator`, `keep_gathered` (stage 3: hold the stage's params
    gathered through each train_batch; default False: [Note: stage 3 across the
    micro-batches]).

    Args:
        model: the PipelineModule.
        optimizer: its zerokern optimizer over the stage's data-parallel group, or None
            (forward only: eval_batch).
        cfg: the parsed config.
        layout: the PipeLayout (engine/pipeline_module.py).
        lr_scheduler: stepped after each train_batch's optimizer step, or None.
        training_data: a Dataset: the first and last stages then read micro-batches from a
            repeating loader over it (a DistributedSampler over the data-parallel ranks,
            in order, as DeepSpeed's), or None.
        collate_fn: that loader's collate_fn.
    """

    def __init__(self, model: nn.Module, optimizer, cfg: EngineConfig, layout: PipeLayout,
                 lr_scheduler=None, training_data=None, collate_fn=None) -> None:
        super().__init__(model, optimizer, cfg, lr_scheduler, None)
        self.layout = layout
        self.grid = model.mpu()
        self.num_stages = layout.num_stages
        self.stage_id = layout.stage_id
        self.micro_batches = cfg.gradient_accumulation_steps
        self.micro_batch_size = cfg.micro_batch_size
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.data_iterator = None
        self.batch_fn = None
        self.link = StageLink(layout.prev_rank, layout.next_rank, self.device)
        self.keep_gathered = False  # [Note: stage 3 across the micro-batches]
        self._data_checked = False  # _check_data: the first call agrees over the pipeline
        if optimizer is not None:  # [Note: a PipelineModule checkpoint]
            attach_stage_coord(optimizer, layout)
        if training_data is not None:
            sampler = torch.utils.data.distributed.DistributedSampler(
                training_data, num_replicas=layout.dp_size, rank=layout.dp_rank, shuffle=False)
            loader = torch.utils.data.DataLoader(training_data, batch_size=self.micro_batch_size,
                                                 sampler=sampler, collate_fn=collate_fn)
            self.set_dataloader(loader)

    # ---- DeepSpeed's PipelineEngine accessors -----------------------------------------------
    def is_first_stage(self) -> bool:
        """True on the pipeline's first stage (it reads the inputs)."""
        return self.layout.is_first

    def is_last_stage(self) -> bool:
        """True on the pipeline's last stage (it reads the labels and computes the loss)."""
        return self.layout.is_last

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.stage_id

    def set_dataloader(self, loader) -> None:
        """Read micro-batches from `loader`, repeated (first and last stages only).

        Args:
            loader: an iterable of (inputs, labels) micro-batches.
        """
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = _repeat(loader)

    def set_dataiterator(self, iterator) -> None:
        """Read micro-batches from `iterator` (first and last stages only).

        Args:
            iterator: an iterator of (inputs, labels) micro-batches.
        """
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        """Apply `fn` to each micro-batch read (DeepSpeed's post-processing hook).

        Args:
            fn: batch -> batch.
        """
        self.batch_fn = fn

    def forward(self, *args, **kwargs):
        """Refused: a pipeline runs through train_batch() / eval_batch() (as DeepSpeed);
        *args / **kwargs are not read."""
        raise PipelineModeError("a PipelineModule engine runs only train_batch() and "
                                "eval_batch() (as DeepSpeed's PipelineEngine)")

    def backward(self, *args, **kwargs):
        """Refused, as forward(); *args / **kwargs are not read."""
        self.forward()

    def step(self, *args, **kwargs):
        """Refused, as forward(); *args / **kwargs are not read."""
        self.forward()

    def _no_mpu(self, what: str) -> None:
        """The grid is the engine's mpu, and its checkpoints are in parts, one per stage
        ([Note: a PipelineModule checkpoint], engine/pipeline_checkpoint.py): allowed."""

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[Dict[str, Any]] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: Optional[bool] = None) -> bool:
        """Collective over every rank of every stage: ZeroEngine's save_checkpoint
        (engine/checkpointing.py: `save_dir/<tag>/zero/`, `latest`, the counters, scheduler
        and client_state), one part per stage, by the global layer names ([Note: a
        PipelineModule checkpoint]).

        Args:
            save_dir: as ZeroEngine.save_checkpoint.
            tag: as ZeroEngine.save_checkpoint.
            client_state: as ZeroEngine.save_checkpoint.
            save_latest: as ZeroEngine.save_checkpoint.
            exclude_frozen_parameters: as ZeroEngine.save_checkpoint.
            async_save: as ZeroEngine.save_checkpoint.

        Returns:
            True.
        """
        return super().save_checkpoint(save_dir, tag, client_state, save_latest,
                                       exclude_frozen_parameters, async_save)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Collective: ZeroEngine's load_checkpoint, by parameter name, from a checkpoint of
        any pipeline layout (or of the same layers without a pipeline): [Note: a
        PipelineModule checkpoint].

        Args:
            load_dir: as ZeroEngine.load_checkpoint.
            tag: as ZeroEngine.load_checkpoint.
            load_module_strict: as ZeroEngine.load_checkpoint.
            load_optimizer_states: as ZeroEngine.load_checkpoint.
            load_lr_scheduler_states: as ZeroEngine.load_checkpoint.
            load_module_only: as ZeroEngine.load_checkpoint.

        Returns:
            (path, client_state), or (None, None) when nothing is found.
        """
        return super().load_checkpoint(load_dir, tag, load_module_strict,
                                       load_optimizer_states, load_lr_scheduler_states,
                                       load_module_only)

    # ---- the schedule -----------------------------------------------------------------------
    def _check_data(self, what: str) -> None:
        """ValueError when the first or last stage has no data. At the first call the stages
        agree on it (one all-reduce over the pipeline), so that a middle stage raises too
        instead of waiting for activations that never come."""
        missing = (self.is_first_stage() or self.is_last_stage()) and self.data_iterator is None
        if not self._data_checked and self.num_stages > 1:
            self._data_checked = True
            flag = torch.tensor([int(missing)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.layout.pipe_group)
            missing = bool(flag.item())
        if missing:
            raise ValueError(f"{what}: no data on the first or last stage: pass data_iter (an "
                             "iterator of (inputs, labels) micro-batches) or training_data= to "
                             "initialize")

    def _next_batch(self):
        batch = next(self.data_iterator) if self.data_iterator is not None else None
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if batch is not None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError("a pipeline micro-batch must be (inputs, labels), got "
                            f"{type(batch).__name__}")
        return batch

    def _to_device(self, x, grad: bool):
        def one(t):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"pipeline inputs/labels must be tensors or tuples of tensors, "
                                f"got {type(t).__name__}")
            t = t.detach().clone().to(self.device)
            return t.requires_grad_(grad and t.is_floating_point())
        return one(x) if isinstance(x, torch.Tensor) else tuple(one(t) for t in x)

    def _forward(self, i: int, bufs: Dict[int, Any], losses: List[torch.Tensor],
                 compute_loss: bool, outputs: Optional[List[Any]] = None) -> None:
        batch = self._next_batch() if (self.is_first_stage() or self.is_last_stage()) else None
        if self.is_first_stage():
            x = self._to_device(batch[0], grad=reentrant_checkpointing(self.module))
        else:
            x = self.link.recv_activations()
        # a copy into the layers, so in-place layer ops leave the received leaf (whose .grad is
        # sent back) intact, as DeepSpeed's
        xs, kind = _as_tuple(x, "a pipeline stage's input")
        feed = xs[0].clone() if kind == 0 else tuple(t.clone() for t in xs)
        out = self.module(feed)
        if not self.is_last_stage():
            self.link.send_activations(out)
            bufs[i] = (x, out)
            return
        loss = out
        if compute_loss and self.module.loss_fn is not None:
            loss = self.module.loss_fn(out, self._to_device(batch[1], grad=False))
        if outputs is not None:
            outputs.append(out)
        if not isinstance(loss, torch.Tensor):
            raise TypeError("the pipeline's loss (loss_fn(outputs, labels), or the last "
                            f"stage's output without a loss_fn or with compute_loss=False) "
                            f"must be a tensor, got {type(loss).__name__}")
        losses.append(loss.detach())
        bufs[i] = (x, loss)

    def _backward(self, i: int, bufs: Dict[int, Any]) -> None:
        x, out = bufs.pop(i)
        opt = self.optimizer
        if self.is_last_stage():
            gas = self.micro_batches
            opt.backward(out / gas if gas > 1 else out)
        else:
            outs = floating(_as_tuple(out, "a pipeline stage's output")[0])
            grads = self.link.recv_grads(out)
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            for o, _ in pairs:  # the gradient arrives scaled by the loss scale
                opt.grad_sync.mark_scaled_loss(o)
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.is_first_stage():
            self.link.send_grads(x)

    def _reduce_tied_grads(self) -> None:
        """DeepSpeed's ReduceTiedGrads: the local (not yet data-parallel reduced) gradient of
        each tied weight summed over the stages holding it, in place ([Note: a PipelineModule
        in zerokern.initialize]: stages 0-1, where p.grad views the whole accumulated grad)."""
        for w, group in self.layout.tied:
            g = w.grad if w.grad is not None else torch.zeros_like(w)
            dist.all_reduce(g, group=group)  # every stage joins, or its peers would hang
            if w.grad is None:  # this stage's tied layer did not use the weight this step
                raise RuntimeError("a tied weight (TiedLayerSpec) got no gradient on stage "
                                   f"{self.stage_id} this step: zerokern sums the tied "
                                   "gradients in place and needs every stage to use it")

    def _aggregate(self, values: List[torch.Tensor], n: int, bcast: bool = True):
        """The element-wise mean of the last stage's `values` over the `n` micro-batches,
        averaged over the data-parallel ranks (DeepSpeed's reduce 'avg'); with `bcast`
        (a 0-d loss) broadcast from the last stage over the pipeline as fp32, so every rank
        returns it. Without bcast the other stages return None."""
        agg = None
        if self.is_last_stage():
            # a loss sums in fp32 (DeepSpeed sums in the loss's dtype: an fp16 sum of fp16
            # losses rounds twice); outputs keep their dtype
            agg = torch.stack([v.detach().float() if bcast else v.detach()
                               for v in values]).sum(0) / n
            if self.layout.dp_size > 1:
                dist.all_reduce(agg, group=self.layout.dp_group)
                agg /= self.layout.dp_size
        if not bcast:
            return agg
        agg = agg.float() if agg is not None else \
            torch.zeros((), dtype=torch.float32, device=self.device)
        if self.num_stages > 1:
            dist.broadcast(agg, src=self.layout.last_rank, group=self.layout.pipe_group)
        return agg

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches ([Note: one
        pipeline step]).

        Args:
            data_iter: an iterator of (inputs, labels) micro-batches (read on the first and
                last stages); default: the one set before or the training_data loader.

        Returns:
            The step's loss: the mean over its micro-batches and the data-parallel ranks, the
            same 0-d fp32 tensor on every rank.

        Raises:
            RuntimeError: gradients disabled (use eval_batch), or a forward-only engine.
            ValueError: no data on the first or last stage.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch()")
        self._need_optimizer("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self._check_data("train_batch")
        self.module.train()
        opt = self.optimizer
        M, tied = self.micro_batches, bool(self.layout.tied)
        bufs: Dict[int, Any] = {}
        losses: List[torch.Tensor] = []
        pinned = self.keep_gathered and opt.stage == 3
        if pinned:  # [Note: stage 3 across the micro-batches]
            opt.grad_sync.gather_all()
        for kind, i in train_order(self.num_stages, self.stage_id, M):
            if kind == FORWARD:
                self._forward(i, bufs, losses, compute_loss=True)
                continue
            last = i == M - 1 and not tied
            with contextlib.nullcontext() if last else opt.no_sync():
                self._backward(i, bufs)
        if pinned:
            opt.grad_sync.release_all(write_back=False)
        self.link.drain()
        if tied:
            self._reduce_tied_grads()
        self.micro_steps += M
        self._optimizer_step()
        self.agg_train_loss = self._aggregate(losses, M)
        if self.global_rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            log.info("step=%d loss=%.6f", self.global_steps, float(self.agg_train_loss))
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: Optional[str] = "avg", bcast_loss: bool = True,
                   num_micro_batches: Optional[int] = None):
        """Forward passes only, over gradient_accumulation_steps (or num_micro_batches)
        micro-batches from `data_iter`, as DeepSpeed's eval_batch.

        Args:
            data_iter: an iterator of (inputs, labels) micro-batches.
            return_logits: also return the last micro-batch's outputs (last stage; None
                elsewhere).
            compute_loss: apply the module's loss_fn (else the outputs are reduced).
            reduce_output: "avg" (the mean over micro-batches and data-parallel ranks) or None
                (the list of per-micro-batch values, last stage).
            bcast_loss: broadcast the averaged loss from the last stage over the pipeline.
            num_micro_batches: micro-batches to evaluate (default: gradient accumulation).

        Returns:
            The loss (0-d fp32 tensor; on every rank with bcast_loss and compute_loss, else
            on the last stage and None elsewhere; without compute_loss the mean outputs), or
            (that, the last micro-batch's outputs) with return_logits.

        Raises:
            ValueError: reduce_output not "avg" or None, or no data on the first/last stage.
        """
        if reduce_output is not None and str(reduce_output).lower() != "avg":
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got "
                             f"{reduce_output!r}")
        M = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        saved = self.data_iterator
        self.set_dataiterator(data_iter)
        try:
            self._check_data("eval_batch")
            self.module.eval()
            bufs: Dict[int, Any] = {}
            values: List[torch.Tensor] = []
            outputs: List[Any] = []
            with torch.no_grad():
                for i in range(M):
                    self._forward(i, bufs, values, compute_loss, outputs)
                    bufs.clear()
            self.link.drain()
        finally:
            if self.is_first_stage() or self.is_last_stage():
                self.data_iterator = saved
        if reduce_output is None:
            result = values if self.is_last_stage() else None
        else:
            result = self._aggregate(values, M, bcast=compute_loss and bcast_loss)
        if return_logits:
            return result, (outputs[-1] if outputs else None)
        return result
