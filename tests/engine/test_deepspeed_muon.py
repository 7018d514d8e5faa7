"""DeepSpeed's Muon (deepspeed 0.19.8, DS_ACCELERATOR=cpu) and zerokern.initialize on the same
model, data and config (`"optimizer": {"type": "Muon", "params": {..., "ns_method":
"standard"}}`), ZeRO stages 0-3, 1 and 2 gloo ranks, fp32, 3 optimizer steps of 2
micro-batches, each against an independent reference: DDP + torch.optim.Muon (the matrices) +
torch.optim.AdamW (the rest, the split DeepSpeed makes), and the same with Muon's update in
float64 (`Muon64`, the spec). Measure: ||Δ_x - Δ_ref|| / ||Δ_ref|| per half (Muon params,
AdamW params), Δ the change of the params from their init, after step 1 and after step 3.

[Note: why the spec]
Newton-Schulz in bf16 is badly conditioned: the quintic's slope at 0 (3.4445) amplifies the
rounding of small singular directions about 3.4^5 ~ 480x over 5 steps. Measured on random
matrices, torch's bf16 result is 1.3-1.9% (full rank) to 39% (rank 8 of 64x32) away from the
same iteration in float64; DeepSpeed's `zeropower_via_newtonschulz5` (the same algorithm
coded otherwise: X / (norm + eps), `b*A + c*A@A` instead of addmm, the sqrt(rows/cols) scale
multiplied into the bf16 update) is as far from the float64 result and 3-49% from torch's. On
this model DeepSpeed and torch differ by 5.7e-2 after one step, 5.7 times what Muon lr x 1.01
changes (1.0e-2), so bf16 runs cannot be compared at the resolution the negative control
needs. Hence:
- zerokern, which runs torch's exact ops, is compared with torch.optim.Muon after step 1
  (bitwise on the Muon half). Later steps are not: the AdamW half's summation order moves the
  next gradient by ulps, which bf16 turns into ~2e-3 (tests/rules/test_muon.py compares many
  steps by handing the reference the engine's gradient);
- DeepSpeed runs its Newton-Schulz in fp32, which it does by itself on an accelerator without
  bf16 (`ns_compute_dtype`: is_bf16_supported() False, patched so here), and is compared with
  the float64 spec over 3 steps (fp32 rounding, amplified, stays ~1e-5);
- DeepSpeed's default bf16 run and torch's are each checked to lie within BF16_BAND of the
  spec (a Muon that skipped Newton-Schulz, DeepSpeed's earlier stage-0 bug, is O(1) away).
DeepSpeed's Muon issues named in issue 23 are fixed in 0.19.8: MuonWithAuxAdam.step
orthogonalizes >= 2-D params itself when no ZeRO optimizer did (stage 0), and
set_optimizer_flags reads `ds_shape` under zero.Init. Its stage 3 refuses Muon with
reduce_scatter on (its default): "Muon and reduce scatter cannot be used together"
(runtime/zero/stage3.py), so the config turns it off.

[Note: the model]
DeepSpeed chooses Muon by parameter *name* (`deepspeed.set_optimizer_flags`: >= 2-D and no
"embed" or "lm_head" in the name); zerokern by module type (nn.Embedding weights and the
output head go to AdamW). On Hugging Face GPT-2 the two disagree: DeepSpeed sends
`transformer.wte.weight` (the token embedding, tied to the head) and `transformer.wpe.weight`
to Muon, zerokern to AdamW. The model here names its embedding `embed` and its head
`lm_head`, so both make the same split and the comparison is of the update, not the split;
`test_gpt2_split_differs` records the GPT-2 difference.
Skipped only when deepspeed cannot be imported.
"""

from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402

STEPS, GAS = 3, 2
MUON = {"muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "weight_decay": 0.1,
        "betas": [0.9, 0.95], "eps": 1e-8, "ns_method": "standard"}
TOL_ZK = 1e-5      # zerokern step 1 vs torch.optim.Muon (measured: test docstrings)
TOL_SPEC = 1e-4    # DeepSpeed (fp32 Newton-Schulz) vs the float64 spec, 3 steps
BF16_BAND = 0.1    # a bf16 Newton-Schulz vs the float64 spec ([Note: why the spec])
WRONG = 1.01    # the negative control's Muon lr factor


class Block(nn.Module):
    """A residual MLP block: three matrices of three shapes, a LayerNorm, two biases."""

    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.mix = nn.Linear(d, d, bias=False)

    def forward(self, h):
        return h + self.mix(self.down(torch.nn.functional.gelu(self.up(self.ln(h)))))


class TinyLM(nn.Module):
    """An embedding, two Blocks (6 matrices: an odd count per rank at N=2 in every unit),
    a final LayerNorm and a head."""

    def __init__(self, vocab=C.VOCAB, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        logits = self.lm_head(self.ln_f(h))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=loss, logits=logits)  # a type DeepSpeed's hooks walk


def _model():
    torch.manual_seed(C.MODEL_SEED)
    return TinyLM()


def _is_muon(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's rule (set_optimizer_flags); on TinyLM also zerokern's default split."""
    return p.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def _config(stage: int, lr_factor: float = 1.0):
    params = dict(MUON, muon_lr=MUON["muon_lr"] * lr_factor)
    return {"train_micro_batch_size_per_gpu": C.MICRO_BATCH, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "Muon", "params": params},
            # DeepSpeed 0.19 clips at 1.0 without the key; the reference does not clip.
            "gradient_clipping": 0.0, "steps_per_print": 1000,
            # DeepSpeed's stage 3 refuses Muon with reduce_scatter (its default): "Muon and
            # reduce scatter cannot be used together" (stage3.py); zerokern ignores the key.
            "zero_optimization": {"stage": stage, "reduce_scatter": False}}


def _full_params(which: str, engine, stage: int):
    """name -> full fp32 param after training (gathered at stage 3)."""
    mod = engine.module
    if stage == 3 and which == "deepspeed":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(mod.parameters())):
            return {n: p.detach().clone() for n, p in mod.named_parameters()}
    if stage == 3:
        with engine.optimizer.gathered_params():
            return {n: p.detach().clone() for n, p in mod.named_parameters()}
    return {n: p.detach().clone() for n, p in mod.named_parameters()}


def train_engine(which: str, rank: int, stage: int, lr_factor: float = 1.0,
                 ns_fp32: bool = False, zero_init: bool = False):
    """(per-step losses, params after step 1, params after the last step) through `which` in
    {"zerokern", "deepspeed"}. ns_fp32: DeepSpeed runs Newton-Schulz in fp32 (what its
    `ns_compute_dtype` picks on an accelerator without bf16; [Note: why the spec]).
    zero_init: the model is built under deepspeed.zero.Init (stage 3: its params are flat 1-D
    placeholders when deepspeed.initialize sees them)."""
    C.launcher_env(rank)
    if which == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        ctx, init = C.restore_linear(), deepspeed.initialize
        acc = get_accelerator()
        saved_bf16 = acc.is_bf16_supported
        if ns_fp32:
            acc.is_bf16_supported = lambda: False
    else:
        import zerokern

        ctx, init = contextlib.nullcontext(), zerokern.initialize
    try:
        with ctx:
            if zero_init:
                import deepspeed

                with deepspeed.zero.Init(config_dict_or_path=_config(stage, lr_factor)):
                    model = _model()
                # partitioned: flat placeholders, the layer shape only in ds_shape
                assert all(p.ndim == 1 and len(p.ds_shape) >= 1 for p in model.parameters())
            else:
                model = _model()
            engine, _, _, _ = init(model=model, model_parameters=model.parameters(),
                                   config=_config(stage, lr_factor))
            losses, first = [], None
            for s in range(STEPS):
                total = 0.0
                for m in range(GAS):
                    x = C.tokens(s, m, rank)
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                    total += float(loss.detach())
                losses.append(total / GAS)
                if s == 0:
                    first = _full_params(which, engine, stage)
            last = _full_params(which, engine, stage)
            if which == "deepspeed" and hasattr(engine, "destroy"):
                engine.destroy()
    finally:
        if which == "deepspeed":
            acc.is_bf16_supported = saved_bf16
    return losses, first, last


def newton_schulz64(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration in float64 (the spec both bf16 codes round)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon64(torch.optim.Optimizer):
    """The float64 Muon spec: torch.optim.Muon's update (lerp momentum, Nesterov, the
    "original" sqrt(max(1, rows/cols)) lr scale, decoupled decay) with Newton-Schulz in
    float64, rounded once into the fp32 param."""

    def __init__(self, params, lr, momentum, weight_decay):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p, dtype=torch.float64))
                grad = p.grad.double()
                buf.lerp_(grad, 1 - g["momentum"])
                o = newton_schulz64(grad.lerp(buf, g["momentum"]))
                scale = max(1.0, p.size(0) / p.size(1)) ** 0.5
                new = p.double() * (1 - g["lr"] * g["weight_decay"]) - g["lr"] * scale * o
                p.copy_(new)


def train_reference(rank: int, lr_factor: float = 1.0, spec: bool = False):
    """DDP (N > 1) + torch.optim.Muon (or, spec=True, Muon64) for the matrices +
    torch.optim.AdamW for the rest: DeepSpeed's update (Nesterov, adjust_lr_fn="original",
    decoupled decay). Returns (losses, params after step 1, params after the last step)."""
    import torch.distributed as dist

    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model) \
        if dist.is_initialized() and dist.get_world_size() > 1 else model
    named = list(model.named_parameters())
    mats = [p for n, p in named if _is_muon(n, p)]
    lr = MUON["muon_lr"] * lr_factor
    muon = Muon64(mats, lr, MUON["momentum"], MUON["weight_decay"]) if spec else \
        torch.optim.Muon(mats, lr=lr, momentum=MUON["momentum"],
                         weight_decay=MUON["weight_decay"], nesterov=True,
                         adjust_lr_fn="original")
    adam = torch.optim.AdamW([p for n, p in named if not _is_muon(n, p)], lr=MUON["adam_lr"],
                             betas=tuple(MUON["betas"]), eps=MUON["eps"],
                             weight_decay=MUON["weight_decay"])
    losses, first = [], None
    for s in range(STEPS):
        total = 0.0
        for m in range(GAS):
            no_sync = net.no_sync() if (m < GAS - 1 and net is not model) \
                else contextlib.nullcontext()
            with no_sync:
                x = C.tokens(s, m, rank)
                loss = net(input_ids=x, labels=x).loss
                (loss / GAS).backward()
            total += float(loss.detach())
        muon.step()
        adam.step()
        muon.zero_grad()
        adam.zero_grad()
        losses.append(total / GAS)
        if s == 0:
            first = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


def delta_rel(got: dict, ref: dict, muon: bool) -> float:
    """||Δ_got - Δ_ref|| / ||Δ_ref|| over one half (Muon or AdamW params), Δ from the init."""
    init = dict(_model().named_parameters())
    names = [n for n in ref if _is_muon(n, init[n]) == muon]
    num = sum(float((got[n] - ref[n]).double().pow(2).sum()) for n in names) ** 0.5
    den = sum(float((ref[n] - init[n].detach()).double().pow(2).sum()) for n in names) ** 0.5
    return num / den


def _summary(got, ref):
    """Relative Δ errors per half after step 1 and after the last step, and the losses."""
    return {"muon1": delta_rel(got[1], ref[1], True), "adamw1": delta_rel(got[1], ref[1], False),
            "muon": delta_rel(got[2], ref[2], True), "adamw": delta_rel(got[2], ref[2], False),
            "loss": C.rel(got[0], ref[0])}


def _cases(rank, ws, stages):
    cases = {}
    for stage in stages:
        def one(stage=stage):
            ref = train_reference(rank)
            spec = train_reference(rank, spec=True)
            z = train_engine("zerokern", rank, stage)
            d = train_engine("deepspeed", rank, stage)
            d32 = train_engine("deepspeed", rank, stage, ns_fp32=True)
            return {"zk": _summary(z, ref), "ds_spec": _summary(d32, spec),
                    "ds_bf16": _summary(d, ref), "zk_ds": _summary(z, d),
                    "torch_spec": _summary(ref, spec), "ds_bf16_spec": _summary(d, spec)}
        cases[f"s{stage}"] = one

    def negative():
        ref, spec = train_reference(rank), train_reference(rank, spec=True)
        z = train_engine("zerokern", rank, 1, lr_factor=WRONG)
        d32 = train_engine("deepspeed", rank, 1, lr_factor=WRONG, ns_fp32=True)
        return {"zk": _summary(z, ref), "ds_spec": _summary(d32, spec)}
    if 1 in stages:
        cases["negative"] = negative

    def zero_init():
        spec = train_reference(rank, spec=True)
        d32 = train_engine("deepspeed", rank, 3, ns_fp32=True, zero_init=True)
        return {"ds_spec": _summary(d32, spec)}
    if 3 in stages:
        cases["s3-zero-init"] = zero_init
    return run_cases(cases)


def _worker(rank, ws, stages):
    return _cases(rank, ws, stages)


def _results(ws):
    return cached(_worker, ws, (0, 1, 2, 3))


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_muon_matches_the_spec(stage, ws):
    """DeepSpeed's Muon with Newton-Schulz in fp32 is the float64 spec within TOL_SPEC over
    3 steps, both halves (N=1, every stage: Muon 1.7e-5 after step 1, 1.3e-5 after 3; AdamW
    half, its inline Adam against torch's AdamW, 7.9e-6); zerokern's step 1 is torch's bit for
    bit on the Muon half (0.0) and 8.4e-7 on the AdamW half. DeepSpeed's default bf16 run and
    torch's are each within BF16_BAND of the spec (N=1: 4.2e-2 and 3.8e-2 after step 1), and
    5.7e-2 from each other: the spread of two bf16 codings of one algorithm ([Note: why the
    spec]), so bf16 runs are not compared at lr x 1.01 resolution."""
    for r in case(_results(ws), f"s{stage}"):
        assert r["zk"]["muon1"] <= TOL_ZK and r["zk"]["adamw1"] <= TOL_ZK, r
        for key in ("muon1", "adamw1", "muon", "adamw"):
            assert r["ds_spec"][key] <= TOL_SPEC, (key, r)
        assert r["ds_bf16_spec"]["muon1"] <= BF16_BAND, r
        assert r["torch_spec"]["muon1"] <= BF16_BAND, r
        assert r["zk_ds"]["muon1"] <= 2 * BF16_BAND, r


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_deepspeed_muon_under_zero_init(ws):
    """The model built under deepspeed.zero.Init (1-D placeholders, which sent every param to
    AdamW in the DeepSpeed release issue 23 describes): DeepSpeed's stage 3 with fp32
    Newton-Schulz is still the float64 spec within TOL_SPEC, as without zero.Init (2.3e-5 at
    N=2; an AdamW-only run would be O(1) away on the Muon half)."""
    for r in case(_results(ws), "s3-zero-init"):
        for key in ("muon1", "adamw1", "muon", "adamw"):
            assert r["ds_spec"][key] <= TOL_SPEC, (key, r)


@pytest.mark.slow
@pytest.mark.parametrize("ws", [1, 2])
def test_negative_control_lr_caught(ws):
    """Muon lr x 1.01 (zerokern against torch, DeepSpeed with fp32 Newton-Schulz against the
    spec) moves the Muon half by 1.0e-2 after one step: above TOL_ZK and TOL_SPEC."""
    for r in case(_results(ws), "negative"):
        assert r["zk"]["muon1"] > 100 * TOL_ZK, r
        assert r["ds_spec"]["muon1"] > 10 * TOL_SPEC, r


@pytest.mark.slow
def test_gpt2_split_differs():
    """[Note: the model]: on Hugging Face GPT-2, DeepSpeed's name rule puts the token and
    position embeddings (wte, tied to the head, and wpe) in the Muon half; zerokern's module
    rule leaves them to AdamW (DESIGN: never from a name or a flattened shape)."""
    from deepspeed import set_optimizer_flags

    model = C.gpt2()
    cfg = types.SimpleNamespace(optimizer_name="muon", optimizer_params={})
    set_optimizer_flags(cfg, model)
    ds_muon = {n for n, p in model.named_parameters() if p.use_muon}
    from zerokern.rules.muon import embedding_weight_ids, takes_muon

    emb = embedding_weight_ids(model)
    zk_muon = {n for n, p in model.named_parameters() if takes_muon(p.shape, id(p) in emb)}
    assert ds_muon - zk_muon == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert zk_muon <= ds_muon
