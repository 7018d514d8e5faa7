"""Stage 3 issues its gathers and reduce-scatters in one order on every rank (issue 24, item 3).

NCCL asks every rank to issue its collectives in the same order across communicators, and stage
3 gathers on one group while it reduce-scatters on another. Before rule 4 of [Note: stage-3
collective order] the interleaving of the two followed when each rank's units finished their
backward, which differs between ranks under data-dependent control flow (a possible hang on
GPUs). Checked here on gloo ranks, where the order is visible in ZEROKERN_DEBUG_COLLECTIVES=1's
records (compared in issue order over all groups):
- the data-dependent model of test_stage3_users (dropped blocks, branches, MoE routing) keeps
  one interleaving on every rank (the old code failed this check at collective #22 of the first
  step), still overlaps (reduce-scatters are issued between the backward's gathers) and has no
  late unit;
- a unit whose backward is not over when its window closes is reduced late and caught up at
  the end of backward, on one rank (a unit called with token inputs whose second table is used
  on some ranks only) or on every rank (units called out of registration order): parity with
  DDP(find_unused_parameters=True) + AdamW at 1, 2 and 3 ranks, the late units counted;
- a model whose units run in schedule order (the test GPT) has no late unit: it pays nothing
  but one host all-reduce of a flag per unit per backward;
- negative control: without the catch-up those runs miss DDP by far.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params
from .test_stage3_users import STEPS, TOL, _with_debug, _zero3, ddp_reference, make_dyn, train3

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class TokenBias(nn.Module):
    """Called with token ids (no input that requires grad): its backward is over only when all
    its params have grads, or at the end of backward where its second table went unused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Embedding(M.VOCAB, D)
        self.b = nn.Embedding(M.VOCAB, D)

    def forward(self, tokens: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(tokens) + self.b(tokens) if use_b else self.a(tokens)


class SideLM(nn.Module):
    """6 blocks, then a TokenBias unit registered after them (first in the reversed schedule,
    so its window closes early) whose table b is used on the ranks whose batch says so."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(M.VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.side = nn.ModuleList([TokenBias()])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, M.VOCAB)
        self.trace = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        use_b = int(tokens[:, 0].sum()) % 2 == 0  # differs between ranks at N = 2, 3
        self.trace.append(use_b)
        return self.head(self.ln_f(x + self.side[0](tokens, use_b)))


class EncDecLM(nn.Module):
    """The decoder's blocks are registered before the encoder's but run after them: every
    encoder block's backward comes after the schedule passed it, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(M.VOCAB, D)
        self.dec = nn.ModuleList(Block() for _ in range(3))
        self.enc = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, M.VOCAB)
        self.trace = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in list(self.enc) + list(self.dec):
            x = blk(x)
        return self.head(x)


MODELS = {"side": SideLM, "encdec": EncDecLM}


def _make(name: str) -> nn.Module:
    torch.manual_seed(M.MODEL_SEED)
    return MODELS[name]()


# ---- rank side -----------------------------------------------------------------------------
def _order(rank, ws):
    """The data-dependent model under the strict debug check; the records of one backward."""
    model = make_dyn()
    opt = _with_debug(lambda: _zero3(model))
    got = train3(model, opt, rank, ws)
    opt.zero_grad()
    M.loss_fn(model, M.rank_tokens(STEPS, rank, ws)).backward()
    kinds = [r[1] for r in opt.comm.log.records]
    opt.step()
    return {"checks": opt.comm.log.checks, "kinds": kinds, "trace": model.trace,
            "rel": M.rel_err(got, ddp_reference(make_dyn(), rank, ws)),
            "late": opt.grad_sync.late_units}


def _late(rank, ws, name, catch_up=True):
    model = _make(name)
    opt = _with_debug(lambda: _zero3(model))
    if not catch_up:  # the negative control: late units' grads are left out
        opt.grad_sync._catch_up = lambda: None
    got = train3(model, opt, rank, ws)
    ref = ddp_reference(_make(name), rank, ws)
    return {"rel": M.rel_err(got, ref), "moved": M.rel_err(got, M.snapshot(_make(name))),
            "late": opt.grad_sync.late_units, "checks": opt.comm.log.checks,
            "trace": model.trace}


def _sequential(rank, ws):
    """A model whose units run in schedule order (the test GPT): nothing is ever late."""
    model = M.make_model()
    opt = _zero3(model)
    train3(model, opt, rank, ws)
    return opt.grad_sync.late_units


def _worker(rank, ws):
    return run_cases({
        "sequential": functools.partial(_sequential, rank, ws),
        "order": functools.partial(_order, rank, ws),
        "side": functools.partial(_late, rank, ws, "side"),
        "encdec": functools.partial(_late, rank, ws, "encdec"),
        "side_no_catch_up": functools.partial(_late, rank, ws, "side", False),
        "encdec_no_catch_up": functools.partial(_late, rank, ws, "encdec", False),
    })


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", ws_params(2, 3))
def test_one_interleaving_on_every_rank_under_data_dependent_flow(ws):
    res = case(cached(_worker, ws), "order")
    assert len({tuple(x["trace"]) for x in res}) == ws, "the ranks must take different paths"
    for r, x in enumerate(res):
        # every step() compared the records in issue order over both groups: a difference
        # would have raised (the old code's interleaving differed at the first step)
        assert x["checks"] == STEPS + 1, (r, x["checks"])
        assert x["rel"] <= TOL["param"], f"rank {r}: vs DDP + AdamW {x['rel']:.3g}"
        # dropped blocks, branches and experts are never late (6 late units at N=2 while the
        # cursor moved in a tensor hook: [Note: the cursor hook runs last on its tensor])
        assert x["late"] == 0, x["late"]
        # still overlapped: a reduce-scatter is issued before the backward's last gather
        k = x["kinds"]
        assert "reduce_scatter" in k and "all_gather" in k, k
        assert k.index("reduce_scatter") < len(k) - 1 - k[::-1].index("all_gather"), k
    assert len({tuple(x["kinds"]) for x in res}) == 1


@pytest.mark.parametrize("ws", ws_params(1, 2, 3))
def test_a_sequential_model_has_no_late_units(ws):
    assert case(cached(_worker, ws), "sequential") == [0] * ws


@pytest.mark.parametrize("ws", ws_params(1, 2, 3))
@pytest.mark.parametrize("name", ["side", "encdec"])
def test_late_units_are_caught_up(ws, name):
    res = case(cached(_worker, ws), name)
    for r, x in enumerate(res):
        assert x["moved"] > 100 * TOL["param"], "training must move the params"
        assert x["rel"] <= TOL["param"], f"rank {r}: vs DDP + AdamW {x['rel']:.3g}"
        assert x["late"] > 0, "the model must produce late units"
        assert x["checks"] == STEPS
    assert len({x["late"] for x in res}) == 1, "every rank catches up the same units"
    if name == "side" and ws > 1:  # late on some ranks only: the data decided
        assert any(len({x["trace"][s] for x in res}) > 1 for s in range(STEPS)), res


@pytest.mark.parametrize("ws", ws_params(1, 2))
@pytest.mark.parametrize("name", ["side", "encdec"])
def test_without_the_catch_up_training_is_wrong(ws, name):
    # Measured: with the catch-up <= 1.6e-7 (both models, N = 1-3); without, SideLM misses by
    # 8.8e-5 at N = 2 (only a few rows of one late table lose their grads), EncDecLM by far more
    for x in case(cached(_worker, ws), f"{name}_no_catch_up"):
        assert x["rel"] > 10 * TOL["param"], x["rel"]

