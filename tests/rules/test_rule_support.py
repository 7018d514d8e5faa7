"""A rule declares what it runs with (zerokern.rules [Note: what a rule supports]).

- The built-in rules (AdamW, 8-bit AdamW, Lion, Muon) run with every offload and master:
  `unsupported()` is None for all of them (Muon declares `nvme_passes` and
  `compact_master_ok`); before issue 23's remainders the engine refused Muon with
  offload="nvme" / master="compact" and 8-bit AdamW with offload="nvme" by their type/states.
- A phased rule that declares neither: ZeroOptimizer(rule=[...]) with offload="nvme" or
  master="compact" is a ValueError naming the argument and the rule, raised before anything
  changes (the model's values, no optimizer hook on a param, no file under offload_path); the
  same for `estimate(optimizer=rule)`; declaring `nvme_passes` lifts the refusal.
- zerokern.initialize asks the rules, not the optimizer's type, whether to use the compact
  master (`engine._rules_take`): a bf16 Muon config now gets it.
"""

from __future__ import annotations

import os

import pytest
import torch

import zerokern as zk
from zerokern.rules import Rule, StateSpec
from zerokern.rules.adamw import ADAMW
from zerokern.rules.adamw8bit import ADAMW8BIT
from zerokern.rules.lion import LION
from zerokern.rules.muon import MUON

from ..support import models as M


class PhasedRule(Rule):
    """A phased rule declaring nothing (its group step is never reached here)."""

    name = "phased-test"
    states = (StateSpec("buf"),)
    defaults = dict(lr=1e-3)
    phased = True

    def check_group(self, group, where=""):
        pass

    def hyper(self, group):
        return {"lr": group["lr"]}


@pytest.mark.parametrize("rule", [ADAMW, ADAMW8BIT, LION, MUON], ids=lambda r: r.name)
@pytest.mark.parametrize("offload", [None, "cpu", "nvme"])
@pytest.mark.parametrize("master", ["fp32", "compact"])
def test_builtin_rules_support_every_placement(rule, offload, master):
    assert rule.unsupported(offload=offload, master=master) is None


def test_a_phased_rule_declares_its_support():
    r = PhasedRule()
    assert r.unsupported(offload=None, master="fp32") is None
    assert r.unsupported(offload="cpu", master="fp32") is None
    arg, why = r.unsupported(offload="nvme")
    assert arg == "offload" and "phased-test" in why and "nvme_passes" in why
    arg, why = r.unsupported(master="compact")
    assert arg == "master" and "phased-test" in why
    r.nvme_passes = (("master", "buf"),)
    r.compact_master_ok = True
    assert r.unsupported(offload="nvme", master="compact") is None


@pytest.mark.parametrize("kw,match", [
    (dict(offload="nvme", stage=2), r"offload: .*'phased-test'"),
    (dict(offload="nvme", stage=3), r"offload: .*'phased-test'"),
    (dict(master="compact", stage=1, precision="bf16"), r"master: .*'phased-test'"),
])
def test_unsupported_combination_is_an_error_before_anything_changes(kw, match, tmp_path):
    model = M.make_model()
    before = M.snapshot(model)
    groups = [{"params": [p for n, p in model.named_parameters() if p.dim() >= 2]},
              {"params": [p for n, p in model.named_parameters() if p.dim() < 2]}]
    if kw.get("offload") == "nvme":
        kw["offload_path"] = str(tmp_path)
    kw = {"precision": "fp32", "backend": "cpu", **kw}
    with pytest.raises(ValueError, match=match):
        zk.ZeroOptimizer(model, [PhasedRule(), ADAMW],
                         dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                              adamw=True), param_groups=groups, **kw)
    assert M.bitwise_equal(M.snapshot(model), before)
    assert not any(hasattr(p, "_zerokern_sync") for p in model.parameters())
    assert os.listdir(tmp_path) == []


def test_estimate_asks_the_rule():
    from zerokern.accounting import estimate as E

    spec = E.spec_from_numel(100_000)
    with pytest.raises(ValueError, match=r"offload: .*'phased-test'"):
        E.estimate(spec, 2, 2, "bf16", offload="nvme", optimizer=PhasedRule())
    for name in ("adamw8bit", "lion", "adamw"):  # these run over NVMe now: an estimate
        assert E.estimate(spec, 2, 2, "bf16", offload="nvme", optimizer=name)["disk"]


def test_initialize_gives_muon_the_compact_master():
    from zerokern.engine.config import EngineConfig  # noqa: F401 (the config type)
    from zerokern.engine.engine import _rules_take

    class Cfg:
        optimizer = {"type": "Muon", "params": {}}

    assert _rules_take(Cfg, None, master="compact")
    Cfg.optimizer = {"type": "AdamW", "params": {}}
    assert _rules_take(Cfg, None, master="compact")
    assert _rules_take(Cfg, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
                       master="compact")
