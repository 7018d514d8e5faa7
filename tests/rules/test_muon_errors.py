"""ZeroMuon in one process (world size 1, no process group): the never-silently-wrong rules.

- which params take Muon (optimizer_muon.py [Note: which params Muon takes]): the default
  split, `use_muon` overriding it, and stage 3 re-created on a model whose params are already
  flat placeholders (the original shapes must still decide);
- bad arguments, a use_muon=True group holding a 1-D param, a group key of the other rule:
  ValueError/TypeError naming it, before the model changes;
- found_inf (fp16 overflow): the step is skipped bit for bit (params, momentum, AdamW moments,
  step counters), as for ZeroAdamW;
- checkpoints: ZeroMuon's into ZeroAdamW, ZeroAdamW's into ZeroMuon, and a Muon group's state
  into an AdamW group (same params, use_muon flipped) are CheckpointErrors, nothing changed.
"""

from __future__ import annotations

import os

import pytest
import torch

import zerokern as zk
from zerokern.checkpoint import CheckpointError

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")

MATS = ["blocks.0.qkv.weight", "blocks.0.proj.weight", "blocks.0.fc1.weight",
        "blocks.0.fc2.weight", "blocks.1.qkv.weight", "blocks.1.proj.weight",
        "blocks.1.fc1.weight", "blocks.1.fc2.weight"]


def names_of(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return [(g["use_muon"], sorted(names[id(p)] for p in g["params"])) for g in opt.param_groups]


def _state(model, opt):
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for gi, g in enumerate(opt.flat_groups):
        for k, t in g.state_tensors().items():
            out[f"{gi}.{k}"] = t.detach().clone()
    return out


def test_default_split():
    model = M.make_model()
    opt = zk.ZeroMuon(model, stage=1, precision="fp32")
    groups = names_of(model, opt)
    assert groups[0] == (True, sorted(MATS))  # not emb.weight (tied head), not the frozen pos
    assert groups[1][0] is False and "emb.weight" in groups[1][1] and "temp" in groups[1][1]
    assert [r.name for r in opt.rules] == ["muon", "adamw"]


def test_default_split_leaves_the_output_head_to_adamw():
    """The head is AdamW's (issue 23): a Hugging Face model's get_output_embeddings() (GPT-2
    untied here), or a submodule named lm_head (DeepSpeed's keyword); the hidden matrices
    are Muon's. Failed before: the untied head went to Muon."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                    n_positions=8, tie_word_embeddings=False))
    opt = zk.ZeroMuon(hf, stage=1, precision="fp32")
    muon = dict(names_of(hf, opt))[True]
    assert "lm_head.weight" not in muon and "transformer.wte.weight" not in muon
    assert "transformer.h.0.mlp.c_fc.weight" in muon

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 4)

    net = Net()
    muon = dict(names_of(net, zk.ZeroMuon(net, stage=0, precision="fp32")))[True]
    assert muon == ["body.weight"]


def test_use_muon_overrides():
    model = M.make_model()
    named = dict(model.named_parameters())
    groups = [{"params": [named["emb.weight"]], "use_muon": True, "lr": 0.5},
              {"params": [p for n, p in named.items() if n != "emb.weight"]}]
    opt = zk.ZeroMuon(model, stage=2, precision="fp32", param_groups=groups)
    got = names_of(model, opt)
    assert got[0] == (True, ["emb.weight"]) and opt.param_groups[0]["lr"] == 0.5
    assert got[1] == (True, sorted(MATS))  # the unmarked group is split in two
    assert got[2][0] is False and "emb.weight" not in got[2][1]


def test_stage3_recreated_uses_original_shapes():
    model = M.make_model()
    first = zk.ZeroMuon(model, stage=3, precision="fp32")
    assert model.blocks[0].qkv.weight.numel() == 0  # a flat placeholder between uses
    second = zk.ZeroMuon(model, stage=3, precision="fp32")
    assert names_of(model, second) == names_of(model, first)


@pytest.mark.parametrize("kw,match", [
    (dict(momentum=-1.0), "momentum"),
    (dict(adjust_lr_fn="cubic"), "adjust_lr_fn"),
    (dict(ns_steps=100), "ns_steps"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (dict(eps=0.0), "eps"),
    (dict(lr=-1.0), "lr"),
    (dict(adamw_lr=-1.0), "adamw_lr"),
    (dict(adamw_betas=(0.9, 1.5)), "adamw_betas"),
    (dict(adamw_eps=-1.0), "adamw_eps"),
    # offload="nvme" and master="compact" run since issue 23's remainders
    # (tests/state/test_nvme_rules.py, test_compact_muon.py); what a rule still refuses is
    # tests/rules/test_rule_support.py's
])
def test_bad_arguments(kw, match):
    model = M.make_model()
    before = M.snapshot(model)
    kw = {"stage": 1, "precision": "fp32", **kw}
    with pytest.raises(ValueError, match=match):
        zk.ZeroMuon(model, **kw)
    assert M.bitwise_equal(M.snapshot(model), before)
    assert not any(hasattr(p, "_zerokern_sync") for p in model.parameters())


def test_nesterov_must_be_bool():
    with pytest.raises(TypeError, match="nesterov"):
        zk.ZeroMuon(M.make_model(), nesterov="yes", stage=1, precision="fp32")


@pytest.mark.parametrize("group,match", [
    ({"use_muon": True}, r"shape \(24,\)"),          # a 1-D param in a Muon group
    ({"use_muon": False, "momentum": 0.9}, "momentum"),  # Muon key in an AdamW group
    ({"use_muon": True, "betas": (0.9, 0.9)}, "betas"),  # AdamW key in a Muon group
    ({"adamw_lr": 0.1}, "adamw_lr"),
    ({"use_muon": "yes"}, "use_muon"),
])
def test_bad_groups(group, match):
    model = M.make_model()
    named = dict(model.named_parameters())
    ln = [named["blocks.0.ln1.bias"]] if group.get("use_muon") is True and "betas" not in group \
        else [named["blocks.0.qkv.weight"]]
    rest = [p for p in named.values() if all(p is not q for q in ln)]
    with pytest.raises(ValueError, match=match):
        zk.ZeroMuon(model, stage=1, precision="fp32",
                    param_groups=[{"params": ln, **group}, {"params": rest}])
    assert not any(hasattr(p, "_zerokern_sync") for p in model.parameters())


def test_overflow_skips_bitwise():
    model = M.make_model()
    opt = zk.ZeroMuon(model, stage=2, precision="fp16", lr=0.02, bucket_mb=M.BUCKET_MB,
                      backend="reference", loss_scale=64.0)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.global_tokens(0)))
    opt.step()
    assert not bool(opt.step_skipped)
    before = _state(model, opt)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.global_tokens(1)) * float("inf"))
    opt.step()
    assert bool(opt.step_skipped)
    after = _state(model, opt)
    assert M.bitwise_equal(after, before), [k for k in before
                                            if not M.bitwise_equal({0: after[k]}, {0: before[k]})]
    opt.zero_grad()  # and the next step runs
    opt.backward(M.loss_fn(model, M.global_tokens(2)))
    opt.step()
    assert not bool(opt.step_skipped)
    assert not torch.equal(model.blocks[0].qkv.weight, before["blocks.0.qkv.weight"])


def _saved(tmp_path, make):
    model = M.make_model()
    opt = make(model)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.global_tokens(0)))
    opt.step()
    path = os.path.join(tmp_path, "ck")
    zk.checkpoint.save(path, model, opt)
    return path


def _split_groups(model, muon_first: bool):
    named = dict(model.named_parameters())
    mats = [named[n] for n in MATS]
    rest = [p for n, p in named.items() if n not in MATS]
    return [{"params": mats, "use_muon": muon_first}, {"params": rest, "use_muon": False}]


@pytest.mark.parametrize("saver,loader,match", [
    ("muon", "adamw", "rule"),
    ("adamw", "muon", "rule"),
    ("muon", "muon_as_adamw", "param group 0"),
])
def test_checkpoint_of_another_rule(tmp_path, saver, loader, match):
    makers = {
        "muon": lambda m: zk.ZeroMuon(m, stage=1, precision="fp32",
                                      param_groups=_split_groups(m, True)),
        "muon_as_adamw": lambda m: zk.ZeroMuon(m, stage=1, precision="fp32",
                                               param_groups=_split_groups(m, False)),
        "adamw": lambda m: zk.ZeroAdamW(m, stage=1, precision="fp32"),
    }
    path = _saved(str(tmp_path), makers[saver])
    model = M.make_model(seed=1)
    opt = makers[loader](model)
    before = _state(model, opt)
    with pytest.raises(CheckpointError, match=match):
        zk.checkpoint.load(path, model, opt)
    after = _state(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoint_roundtrip_same_rule(tmp_path):
    """The sparse sections read back: save, load into a fresh ZeroMuon, same state."""
    make = lambda m: zk.ZeroMuon(m, stage=2, precision="fp32")
    path = _saved(str(tmp_path), make)
    src = M.make_model()
    ref = make(src)
    ref.zero_grad()
    ref.backward(M.loss_fn(src, M.global_tokens(0)))
    ref.step()
    model = M.make_model(seed=1)
    opt = make(model)
    zk.checkpoint.load(path, model, opt)
    a, b = _state(src, ref), _state(model, opt)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def _bf16_run(**kw):
    model = M.make_model()
    opt = zk.ZeroMuon(model, lr=0.02, precision="bf16", bucket_mb=M.BUCKET_MB,
                      backend="reference", **kw)
    for s in range(3):
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.global_tokens(s)))
        opt.step()
    return M.full_snapshot(model, opt)


def test_bf16_every_placement_bitwise():
    """bf16, 3 steps: stages 0-3, offload="cpu", stage-3 offload_params="cpu" give the same
    params bit for bit (the same pieces, the same ops, wherever the state lives)."""
    base = _bf16_run(stage=3)
    assert M.rel_err(base, M.snapshot(M.make_model().to(torch.bfloat16))) > 1e-3  # it moved
    for kw in (dict(stage=0), dict(stage=1), dict(stage=2, offload="cpu"),
               dict(stage=3, offload_params="cpu"),
               dict(stage=3, offload="cpu", offload_params="cpu")):
        assert M.bitwise_equal(_bf16_run(**kw), base), kw


def test_param_frozen_mid_training_is_left_alone():
    """torch.optim.Muon skips a param without a grad: frozen after step 1, a matrix keeps its
    value (and the other matrices still move)."""
    model = M.make_model()
    opt = zk.ZeroMuon(model, lr=0.02, stage=2, precision="fp32", bucket_mb=M.BUCKET_MB)
    opt.zero_grad()
    opt.backward(M.loss_fn(model, M.global_tokens(0)))
    opt.step()
    w, other = model.blocks[0].fc1.weight, model.blocks[1].fc1.weight
    before, other_before = w.detach().clone(), other.detach().clone()
    w.requires_grad_(False)
    opt.zero_grad(set_to_none=True)
    opt.backward(M.loss_fn(model, M.global_tokens(1)))
    opt.step()
    assert torch.equal(w, before)
    assert not torch.equal(other, other_before)


def test_conv_weight_is_orthogonalized_as_its_matrix():
    """A 4-D conv weight takes Muon as the (out, in*kh*kw) matrix: equal, bit for bit, to
    torch.optim.Muon on that 2-D reshape given the same gradients (N=1, fp32, stage 0)."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 5))
    ref_w = torch.nn.Parameter(net[0].weight.detach().reshape(8, 27).clone())
    ref_lin = torch.nn.Parameter(net[2].weight.detach().clone())
    opt = zk.ZeroMuon(net, lr=0.05, stage=0, precision="fp32", adjust_lr_fn="match_rms_adamw")
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    ref = torch.optim.Muon([ref_w, ref_lin], lr=0.05, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        x = torch.randn(4, 3, 6, 6)
        opt.zero_grad()
        net(x).square().mean().backward()
        grads = [net[0].weight.grad.reshape(8, 27).clone(), net[2].weight.grad.clone()]
        opt.step()
        ref_w.grad, ref_lin.grad = grads
        ref.step()
    assert torch.equal(net[0].weight.detach().reshape(8, 27), ref_w.detach())
    assert torch.equal(net[2].weight.detach(), ref_lin.detach())


def test_state_dict_roundtrip_and_other_rule():
    """opt.state_dict() of a ZeroMuon loads into a fresh one (the next step equal bit for
    bit); ZeroAdamW's state dict into a ZeroMuon is a ValueError naming the rules."""
    def make(seed=M.MODEL_SEED):
        model = M.make_model(seed)
        return model, zk.ZeroMuon(model, lr=0.02, stage=2, precision="fp32",
                                  bucket_mb=M.BUCKET_MB)

    def step(model, opt, s):
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.global_tokens(s)))
        opt.step()

    a_model, a = make()
    step(a_model, a, 0)
    sd = a.state_dict()
    b_model, b = make(seed=1)
    with torch.no_grad():
        for p, q in zip(b_model.parameters(), a_model.parameters()):
            p.copy_(q)
    b.load_state_dict(sd)
    step(a_model, a, 1)
    step(b_model, b, 1)
    assert M.bitwise_equal(M.snapshot(b_model), M.snapshot(a_model))
    other_model = M.make_model()
    other = zk.ZeroAdamW(other_model, stage=2, precision="fp32", bucket_mb=M.BUCKET_MB)
    with pytest.raises(ValueError, match="rule"):
        b.load_state_dict(other.state_dict())
