"""Construction as a decision (issue 35): what a `ZeroOptimizer` will be, decided and validated
once, before anything is changed; the optimizer and its layers are then built from it.

[Note: construction is a decision]
`decide` takes the constructor's arguments and returns a frozen `Decision`: the stage and its
pattern, the precision, the rule resolved once per param group, the trainable params of each
group, the parallel plan (comm/plan.py [Note: one parallel plan]: the groups and their roles),
the stage-3 units, the loss scaler, and the offload and keep options in their checked form.
Every check a user's input can fail runs inside it, so a mistake is a ValueError/TypeError
before the model is touched (DESIGN's first rule). The only effects it has are ones that
change no user state: torch's param-group normalization (`torch.optim.Optimizer.__init__`,
which fills `opt.param_groups`), and the process groups of the plan, made by one collective
decision that every rank takes together (`check_same_everywhere` first, so a rank whose
layout differs raises on every rank instead of hanging one of them).

The build that follows (`ZeroOptimizer.__init__`, after `decide`) makes no decision of its
own: it reads the Decision, as do the layers it builds (the placement, stage 3's buffers and
runtime, accounting through `opt.plan`). A new option is one field here, checked once, read
where it acts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from zerokern.comm.device_check import check_params_backend
from zerokern.comm.mesh import (
    check_mesh,
    check_same_everywhere,
    check_world_tp,
    make_comm,
    pipeline_comm,
    split_world_mesh,
)
from zerokern.comm.plan import ParallelPlan, check_hpz_roles, role_sizes
from zerokern.comm.quantized import check_quantized
from zerokern.comm.tp import check_tensor_parallel, make_tensor_parallel
from zerokern.core.loss_scale import make_loss_scaler
from zerokern.core.model_sync import check_same_on_ranks, model_tensors
from zerokern.kernels import blockquant
from zerokern.kernels.param_codec import ParamCodec, check_param_format, make_param_codec
from zerokern.layout.flat_group import FlatGroup
from zerokern.layout.stages import StagePattern, pattern
from zerokern.options.args import (
    check_arguments,
    check_groups,
    check_rule_support,
    frozen_params,
)
from zerokern.rules import Rule, check_defaults_keys, check_rule, combine, slot_align
from zerokern.stage3.activation_policy import check_policy_target
from zerokern.stage3.build import check_stage3


@dataclass(frozen=True)
class Decision:
    """Everything construction decides ([Note: construction is a decision]).

    Attributes:
        stage, precision, dtype: the ZeRO stage, the precision name and the params' dtype.
        pattern: what the stage keeps (layout/stages.py).
        reduce_dtype: the dtype grads are reduced in.
        rule: the one rule, or the param groups' combined rules (reports, checkpoints).
        rules: each param group's rule, resolved once.
        per_group: the rules given per group, or None for one rule.
        trainable: each group's trainable params (frozen ones and duplicates left out).
        to_cast: frozen params the forward runs with, cast to `dtype` by the build.
        model: the nn.Module given, or None for params.
        listed: every param of the groups, frozen ones too (the ranks' start from rank 0).
        plan: the parallel plan (roles, groups, agreement).
        units: stage 3's units, else None.
        scaler: the loss scaler.
        act_mode: activation checkpointing's mode, or None.
        param_codec: how the params are stored given the fp32 master (`param_format=`;
            kernels/param_codec.py), handed to every buffer through the placement.
    """

    stage: int
    precision: str
    dtype: torch.dtype
    pattern: StagePattern
    reduce_dtype: torch.dtype
    rule: Rule
    rules: List[Rule]
    per_group: Optional[List[Rule]]
    trainable: List[List[torch.nn.Parameter]]
    to_cast: List[torch.nn.Parameter]
    model: Optional[torch.nn.Module]
    listed: List[Dict[str, Any]]
    plan: ParallelPlan
    units: Optional[list]
    scaler: Any
    max_grad_norm: Optional[float]
    backend: str
    offload: Optional[str]
    offload_path: Any
    offload_params: Optional[str]
    master: str
    bucket_bytes: float
    keep_for_backward_bytes: float
    free_grads: bool
    broadcast_params: bool
    act_mode: Optional[str]
    param_codec: ParamCodec

    @property
    def comm(self):
        """The data-parallel communicators (the plan's)."""
        return self.plan.comm

    @property
    def slot_aligns(self) -> List[int]:
        """Each group's slot alignment (geometry/partition.py [Note: block-aligned slots])."""
        return [slot_align(r) for r in self.rules]


def decide(opt: torch.optim.Optimizer, params_or_model: Union[torch.nn.Module, Iterable],
           rule: Union[Rule, Sequence[Rule]], defaults: Dict[str, Any], *, stage: int,
           precision: str, loss_scale: Any, max_grad_norm: Optional[float],
           offload: Optional[str], bucket_mb: float, reduce_dtype: Optional[torch.dtype],
           process_group, backend: str, param_groups, units, offload_path, free_grads: bool,
           offload_params: Optional[str], master: str, mesh, hpz: bool,
           quantized_weights: bool, quantized_gradients, keep_for_backward_mb: float,
           broadcast_params: bool, activation_checkpointing: Optional[str],
           param_format: Optional[str] = None) -> Decision:
    """Validate the constructor's arguments and decide the optimizer's plan, changing no user
    state ([Note: construction is a decision]); fills `opt.param_groups` (torch's
    normalization). Raises ValueError/TypeError naming the argument, on every rank where the
    mistake is collective."""
    act_mode = check_policy_target(activation_checkpointing, params_or_model,
                                   units if stage == 3 else None)
    if not isinstance(broadcast_params, bool):
        raise TypeError(f"broadcast_params must be True or False, got "
                        f"{type(broadcast_params).__name__}")
    per_group = None
    if isinstance(rule, (list, tuple)):  # one rule per param group
        if not rule:
            raise ValueError("rule must be a Rule or a non-empty list of Rules")
        per_group = [check_rule(r) for r in rule]
        rule = combine(per_group)
    rule = check_rule(rule)
    dtype, offload_path, params = check_arguments(
        params_or_model, stage=stage, precision=precision,
        rule=None if per_group is not None else rule, defaults=defaults,
        max_grad_norm=max_grad_norm, offload=offload, offload_path=offload_path,
        bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, backend=backend, units=units,
        param_groups=param_groups, process_group=process_group, free_grads=free_grads,
        offload_params=offload_params, master=master,
        keep_for_backward_mb=keep_for_backward_mb)
    if per_group is not None:  # zerokern.rules [Note: a rule's keys]
        check_defaults_keys(per_group, defaults)
    # torch's param-group normalization (raises if empty); ZeroOptimizer derives from
    # torch.optim.Optimizer directly, so this is its super().__init__
    torch.optim.Optimizer.__init__(opt, params, dict(defaults))
    if per_group is not None and len(per_group) != len(opt.param_groups):
        raise ValueError(f"rule: {len(per_group)} rules for {len(opt.param_groups)} "
                         "param groups; give one per group")
    rules = per_group or [rule] * len(opt.param_groups)
    trainable = check_groups(opt.param_groups, dtype, rules, opt._given_keys, opt._group_keys)
    check_rule_support(rules, offload, master)
    to_cast = frozen_params(opt.param_groups, params_or_model, dtype, stage)
    # a world mesh (named pp / tp / cp dims): ZeRO over its data-parallel dims, the others in
    # the plan ([Note: a world mesh] in comm/mesh.py)
    world_mesh = mesh
    mesh, model_dims = split_world_mesh(mesh)  # ValueError
    shape = check_mesh(mesh, process_group, trainable[0][0].device.type)  # ValueError
    # CPU params on an NCCL group, CUDA params on a gloo one: a ValueError naming the fix
    check_params_backend(trainable[0][0].device, process_group, mesh, type(opt).__name__)
    check_hpz_roles(hpz, shape, stage, offload_params)
    qwz, qgz_bits = check_quantized(quantized_weights, quantized_gradients, stage,
                                    offload_params)
    # FP8 params: stage 3, a 16-bit precision, none of the options that keep or send the
    # shard otherwise (kernels/param_codec.py [Note: FP8 params with an agreed scale])
    check_param_format(param_format, dtype, stage, offload=(None, offload),
                       offload_params=(None, offload_params), master=("fp32", master),
                       hpz=(False, hpz), quantized_weights=(False, qwz))
    codec_for = functools.partial(blockquant.codec_for, backend=backend)
    if qwz or qgz_bits is not None:  # ValueError on CUDA without Triton
        codec_for(trainable[0][0].device)
    # DTensor (tensor-parallel) params: ZeRO over the dp mesh only (comm/tp.py)
    tp_checked = check_tensor_parallel(trainable, to_cast, dtype, precision, mesh,
                                       process_group)
    check_world_tp(world_mesh, model_dims, tp_checked)  # ValueError
    # one all-gather of the layout, ValueError on every rank if it differs
    check_same_everywhere(mesh, process_group, hpz, stage, quantized_weights=qwz,
                          quantized_gradients=qgz_bits)
    comm = make_comm(process_group, mesh, hpz, qwz, qgz_bits, codec_for)
    model = params_or_model if isinstance(params_or_model, torch.nn.Module) else None
    # [Note: ranks start from the first rank's weights] (model_sync.py): opted out, the ranks'
    # params and buffers must agree already (a ValueError before any change)
    listed = [{"params": list(g["params"])} for g in opt.param_groups]  # frozen too
    if not broadcast_params:
        check_same_on_ranks(model_tensors(listed, model), comm.world)
    tp = make_tensor_parallel(tp_checked, comm.stats)
    plan = ParallelPlan(comm, role_sizes(
        shape, hpz, comm.world.world_size, tp=1 if tp is None else tp.comm.world_size,
        pp=model_dims.get("pp", 1)), tp, pipeline_comm(world_mesh, model_dims, comm.stats))
    # the params' codec; FP8's per-param scales agreed (MAX) over the data-parallel world
    param_codec = make_param_codec(dtype, param_format, functools.partial(
        plan.agree_, op=torch.distributed.ReduceOp.MAX, model=False,
        label="fp8 param scales"))
    P = pattern(stage)  # what the stage keeps (stages.py)
    unit_list = None
    if P.shards_params:
        unit_list = check_stage3(params_or_model, units, trainable, dtype,
                                 comm.shard.world_size, offload, offload_path,
                                 offload_params, per_group or rule)
    elif offload == "nvme":  # a disk too small for the state files: before any change
        from zerokern.state.nvme_state import check_free_space
        from zerokern.state.offload_nvme import NvmeOffloader

        check_free_space(offload_path, NvmeOffloader.disk_need(per_group or rule, [
            P.state_numel(FlatGroup.layout_of(ps, dtype, comm.shard.world_size,
                                              bucket_mb * 2**20, slot_align(r)))
            for ps, r in zip(trainable, rules)]))
    scaler = make_loss_scaler(loss_scale, precision, trainable[0][0].device)
    return Decision(
        stage=stage, precision=precision, dtype=dtype, pattern=P,
        reduce_dtype=reduce_dtype or dtype, rule=rule, rules=rules, per_group=per_group,
        trainable=trainable, to_cast=to_cast, model=model, listed=listed, plan=plan,
        units=unit_list, scaler=scaler,
        max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
        backend=backend, offload=offload, offload_path=offload_path,
        offload_params=offload_params, master=master, bucket_bytes=bucket_mb * 2**20,
        keep_for_backward_bytes=keep_for_backward_mb * 2**20, free_grads=free_grads,
        broadcast_params=broadcast_params, act_mode=act_mode,
        param_codec=param_codec)
