"""Activation policies on the units (zerokern.stage3.activation_policy, issue 37).

Parity: every policy ("full", "selective", "offload") trains to the same losses and params
as no checkpointing, bit for bit on CPU, at stages 0-3 on 1 and 2 gloo ranks, on a model with
dropout inside its units (the recompute replays it with the first forward's RNG state) and
attention through scaled_dot_product_attention. Negative control: the same "full" policy
without the RNG replay (preserve_rng_state=False: the recompute draws a new dropout mask, a
policy that "forgets to recompute a dropout") is caught by the same comparison.
Also: memory_report()'s activation rows, the checks before any change, eval forwards, and a
newer optimizer's policy replacing the older one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokern as zk
from tests.support.harness import cached, case, one_thread, run_cases  # noqa: F401 (fixture)
from zerokern.stage3.activation_policy import apply_policy

POLICIES = ("full", "selective", "offload")


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, t, d)
        return x + self.drop(self.out(F.gelu(self.fc(x))))


class Net(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(stage: int, policy, rank: int = 0, steps: int = 3, raw=None):
    """Losses and final params of `steps` steps; `raw`: apply_policy's keywords, applied to
    the model directly (the negative control) instead of the optimizer's argument."""
    torch.manual_seed(0)
    model = Net()
    if raw is not None:
        apply_policy(model, "full", **raw)
    opt = zk.ZeroAdamW(model, lr=1e-2, stage=stage, precision="fp32",
                       activation_checkpointing=policy)
    g = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(1000 + rank)  # dropout, per rank
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=g)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    rep = opt.memory_report().get("activations")
    with opt.gathered_params() if stage == 3 else _null():
        params = [p.detach().clone() for p in model.parameters()]
    return losses, params, rep


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _worker(rank: int, world_size: int, stages):
    cases = {}
    for st in stages:
        for pol in (None, *POLICIES):
            cases[f"{st}_{pol}"] = lambda st=st, pol=pol: _train(st, pol, rank)
        cases[f"{st}_forgets_rng"] = lambda st=st: _train(
            st, None, rank, raw={"preserve_rng_state": False})
    return run_cases(cases)


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _check_parity(world_size: int, stages) -> None:
    res = cached(_worker, world_size, tuple(stages))
    for st in stages:
        base = case(res, f"{st}_None")
        for pol in POLICIES:
            got = case(res, f"{st}_{pol}")
            for r in range(world_size):
                assert _same(got[r], base[r]), (st, pol, r, got[r][0], base[r][0])
                rep = got[r][2]
                assert rep["policy"] == pol and rep["units"] == 3
                assert rep["checkpoints_held"] == 0  # every recompute ran
                if pol != "offload":
                    assert rep["recomputes"] == rep["checkpoints_taken"] == 9
                    assert rep["checkpoints_peak"] == 3 and rep["saved_peak"] > 0
                else:
                    assert rep["host_peak"] > 0 and rep["checkpoints_taken"] == 0
        bad = case(res, f"{st}_forgets_rng")  # negative control: caught by parity
        assert all(not _same(bad[r], base[r]) for r in range(world_size)), st


def test_every_policy_trains_bitwise_as_none_two_ranks():
    _check_parity(2, (0, 1, 2, 3))


def test_every_policy_trains_bitwise_as_none_one_rank():
    _check_parity(1, (0, 1, 2, 3))


# ---- in process -----------------------------------------------------------------------------
def test_rows_and_bytes(one_thread):
    torch.manual_seed(0)
    reps = {pol: _train(3, pol, steps=1)[2] for pol in POLICIES}
    # full holds the 3 blocks' inputs; selective those and the matmul / attention outputs
    b, t, d = 2, 16, 32
    assert reps["full"]["saved_peak"] == 3 * b * t * d * 4
    assert reps["selective"]["saved_peak"] > reps["full"]["saved_peak"]
    # on a CPU-only machine the "host copies" are the saved tensors themselves
    assert reps["offload"]["host_peak"] == reps["offload"]["saved_peak"] > 0


def test_bad_input_changes_nothing(one_thread):
    model = Net()
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        zk.ZeroAdamW(model, stage=2, precision="fp32", activation_checkpointing="some")
    with pytest.raises(ValueError, match="needs the model"):
        zk.ZeroAdamW(list(model.parameters()), stage=2, precision="fp32",
                     activation_checkpointing="full")
    flat = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # no ModuleList: no units
    with pytest.raises(ValueError, match="no units to checkpoint"):
        zk.ZeroAdamW(flat, stage=2, precision="fp32", activation_checkpointing="full")
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_eval_forward_and_a_newer_optimizer(one_thread):
    torch.manual_seed(0)
    model = Net()
    opt = zk.ZeroAdamW(model, stage=3, precision="fp32", activation_checkpointing="full")
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert opt.activations.checkpoints_taken == 0  # no grad: nothing to checkpoint
    opt2 = zk.ZeroAdamW(model, stage=3, precision="fp32", activation_checkpointing="selective")
    idx = torch.zeros(1, 4, dtype=torch.long)
    model(idx).sum().backward()
    assert opt2.activations.checkpoints_taken == 3 and opt.activations.checkpoints_taken == 0
    opt2.activations.remove()
    assert all("forward" not in b.__dict__ for b in model.blocks)


# ---- the same switch in `zerokern train` and ZeroTrainer -----------------------------------
def test_train_command_flag(tmp_path, capsys):
    import json

    from zerokern import cli

    out = tmp_path / "sel"
    rc = cli.main(["train", "--model-size", "tiny", "--seq", "32", "--batch", "4", "--steps",
                   "2", "--device", "cpu", "--nproc", "1", "--stage", "3", "--precision",
                   "fp32", "--activation-checkpointing", "selective", "--out", str(out)])
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["config"]["activation_checkpointing"] == "selective"


def test_zero_trainer_switch(tmp_path, one_thread):
    from transformers import TrainingArguments

    from tests.engine import common as C
    from zerokern.integrations.transformers import ZeroTrainer

    ds = [{"input_ids": C.tokens(s, 0, 0)[0], "labels": C.tokens(s, 0, 0)[0]} for s in range(4)]

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-3,
                                 per_device_train_batch_size=2, max_steps=2, report_to=[],
                                 use_cpu=True, save_strategy="no", logging_strategy="no", **kw)

    finals = {}
    for pol in (None, "selective"):
        model = C.gpt2()
        tr = ZeroTrainer(model=model, args=args(), train_dataset=ds, zero_stage=3,
                         zero_options={"precision": "fp32"}, activation_checkpointing=pol)
        tr.train()
        z = tr.zero_optimizer
        assert (z.activations is None) == (pol is None)
        with z.gathered_params():
            finals[pol] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(finals[None], finals["selective"]))
    with pytest.raises(ValueError, match="activation_checkpointing must be"):
        ZeroTrainer(model=C.gpt2(), args=args(), train_dataset=ds, activation_checkpointing="x")
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        ZeroTrainer(model=C.gpt2(), args=args(gradient_checkpointing=True), train_dataset=ds,
                    activation_checkpointing="full")
