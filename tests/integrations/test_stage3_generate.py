"""Stage-3 `generate()` with ranks that stop at different lengths (issue 21, item 7): a tiny
random-init GPT-2, greedy decoding, an EOS token that rank 0 emits early and rank 1 never
does, N = 2 and 3. Reference: the same model without zerokern (plain `generate` on each rank's
own prompt, no collectives): the tokens must be equal. Before the fix rank 1 waited in an
all-gather for the process-group timeout. Also: an explicit synced_gpus=False (warned, synced
anyway), and a PEFT LoRA model's generate (it calls the base model's, below the root unit's
gather hook: it failed on every rank with "'weight' must be 2-D", also at N = 1). The test
asserts its own precondition (rank 0 stopped early, the others did not: the case that hung);
run on the code before the fix it fails with the ranks' gloo timeout."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from tests.engine import common as C  # noqa: E402
from tests.support.harness import cached, case, run_cases, ws_params  # noqa: E402

NEW = 8  # max_new_tokens


def _prompt(rank, k):
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randint(0, C.VOCAB, (1, 4), generator=g)


def _greedy(model, x, eos=None, **kw):
    return model.generate(x, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, **kw)[0, x.shape[1]:].tolist()


def _pick(ws, wrap=lambda m: m):
    """Prompts and an EOS token such that rank 0 stops after 2 tokens and the others never
    stop early (decided by the plain model on every rank alike: no collective)."""
    plain = wrap(C.gpt2())
    for k in range(200):
        outs = [_greedy(plain, _prompt(r, k)) for r in range(ws)]
        eos = outs[0][1]
        if eos not in outs[0][:1] and all(eos not in o for o in outs[1:]):
            return k, eos
    raise AssertionError("no prompt set found")


def _lora(model):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: random A and B, so the adapters change the tokens
    return get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"],
                                            init_lora_weights=False))


def _generate(rank, ws, synced=None, peft=False):
    import zerokern as zk

    wrap = _lora if peft else (lambda m: m)
    k, eos = _pick(ws, wrap)
    x = _prompt(rank, k)
    ref = _greedy(wrap(C.gpt2()), x, eos)  # plain transformers (+ PEFT), this rank alone
    model = wrap(C.gpt2())
    opt = zk.ZeroAdamW(model, stage=3, precision="fp32")  # noqa: F841 (its hooks live with it)
    kw = {} if synced is None else {"synced_gpus": synced}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = _greedy(model, x, eos, **kw)
    warned = any("synced_gpus" in str(m.message) for m in w)
    return {"out": out, "ref": ref, "eos": eos, "warned": warned}


def _worker(rank, ws):
    cases = {"default": lambda: _generate(rank, ws),
             "explicit-false": lambda: _generate(rank, ws, synced=False)}
    if ws == 2:
        cases["peft"] = lambda: _generate(rank, ws, peft=True)
    return run_cases(cases)


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("ws", ws_params(2, 3))
@pytest.mark.parametrize("name", ["default", "explicit-false", "peft"])
def test_stage3_generate_ranks_stop_at_different_lengths(name, ws):
    if name == "peft":
        pytest.importorskip("peft")
        if ws != 2:
            pytest.skip("PEFT: N = 2 only (one spawn)")
    res = case(cached(_worker, ws), name)
    assert len(res[0]["out"]) < NEW and res[0]["out"][-1] == res[0]["eos"]  # rank 0 stopped
    assert all(len(r["out"]) == NEW for r in res[1:])  # the others went on
    for r in res:
        assert r["out"] == r["ref"]  # the tokens plain transformers gives
        assert r["warned"] == (name == "explicit-false")


def test_peft_generate_stage3_n1():
    """N = 1, in this process: PEFT's generate below the root unit (no collective at all)."""
    pytest.importorskip("peft")
    r = _generate(0, 1, peft=True)
    assert r["out"] == r["ref"] and not r["warned"]
