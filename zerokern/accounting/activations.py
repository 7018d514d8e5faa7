"""The activation bytes of one training forward, by trace (issue 37: ZeRO-R's residual states).

[Note: the activation trace]
No per-layer formula: the model's forward (and its loss) runs under torch's FakeTensorMode
with CPU fake tensors, so every op runs its real shape logic and picks the same kernel a CPU
run picks (scaled_dot_product_attention -> the fused flash kernel, which saves its output and
a logsumexp, not the t x t scores), and nothing is allocated. A dispatch mode records the
storage of every tensor an op creates (by weak reference); what is still alive when the
forward has returned the loss is what autograd holds for backward: saved tensors, the inputs
a checkpoint holds for its recompute, the outputs a selective policy kept. The params and the
inputs (alive before) are not counted. The same meter over a real CPU run is the measurement
(`measure`); tests/accounting/test_activation_estimate.py checks the two agree (within 5%;
they agree to the byte) for zerokern.tools.gpt, HF GPT-2 and LLaMA at two sequence lengths each and
every policy. On a GPU the attention kernel (flash / efficient) saves the same output and
logsumexp, so the figure carries over; fragmentation does not show in it.

A saved_tensors_hooks meter (`SavedMeter`) counts the same bytes for the policy None (it is
the independent check of this meter there); under a checkpoint torch's own saved-tensor hooks
replace any outer ones, so for "full"/"selective" only the live-storage meter sees the held
inputs and kept outputs.

The policy is applied by zerokern's own `zerokern.stage3.activation_policy` to the model's
units (each child of every nn.ModuleList), so the trace is of the code that trains.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zerokern.stage3.activation_policy import apply_policy, check_mode, policy_modules

POLICIES = ("none", "full", "selective", "offload")


class LiveMeter(TorchDispatchMode):
    """Records each storage an op creates, and the unit (index into `modules`) running then."""

    def __init__(self, skip=()) -> None:
        super().__init__()
        self.skip = set(skip)   # storages alive before: params, buffers, inputs
        self.refs: Dict[int, tuple] = {}
        self.unit: List[int] = [-1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key in self.skip:
                    continue
                old = self.refs.get(key)
                if old is None or old[0].expired():
                    self.refs[key] = (StorageWeakRef(st), st.nbytes(), self.unit[-1])
        return out

    def alive(self) -> List[tuple]:
        """(bytes, unit) of the recorded storages still alive."""
        gc.collect()
        return [(n, u) for w, n, u in self.refs.values() if not w.expired()]


class SavedMeter:
    """saved_tensors_hooks meter: unique storages of the tensors saved for backward (params,
    their views and `skip` storages left out)."""

    def __init__(self, skip=()) -> None:
        self.skip = set(skip)
        self.refs: Dict[int, tuple] = {}

    def _pack(self, t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            st = t.untyped_storage()
            if st._cdata not in self.skip:
                self.refs.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def bytes(self) -> int:
        return sum(n for w, n in self.refs.values() if not w.expired())


def _storage_keys(model: nn.Module, *tensors) -> set:
    ts = list(model.parameters()) + list(model.buffers()) + list(tensors)
    return {t.untyped_storage()._cdata for t in ts}


def forward_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """One training forward to the loss: zerokern.tools.gpt's `loss`, an HF causal LM's `labels=`
    loss (use_cache off), or the float sum of a plain model's output."""
    if hasattr(model, "loss") and callable(model.loss):
        return model.loss(idx, idx)
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return model(input_ids=idx, labels=idx, use_cache=False).loss
    out = model(idx)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum()


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab", None) or getattr(cfg, "vocab_size", None)
    return int(v) if v else 2


def _run(model: nn.Module, idx: torch.Tensor, policy: Optional[str], units=None,
         **kw) -> Dict[str, Any]:
    """One forward to the loss under the live meter (and, for None, the saved meter)."""
    pol = apply_policy(model, policy, units=units, **kw) if policy else None
    mods = pol.modules if pol is not None else policy_modules(model, units)
    skip = _storage_keys(model, idx)
    meter = LiveMeter(skip)
    saved = SavedMeter(skip)
    inputs: Dict[int, tuple] = {}

    def pre(m, args, kwargs, i):
        meter.unit.append(i)
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in skip:
                st = t.untyped_storage()
                inputs.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))

    def post(m, args, out, i):
        meter.unit.pop()

    hooks = []
    for i, m in enumerate(mods):
        hooks.append(m.register_forward_pre_hook(
            lambda m, a, k, i=i: pre(m, a, k, i), with_kwargs=True))
        hooks.append(m.register_forward_hook(lambda m, a, o, i=i: post(m, a, o, i)))
    try:
        with torch.enable_grad(), (saved.hooks() if pol is None else
                                   contextlib.nullcontext()), meter:
            loss = forward_loss(model, idx)
        alive = meter.alive()
        per_unit = [0] * len(mods)
        for n, u in alive:
            if u >= 0:
                per_unit[u] += n
        total = sum(n for n, _ in alive)
        held_inputs = sum(n for w, n in inputs.values() if not w.expired())
        rep = pol.report() if pol is not None else None
        out = {"total": total, "per_unit": per_unit, "root": total - sum(per_unit),
               "unit_inputs": held_inputs, "units": len(mods),
               "saved_hooks": saved.bytes() if pol is None else None,
               "host": rep["host_bytes"] if rep is not None else 0}
        del loss
    finally:
        for h in hooks:
            h.remove()
        if pol is not None:
            pol.remove()
    return out


def measure(model: nn.Module, batch: int, seq: int, policy: Optional[str] = None,
            units=None, seed: int = 0) -> Dict[str, Any]:
    """The measurement: the live-storage meter over one real forward of `model` (as it is:
    its device and dtype) to the loss under `policy`."""
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, _vocab(model), (batch, seq), generator=g).to(dev)
    return _run(model, idx, check_mode(policy), units)


def trace(model: nn.Module, batch: int, seq: int, policy: Optional[str] = None,
          dtype: Optional[torch.dtype] = None, units=None) -> Dict[str, Any]:
    """The estimate ([Note: the activation trace]): `model` (on meta or anywhere) is rebuilt
    as CPU fake tensors (cast to `dtype`), and one forward to the loss is traced under
    `policy`. Nothing is allocated; the model passed in is not changed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = copy.deepcopy(model)
    made: Dict[int, torch.Tensor] = {}  # ties stay tied
    with mode:
        for mod in fake.modules():  # each param and buffer replaced by a CPU fake tensor
            for table in (mod._parameters, mod._buffers):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    if id(t) not in made:
                        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
                        new = torch.empty(t.shape, dtype=dt, device="cpu")
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                        made[id(t)] = new
                    table[name] = made[id(t)]
    with _real_path_in_transformers(), mode:
        idx = torch.zeros(batch, seq, dtype=torch.long)
        return _run(fake, idx, check_mode(policy), units)


@contextlib.contextmanager
def _real_path_in_transformers():
    """transformers checks whether the position ids are packed sequences with a test it skips
    for fake tensors (`is_tracing`), and then assumes they may be: it materializes the t x t
    causal mask instead of SDPA's is_causal (and LLaMA repeats k/v for the masked kernel),
    which a real run of the same input does not. The trace's positions are 0..t-1 in every
    row (not packed), so while it runs `find_packed_sequence_indices` answers None for fake
    tensors, as the real run's check does; nothing else is changed."""
    try:
        import transformers.masking_utils as mu
    except Exception:  # noqa: BLE001 - no transformers: nothing to patch
        yield
        return
    old = getattr(mu, "find_packed_sequence_indices", None)
    if old is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def real(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor):
            return None
        return old(position_ids, *args, **kwargs)

    mu.find_packed_sequence_indices = real
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = old


def activation_estimate(model: nn.Module, batch: int, seq: int, policy: Optional[str],
                        dtype: Optional[torch.dtype] = None, tp: int = 1,
                        partition_activations: bool = False, cpu_checkpointing: bool = False,
                        units=None) -> Dict[str, Any]:
    """Per-rank activation bytes of a micro-batch (batch x seq) under `policy`:

    device: held for backward at the end of forward, on the device;
    host: moved to host memory (offload, cpu_checkpointing);
    recompute: the working set of the backward's recompute: the most bytes one unit
        re-materializes (its policy-None saved bytes less what the policy kept), or, for
        offload, the largest unit's saved bytes brought back;
    checkpoint_inputs: the units' inputs a checkpoint holds (full / selective).

    tp > 1 (not measured here: no tensor-parallel model is traced): what is saved inside and
    around the units is divided by tp, as Megatron's tensor parallelism with sequence
    parallelism shards it; the checkpointed inputs are replicated over tp unless
    partition_activations (DeepSpeed's Pa) splits them. cpu_checkpointing moves them to host.
    """
    policy = check_mode(policy)
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if (partition_activations or cpu_checkpointing) and policy not in ("full", "selective"):
        raise ValueError("--partition-activations / --cpu-checkpointing act on checkpoints: "
                         "they need --activation-checkpointing full or selective")
    if partition_activations and tp == 1:
        raise ValueError("--partition-activations splits the checkpoints over the tensor-"
                         "parallel ranks: it needs --tp > 1")
    none = trace(model, batch, seq, None, dtype, units)
    got = none if policy is None else trace(model, batch, seq, policy, dtype, units)
    if policy == "offload":
        host = got["host"]
        device = got["total"] - host
        recompute = max(none["per_unit"], default=0)
        ck = 0
    else:
        host = 0
        device = got["total"]
        recompute = 0 if policy is None else max(
            (max(a - b, 0) for a, b in zip(none["per_unit"], got["per_unit"])), default=0)
        ck = got["unit_inputs"] if policy is not None else 0
    if tp > 1:
        rest = device - ck
        ck_rank = ck / tp if partition_activations else ck
        device = rest / tp + ck_rank
        recompute = recompute / tp
        host = host / tp
        ck = ck_rank
    if cpu_checkpointing:
        device -= ck
        host += ck
    return {"policy": policy or "none", "batch": batch, "seq": seq, "device": int(device),
            "host": int(host), "recompute": int(recompute), "checkpoint_inputs": int(ck),
            "none_total": none["total"], "units": none["units"], "tp": tp,
            "partition_activations": partition_activations,
            "cpu_checkpointing": cpu_checkpointing,
            "method": "FakeTensorMode trace of one forward to the loss (CPU kernels)"}
