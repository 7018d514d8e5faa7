"""A backward that raises before its end (an error in the model or a hook, out of memory)
([Note: a backward that raised] in zerokern/grads/grad_sync.py), and a forward that raises
([Note: a forward that raised] in zerokern/stage3/runtime.py).

- One process: a loop that catches the error, calls zero_grad() and goes on trains to the bits
  of a run that never made the failed attempt, at stages 0-3, fp32 and bf16, as torch's own
  optimizer lets it. step() straight after the failure (no zero_grad) raises: its gradients
  are partial. Before, every stage failed at the next backward or step with a misleading error
  ("a parameter's gradient arrived twice ... reentrant checkpointing?", "step() called with no
  backward since zero_grad()").
- Several ranks: each rank whose backward raised raises a clear error at its zero_grad(), and
  posts it, so a rank whose backward did not fail raises RankAborted in the collective it waits
  in, within PROMPT_S, not at the process group's timeout. Before: the same misleading errors,
  or stage 3's ranks issued different collectives.
- A forward that raises, caught, then zero_grad() and on: stage 3 kept the units that forward
  was in gathered, with their params as before the next step(), and trained to other params
  without a word (1 and 2 ranks). Now one process trains to the bits of a run without the
  attempt at every stage, with nothing left gathered; at stage 3 with several ranks the failed
  rank raises, posted (its gathers are out of step with a rank that went on), and the others
  raise RankAborted; stage 2 (nothing gathered in forward) goes on at 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from ..comm.test_pieces import _Net
from ..comm.test_rank_failure import PROMPT_S, _outcome
from ..support.harness import cached, case, run_cases, spawn

STAGES = (0, 1, 2, 3)
FAILED = "after a backward that raised before it finished"


def _train(rank, ws, stage, precision, fail, step_first=False, forward=False):
    """4 steps; before step 1, an attempt whose backward raises in a hook on layers[fail]'s
    weight (forward: in that layer's forward hook), caught; then zero_grad() (or step()
    first)."""
    import zerokern as zk

    model = _Net()
    armed = [False]

    def boom(_):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("simulated out of memory")

    if fail is not None and forward:
        model.layers[fail].register_forward_hook(lambda m, i, o: boom(o))
    elif fail is not None:
        model.layers[fail].weight.register_post_accumulate_grad_hook(boom)
    opt = zk.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2, stage=stage,
                       precision=precision, bucket_mb=0.004)
    dt = next(model.parameters()).dtype
    raised = None
    for s in range(4):
        if s == 1 and fail is not None:
            opt.zero_grad()
            armed[0] = True
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(999 + rank))
            try:
                opt.backward(model(x.to(dt), rank))
            except RuntimeError as e:
                raised = str(e)
            if step_first:
                opt.step()  # raises
        opt.zero_grad()
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * s + rank))
        opt.backward(model(x.to(dt), rank))
        opt.step()
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    return {"raised": raised, "params": params,
            "live": opt.grad_sync.live_bytes if stage == 3 else 0}


def _alone(rank, ws):
    cases = {}
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            for fail in (None, 3, 1):  # 3: the first grad to arrive; 1: midway
                cases[f"{stage}-{precision}-{fail}"] = (
                    lambda s=stage, p=precision, f=fail: _train(rank, ws, s, p, f))
        for fail in (0, 2):  # a forward that raises in its first unit, or midway
            cases[f"{stage}-fwd-{fail}"] = (
                lambda s=stage, f=fail: _train(rank, ws, s, "fp32", f, forward=True))
        cases[f"{stage}-step-first"] = (
            lambda s=stage: _train(rank, ws, s, "fp32", 1, step_first=True))
    return run_cases(cases)


@pytest.mark.parametrize("stage", STAGES)
def test_one_process_goes_on_after_a_failed_backward_as_torch_does(stage):
    res = cached(_alone, 1)
    for precision in ("fp32", "bf16"):
        ref = case(res, f"{stage}-{precision}-None")[0]
        for fail in (3, 1):
            got = case(res, f"{stage}-{precision}-{fail}")[0]
            assert got["raised"] == "simulated out of memory"  # the attempt failed
            for a, b in zip(ref["params"], got["params"]):
                assert torch.equal(a, b), (precision, fail)
    err = res[0][f"{stage}-step-first"]
    assert FAILED in err.tb and "call zero_grad()" in err.tb, err.tb
    ref = case(res, f"{stage}-fp32-None")[0]
    for fail in (0, 2):
        got = case(res, f"{stage}-fwd-{fail}")[0]
        assert got["raised"] == "simulated out of memory" and got["live"] == 0
        for a, b in zip(ref["params"], got["params"]):
            assert torch.equal(a, b), ("forward", fail)


def _forward_fails(rank, ws, stage, fail_ranks):
    return _outcome(lambda: _train(rank, ws, stage, "fp32", 2 if rank in fail_ranks else None,
                                   forward=True))


@pytest.mark.parametrize("fail_ranks", [(0, 1), (0,)])
def test_ranks_raise_promptly_after_a_stage3_forward_that_raised(fail_ranks):
    """Several ranks: the gathers of a failed forward are out of step with a rank that went on
    (whose next gathers would pair with this rank's next forward's, same-size units swapping
    params unseen), so the failed rank raises at its zero_grad(), posted; a rank whose forward
    did not fail raises RankAborted (in its backward's gather) within PROMPT_S. Stage 2 does not
    gather in forward: the control below."""
    for r, res in enumerate(spawn(_forward_fails, 2, 3, fail_ranks)):
        assert res["err"] is not None, f"rank {r} did not raise"
        name, msg = res["err"]
        text = "a forward raised before it finished"
        if r in fail_ranks:
            assert name == "RuntimeError" and text in msg and "restart" in msg, (r, msg)
        else:
            assert name == "RankAborted" and text in msg, (r, name, msg)
        assert res["elapsed"] < PROMPT_S, (r, res["elapsed"])


def _stage2_forward_fails(rank, ws):
    return run_cases({f"{fail}": (lambda f=fail: _train(rank, ws, 2, "fp32", f, forward=True))
                      for fail in (None, 0, 2)})


def test_stage2_ranks_go_on_after_a_forward_that_raised_on_every_rank():
    """Stage 2 gathers nothing in forward: a forward error caught on every rank leaves no
    exchange behind, and the ranks train to the bits of a run without the attempt."""
    res = spawn(_stage2_forward_fails, 2)
    for r in range(2):
        ref = case(res, "None")[r]
        for fail in (0, 2):
            got = case(res, f"{fail}")[r]
            assert got["raised"] == "simulated out of memory"
            for a, b in zip(ref["params"], got["params"]):
                assert torch.equal(a, b), (r, fail)


def _ranks(rank, ws, stage, fail_ranks):
    return _outcome(lambda: _train(rank, ws, stage, "fp32", 1 if rank in fail_ranks else None))


@pytest.mark.parametrize("stage,fail_ranks", [(1, (0, 1)), (2, (0, 1)), (3, (0, 1)),
                                              (2, (0,)), (3, (0,))])
def test_ranks_raise_promptly_after_a_failed_backward(stage, fail_ranks):
    for r, res in enumerate(spawn(_ranks, 2, stage, fail_ranks)):
        assert res["err"] is not None, f"rank {r} did not raise"
        name, msg = res["err"]
        if r in fail_ranks:
            assert name == "RuntimeError" and FAILED in msg and "restart" in msg, (r, msg)
        else:
            assert name == "RankAborted" and FAILED in msg, (r, name, msg)
        assert res["elapsed"] < PROMPT_S, (r, res["elapsed"])
