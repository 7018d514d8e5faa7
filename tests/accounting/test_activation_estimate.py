"""The activation estimate (zerokern.accounting.activations, issue 37) against measurement.

The estimate traces one forward to the loss on CPU fake tensors under the policy; the
measurement is the same live-storage meter over a real CPU forward of the same model (bytes
still held for backward when the forward has returned: saved tensors, checkpointed inputs,
kept outputs; unique storages, params and inputs excluded). For the policy None a
saved_tensors_hooks meter over the real forward counts the same bytes (less the loss scalar
itself), an independent check of the meter. Issue 37 asks for 5%; they agree to the byte.

Models: zerokern.tools.gpt, HF GPT-2 and LLaMA (tiny random-init configs, no download), at two
sequence lengths each, for none / full / selective (the HF second length is `slow`).
"""

from __future__ import annotations

import json

import pytest
import torch

from zerokern import cli
from zerokern.accounting import activations as A
from zerokern.tools.gpt import build_gpt


def _gpt():
    return build_gpt("tiny", seed=1, seq=64)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                      n_positions=128, bos_token_id=0, eos_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=128))


MODELS = {"gpt": _gpt, "gpt2": _gpt2, "llama": _llama}
POLICIES = [None, "full", "selective"]


def _check(name: str, seq: int) -> None:
    model = MODELS[name]()
    model.train()
    t = {}
    for policy in POLICIES:
        est = A.trace(model, 2, seq, policy)
        t[policy] = est["total"]
        got = A.measure(model, 2, seq, policy)
        assert abs(est["total"] - got["total"]) <= 0.05 * got["total"], (name, seq, policy,
                                                                         est, got)
        assert est["total"] == got["total"], (name, seq, policy)  # in fact exact
        assert est["per_unit"] == got["per_unit"], (name, seq, policy)
        if policy is None:  # the saved-tensor hooks see the same (less the loss scalar)
            assert 0 <= got["total"] - got["saved_hooks"] <= 16, got
    # what the policies keep: full < selective < none
    assert t["full"] < t["selective"] < t[None], t


# [Note: the slow mark]: the zerokern GPT in the default suite; the Hugging Face models (25 s of
# a default run of ~830 s on 2 cores) in CI's -m slow pass, with the second length
@pytest.mark.parametrize("name,seq", [("gpt", 32), pytest.param("gpt2", 32, marks=pytest.mark.slow),
                                      pytest.param("llama", 32, marks=pytest.mark.slow)])
def test_trace_equals_the_cpu_measurement(name, seq):
    _check(name, seq)


@pytest.mark.slow
@pytest.mark.parametrize("name,seq", [("gpt", 64), ("gpt2", 64), ("llama", 64)])
def test_trace_equals_the_cpu_measurement_second_length(name, seq):
    _check(name, seq)


def test_offload_moves_the_units_saved_tensors_to_the_host():
    model = _gpt()
    none = A.trace(model, 2, 32, None)
    off = A.trace(model, 2, 32, "offload")
    assert off["total"] == none["total"]  # nothing recomputed, nothing dropped
    # the host copies are what the units saved (each unit's output is saved by the next
    # unit's first op, or by the root's final norm: outside a unit, so on the device)
    assert 0 < off["host"] <= sum(none["per_unit"])
    est = A.activation_estimate(model, 2, 32, "offload")
    assert est["device"] + est["host"] == none["total"]
    assert est["recompute"] == max(none["per_unit"])


def test_the_estimate_does_not_touch_the_model():
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fwd = model.blocks[0].forward
    A.activation_estimate(model, 2, 32, "selective")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.blocks[0].forward == fwd and "forward" not in model.blocks[0].__dict__


def test_tp_partition_and_cpu_checkpointing():
    model = _gpt()
    full = A.activation_estimate(model, 2, 32, "full")
    tp = A.activation_estimate(model, 2, 32, "full", tp=2, partition_activations=True,
                               cpu_checkpointing=True)
    ck = full["checkpoint_inputs"]
    assert ck > 0 and tp["checkpoint_inputs"] == ck // 2
    assert tp["host"] == ck // 2
    assert tp["device"] == (full["device"] - ck) // 2
    with pytest.raises(ValueError, match="--tp > 1"):
        A.activation_estimate(model, 2, 32, "full", partition_activations=True)
    with pytest.raises(ValueError, match="full or selective"):
        A.activation_estimate(model, 2, 32, None, cpu_checkpointing=True)


def _cli(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's error()
        rc = e.code
    return rc, capsys.readouterr()


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_cli_prints_the_whole_peak(capsys):
    rc, out = _cli(capsys, "estimate", "--model", "tiny", "--batch", "2", "--seq", "32",
                   "--activation-checkpointing", "full", "--stage", "3", "--world-size", "2",
                   "--precision", "fp32", "--json")
    assert rc == 0, out.err
    r = json.loads(out.out)["results"][0]
    a = r["activations"]
    want = A.activation_estimate(build_gpt("tiny"), 2, 32, "full", dtype=torch.float32)
    assert a["device"] == want["device"] and a["recompute"] == want["recompute"]
    assert r["whole_peak"] == (r["device_total"] + r["live_units_bound"] + a["device"]
                               + a["recompute"])
    rc, out = _cli(capsys, "estimate", "--model", "tiny", "--batch", "2", "--seq", "32",
                   "--activation-checkpointing", "offload", "--stage", "2")
    assert rc == 0, out.err
    assert "activations (offload, 2x32)" in out.out and "activations on the host" in out.out
    assert "whole peak on the device" in out.out


@pytest.mark.parametrize("argv,msg", [
    (["--model", "tiny", "--batch", "2"], "both --batch and --seq"),
    (["--params", "1000", "--batch", "2", "--seq", "8"], "needs --model"),
    (["--model", "tiny", "--batch", "2", "--seq", "8", "--partition-activations",
      "--activation-checkpointing", "full"], "--tp > 1"),
])
def test_cli_refuses_bad_activation_flags(capsys, argv, msg):
    rc, out = _cli(capsys, "estimate", *argv)
    assert rc != 0 and msg in out.err, (rc, out.err)
