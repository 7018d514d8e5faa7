"""transformers.Trainer and accelerate loops with the zerokern one-line change (ZeroTrainer /
ZeroAccelerator) against the same script with torch.optim.AdamW under DDP: per-micro-batch
losses and the logged grad norms, stages 0-3, N = 1 and 2, fp32 and bf16; stage-3 save_model
loaded by from_pretrained; resume_from_checkpoint at another world size; a negative control."""

from __future__ import annotations

import atexit
import shutil
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import hf_common as H  # noqa: E402

TOL = {
    "fp32": 1e-5,   # the bound; measured <= 1.1e-7 (Trainer), 9.9e-8 (accelerate)
    # bf16: the reference is Trainer/accelerate bf16 = autocast over fp32 weights; zerokern
    # keeps bf16 weights (fp32 masters), as DeepSpeed does under Trainer, so every forward
    # sees weights rounded to 8 bits (2^-9 = 2e-3 relative per weight; the loss, a mean over
    # many, moves far less).
    "bf16": 1e-3,  # measured 5.0e-5 - 8.9e-5 (stages 1, 3; Trainer and accelerate)
    # fp16: the reference is autocast fp16 + GradScaler over fp32 weights; zerokern keeps fp16
    # weights (fp32 masters) with its dynamic loss scale. Measured 7.2e-6 (stage 2).
    "fp16": 1e-3,
    "norm_fp32": 1e-5,  # global norm, fp32 sums in another order; measured <= 2.1e-7
}
_TMP = tempfile.mkdtemp(prefix="zk_hf_")
atexit.register(shutil.rmtree, _TMP, True)


def _rel(a, b):
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _worker(rank, ws, tmp):
    d = f"{tmp}/n{ws}"
    cases = {"trainer-ref-fp32": lambda: H.trainer_run(rank, f"{d}/ref")}
    for s in (0, 1, 2, 3):
        cases[f"trainer-s{s}-fp32"] = lambda s=s: H.trainer_run(rank, f"{d}/s{s}", zero_stage=s)
    cases["accelerate-ref-fp32"] = lambda: H.accelerate_run(rank)
    for s in (0, 1, 2, 3):
        cases[f"accelerate-s{s}-fp32"] = lambda s=s: H.accelerate_run(rank, zero_stage=s)
    if ws == 2:
        cases["trainer-ref-bf16"] = lambda: H.trainer_run(rank, f"{d}/rb", precision="bf16")
        cases["trainer-ref-fp16"] = lambda: H.trainer_run(rank, f"{d}/rh", precision="fp16")
        for s in (2, 3):
            cases[f"trainer-s{s}-fp16"] = lambda s=s: H.trainer_run(
                rank, f"{d}/h{s}", zero_stage=s, precision="fp16")
        cases["accelerate-ref-bf16"] = lambda: H.accelerate_run(rank, precision="bf16")
        for s in (1, 3):
            cases[f"trainer-s{s}-bf16"] = lambda s=s: H.trainer_run(
                rank, f"{d}/b{s}", zero_stage=s, precision="bf16")
            cases[f"accelerate-s{s}-bf16"] = lambda s=s: H.accelerate_run(
                rank, zero_stage=s, precision="bf16")
        # stage 3: checkpoints every 5 steps (resumed at N = 1 below), save_model at the end
        cases["trainer-s3-save"] = lambda: H.trainer_run(
            rank, f"{d}/save", zero_stage=3, save_steps=5, save_model_to=f"{d}/final")
        if _has_peft():
            cases["trainer-ref-lora"] = lambda: H.trainer_run(rank, f"{d}/lr", lora=True,
                                                              steps=5)
            cases["trainer-s3-lora"] = lambda: H.trainer_run(rank, f"{d}/l3", zero_stage=3,
                                                             lora=True, steps=5)
        # negative control: weight decay on every param, not Trainer's no-decay groups
        cases["trainer-s2-negative"] = lambda: H.trainer_run(rank, f"{d}/neg", zero_stage=2,
                                                             weight_decay=0.5)
    else:
        cases["resume-from-n2"] = lambda: H.trainer_run(
            rank, f"{d}/resume", zero_stage=1, resume=f"{tmp}/n2/save/checkpoint-5")
        cases["from-pretrained"] = lambda: _from_pretrained(f"{tmp}/n2/final")
    return run_cases(cases)


def _has_peft() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def _from_pretrained(path):
    from transformers import GPT2LMHeadModel

    m = GPT2LMHeadModel.from_pretrained(path)
    return {n: p.detach().float().clone() for n, p in m.named_parameters()}


def _n2():
    return cached(_worker, 2, _TMP)


def _n1():
    _n2()  # writes the checkpoint and the saved model the N = 1 cases read
    return cached(_worker, 1, _TMP)


def _runs(ws):
    return _n2() if ws == 2 else _n1()


# [Note: the slow mark]: the N=1 group (a resume of the N=2 checkpoint and from_pretrained of
# its saved model, ~20 s on 2 cores) runs in CI's -m slow pass; N=2 in the default suite
@pytest.mark.parametrize("ws", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["trainer", "accelerate"])
def test_fp32_matches_ddp_adamw(kind, stage, ws):
    res = _runs(ws)
    for ref, z in zip(case(res, f"{kind}-ref-fp32"), case(res, f"{kind}-s{stage}-fp32")):
        assert z["stage"] == stage and z["ddp"] != "DistributedDataParallel"
        assert _rel(z["losses"], ref["losses"]) <= TOL["fp32"]
        assert _rel(z["norms"], ref["norms"]) <= TOL["norm_fp32"]  # the real global norm


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", ["trainer", "accelerate"])
def test_bf16_matches_autocast_ddp(kind, stage):
    res = _n2()
    for ref, z in zip(case(res, f"{kind}-ref-bf16"), case(res, f"{kind}-s{stage}-bf16")):
        assert z["stage"] == stage
        assert _rel(z["losses"], ref["losses"]) <= TOL["bf16"]


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_fp16_matches_autocast_gradscaler_ddp(stage):
    res = _n2()
    for ref, z in zip(case(res, "trainer-ref-fp16"), case(res, f"trainer-s{stage}-fp16")):
        assert z["stage"] == stage
        assert _rel(z["losses"], ref["losses"]) <= TOL["fp16"]


def test_negative_control():
    res = _n2()
    for ref, z in zip(case(res, "trainer-ref-fp32"), case(res, "trainer-s2-negative")):
        assert _rel(z["losses"], ref["losses"]) > TOL["fp32"]


@pytest.mark.slow  # the N=1 group (see test_fp32_matches_ddp_adamw)
def test_stage3_save_model_loads_with_from_pretrained():
    saved = case(_n2(), "trainer-s3-save")[0]["final"]
    loaded = case(_n1(), "from-pretrained")[0]
    assert saved.keys() <= loaded.keys()
    for n, p in saved.items():
        assert torch.equal(loaded[n], p), n


@pytest.mark.slow  # the N=1 group (see test_fp32_matches_ddp_adamw)
def test_resume_stage3_n2_checkpoint_at_stage1_n1():
    from zerokern.checkpoint import consolidate

    r = case(_n1(), "resume-from-n2")[0]
    assert r["global_step"] == H.STEPS and len(r["losses"]) == (H.STEPS - 5) * H.GAS
    sd = consolidate(f"{_TMP}/n2/save/checkpoint-5/zerokern")
    for n, p in r["first_params"].items():
        assert torch.equal(p, sd[n].float()), n  # the masters of step 5, resharded 2 -> 1


def test_peft_lora_stage3_matches_ddp():
    if not _has_peft():
        pytest.skip("peft is not installed")
    res = _n2()
    for ref, z in zip(case(res, "trainer-ref-lora"), case(res, "trainer-s3-lora")):
        assert z["stage"] == 3
        assert _rel(z["losses"], ref["losses"]) <= TOL["fp32"]
