"""ZeroMuon: the ZeRO engine (optimizer.ZeroOptimizer) with a rule per param group: Muon
(zerokern.rules.muon) for the matrices, AdamW (zerokern.rules.adamw) for the rest; equal to
single-process `torch.optim.Muon` + `torch.optim.AdamW` over the same split.

[Note: which params Muon takes]
Muon is for the hidden layers' matrices. The default split, decided before the engine touches
the model (so from each param's own shape, never a flat buffer's: stage 3 flattens, and a param
already held by a stage-3 zerokern optimizer is looked up in its layout):
- Muon: every param with >= 2 dims that is not the weight of an nn.Embedding / EmbeddingBag of
  the model (a head tied to the embedding is the same Parameter, so it is excluded too) nor
  the output head: a Hugging Face model's `get_output_embeddings()`, or a submodule named
  `lm_head` (DeepSpeed 0.19's default split excludes names with "embed" or "lm_head");
- AdamW: the rest (biases, norms, embeddings, the head). An output head under another name is
  a matrix and goes to Muon by this rule: give it a group with `use_muon=False`.
With bare params (no model) embeddings cannot be told apart: only the >= 2-D rule applies.
A param group with `use_muon` is taken as it is (True: every param must have >= 2 dims, else a
ValueError naming it); a group without it is split in two, its Muon params then its AdamW
params (empty halves dropped), so `opt.param_groups` may hold more groups than were given;
each group has `use_muon` set. Params with more than 2 dims are orthogonalized as the
(shape[0], prod(shape[1:])) matrix, the lr scaled by that matrix's shape (torch.optim.Muon
takes 2-D params only; this is the usual reshape for convs).
Hyperparameters: a Muon group's keys are torch.optim.Muon's (lr, weight_decay, momentum,
nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, and ns_method), an AdamW group's
torch.optim.AdamW's (lr, betas, eps, weight_decay),
defaulting to `adamw_lr`, `adamw_betas`, `adamw_eps`,
`adamw_weight_decay`. A key of the other rule in a group is a ValueError, never ignored.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from zerokern.core.optimizer import ZeroOptimizer
from zerokern.geometry.dtensor_params import is_dtensor
from zerokern.options.doc import ENGINE_ARGS
from zerokern.rules.adamw import ADAMW
from zerokern.rules.muon import MUON, MUON_KEYS, embedding_weight_ids, takes_muon
from zerokern.rules.muon_orthogonalize import EPS, NS_COEFFICIENTS, NS_STEPS

ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw")
_MUON_ONLY = tuple(k for k in MUON_KEYS if k not in ADAMW_KEYS)
_ADAMW_ONLY = tuple(k for k in ADAMW_KEYS if k not in MUON_KEYS)


def original_shape(p: torch.Tensor) -> tuple:
    """p's shape as the model defines it: a param held by a live stage-3 zerokern optimizer is
    a 0-element placeholder between uses; its shape is in that optimizer's layout."""
    ref = getattr(p, "_zerokern_sync", None)
    owner = ref() if ref is not None else None
    if owner is not None and not owner.detached:
        for g in owner.groups:
            for q, s in zip(g.params, g.layout.slots):
                if q is p:
                    return tuple(s.shape)
    return tuple(p.shape)


def split_groups(groups: List[Dict[str, Any]], model: Optional[torch.nn.Module],
                 muon_defaults: Dict[str, Any],
                 adamw_defaults: Dict[str, Any]) -> List[Dict[str, Any]]:
    """[Note: which params Muon takes]: complete group dicts, each with `use_muon`.

    Raises:
        ValueError: a use_muon=True group holding a param with fewer than 2 dims, a group key
            of the other rule, or `use_muon` not a bool.
    """
    embeds = embedding_weight_ids(model)
    out = []
    for gi, group in enumerate(groups):
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        extra = {k: v for k, v in group.items() if k != "params"}
        if any(k.startswith("adamw_") for k in extra):
            keys = sorted(k for k in extra if k.startswith("adamw_"))
            raise ValueError(f"param group {gi} has {keys}: in a group use the rule's own "
                             "keys (lr, betas, eps, weight_decay for AdamW groups)")
        use = extra.pop("use_muon", None)
        if use is None:
            def takes(p):
                return p.requires_grad and takes_muon(original_shape(p), id(p) in embeds)

            muon = [p for p in ps if takes(p)]
            adam = [p for p in ps if not takes(p)]
            if muon and not any(p.requires_grad for p in adam):
                muon, adam = muon + adam, []  # frozen params only: they ride with Muon's
            halves = [(True, muon), (False, adam)]
        elif isinstance(use, bool):
            halves = [(use, ps)]
        else:
            raise ValueError(f"param group {gi}: use_muon must be a bool, got {use!r}")
        for is_muon, part in halves:
            if not part and use is None:
                continue
            if is_muon and any(is_dtensor(p) and p.requires_grad for p in part):
                # a tensor-parallel param holds only this rank's tp shard of the matrix:
                # orthogonalizing the shard is not Muon (it would be silently wrong)
                raise ValueError(f"param group {gi}: a DTensor (tensor-parallel) param takes "
                                 "Muon, which orthogonalizes whole matrices, but this rank "
                                 "holds only its tp shard; give it a use_muon=False group")
            if is_muon:  # frozen params are never updated: only the trainable ones count
                bad = [original_shape(p) for p in part
                       if p.requires_grad and len(original_shape(p)) < 2]
                if bad:
                    raise ValueError(f"param group {gi} has use_muon=True but holds a param of "
                                     f"shape {bad[0]}: Muon needs >= 2-D params (give 1-D "
                                     "ones to a use_muon=False group)")
                wrong, base = [k for k in extra if k in _ADAMW_ONLY], muon_defaults
            else:
                wrong, base = [k for k in extra if k in _MUON_ONLY], adamw_defaults
            if wrong:
                raise ValueError(f"param group {gi}: {wrong} are not "
                                 f"{'Muon' if is_muon else 'AdamW'} hyperparameters (this "
                                 f"group's params use {'Muon' if is_muon else 'AdamW'})")
            out.append({**base, **extra, "params": part, "use_muon": is_muon})
    return out


class ZeroMuon(ZeroOptimizer):
    _group_keys = ("use_muon",)  # [Note: which params Muon takes]
    __doc__ = """Muon with ZeRO sharding: `torch.optim.Muon` for the matrices and
    `torch.optim.AdamW` for the other params, each rank orthogonalizing a disjoint,
    FLOP-balanced set of whole matrices (zerokern.rules.muon [Note: the Muon group step]).
    Which params take Muon: zerokern.optimizers.muon [Note: which params Muon takes] (>= 2-D
    and not an embedding; a param group's `use_muon` overrides). Every offload (None, "cpu",
    "nvme": the momentum and the master streamed through the NVMe files in two passes) and
    master="compact" (bf16) run Muon's update bit for bit as on the device with an fp32
    master (zerokern.rules [Note: what a rule supports]).

    Args:
        params_or_model: params or param-group dicts (stages 0-2), or an nn.Module (needed to
            tell embeddings apart, and for stage 3).
        lr: Muon's learning rate, as torch.optim.Muon (default 1e-3); per group.
        weight_decay: Muon's decoupled weight decay (default 0.1); per group.
        momentum: Muon's momentum (default 0.95); per group.
        nesterov: Nesterov momentum (default True); per group.
        ns_coefficients: (a, b, c) of the quintic Newton-Schulz iteration (default torch's
            (3.4445, -4.775, 2.0315)); per group.
        eps: floor of the norm Newton-Schulz divides by (default 1e-7); per group.
        ns_steps: Newton-Schulz iterations (default 5, < 100); per group.
        adjust_lr_fn: None / "original" (lr·sqrt(max(1, A/B))) or "match_rms_adamw"
            (lr·0.2·sqrt(max(A, B))), torch's; per group.
        ns_method: "standard" (torch.optim.Muon's iteration in bf16, the default) or "gram"
            (DeepSpeed 0.19's default: its Gram Newton-Schulz, fp16 on CUDA, fp32 elsewhere;
            zerokern.rules.muon_orthogonalize [Note: Newton-Schulz methods]); per group.
        adamw_lr: lr of the AdamW groups (default 1e-3).
        adamw_betas: betas of the AdamW groups (default (0.9, 0.999)).
        adamw_eps: eps of the AdamW groups (default 1e-8).
        adamw_weight_decay: decoupled weight decay of the AdamW groups (default 0.01, torch's
            AdamW default).""" + ENGINE_ARGS + """
    Raises:
        ValueError: a bad hyperparameter (naming it), a use_muon=True group holding a param
            with fewer than 2 dims, or an argument a group's rule does not support (naming
            the argument and the rule).
    """

    def __init__(
        self,
        params_or_model: Union[torch.nn.Module, Iterable],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients=NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        ns_method: str = "standard",
        adamw_lr: float = 1e-3,
        adamw_betas=(0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        stage: int = 2,
        precision: str = "bf16",
        loss_scale: Any = "dynamic",
        max_grad_norm: Optional[float] = None,
        offload: Optional[str] = None,
        bucket_mb: float = 25.0,
        reduce_dtype: Optional[torch.dtype] = None,
        process_group=None,
        backend: str = "auto",
        *,
        param_groups: Optional[List[Dict[str, Any]]] = None,
        units=None,
        offload_path=None,
        free_grads: bool = False,
        offload_params: Optional[str] = None,
        master: str = "fp32",
        mesh=None,
        hpz: bool = False,
        quantized_weights: bool = False,
        quantized_gradients: Union[bool, str] = False,
        keep_for_backward_mb: float = 0.0,
        broadcast_params: bool = True,
        activation_checkpointing: Optional[str] = None,
    ) -> None:
        if not isinstance(adamw_betas, (tuple, list)):
            raise ValueError(f"adamw_betas must be a pair of numbers in [0, 1), got "
                             f"{adamw_betas!r}")
        muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                             nesterov=nesterov, ns_coefficients=tuple(ns_coefficients)
                             if isinstance(ns_coefficients, (tuple, list)) else ns_coefficients,
                             eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                             ns_method=ns_method)
        adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                              weight_decay=adamw_weight_decay, adamw=True)
        # the defaults' own checks name ZeroMuon's arguments (before any group exists)
        MUON.check_group(muon_defaults)
        try:
            ADAMW.check_group(adamw_defaults)
        except ValueError as e:
            raise ValueError(f"adamw_{e}") from None
        model = params_or_model if isinstance(params_or_model, torch.nn.Module) else None
        if model is not None:
            given = param_groups if param_groups is not None else \
                [{"params": list(model.parameters())}]
            if not isinstance(given, (list, tuple)) or \
                    not all(isinstance(g, dict) and "params" in g for g in given):
                raise TypeError("param_groups must be a non-empty list of dicts with 'params'")
            param_groups = split_groups(list(given), model, muon_defaults, adamw_defaults)
            source = model
        else:
            if isinstance(params_or_model, torch.Tensor):
                raise TypeError("params_or_model must be a model, an iterable of params or of "
                                "param-group dicts, not a single Tensor (as torch's optimizers)")
            given = list(params_or_model)
            if given and not isinstance(given[0], dict):
                given = [{"params": given}]
            if not all(isinstance(g, dict) and "params" in g for g in given):
                raise TypeError("params_or_model must be a model, params, or param-group dicts "
                                "with 'params'")
            source = split_groups(given, None, muon_defaults, adamw_defaults)
        groups = param_groups if model is not None else source
        if not groups:
            raise ValueError("ZeroMuon got no params")
        rules = [MUON if g["use_muon"] else ADAMW for g in groups]
        super().__init__(source, rules, {}, stage, precision, loss_scale, max_grad_norm,
                         offload, bucket_mb, reduce_dtype, process_group, backend,
                         param_groups=param_groups, units=units, offload_path=offload_path,
                         free_grads=free_grads, offload_params=offload_params, master=master,
                         mesh=mesh, hpz=hpz, quantized_weights=quantized_weights,
                         quantized_gradients=quantized_gradients,
                         keep_for_backward_mb=keep_for_backward_mb,
                         broadcast_params=broadcast_params,
                         activation_checkpointing=activation_checkpointing)
