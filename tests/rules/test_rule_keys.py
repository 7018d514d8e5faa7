"""Unknown keys for a rule (issue 36, item 2; zerokern.rules [Note: a rule's keys]).

`ZeroOptimizer(rule=LION, defaults={..., "eps": 1e-8})` used to accept `eps` and train without
it. Now a key of `defaults` that is not one of the rule's hyperparameters, and a param-group key
that names a hyperparameter the group's rule does not have (another optimizer's, or a near-miss
of one of its own), are a ValueError naming the key, the group and the rule, before the model
is touched. Keys that name no hyperparameter (a group's "name", a scheduler's "initial_lr",
Megatron's "lr_mult") stay allowed, as torch allows them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zerokern as zk
from zerokern.core.optimizer import ZeroOptimizer
from zerokern.rules.adamw import ADAMW
from zerokern.rules.lion import LION

from ..support.sgd_rule import SGD

LION_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))


def groups(m, **extra):
    """Two groups: the weights (with `extra`), the biases."""
    return [{"params": [m[0].weight, m[2].weight], **extra},
            {"params": [m[0].bias, m[2].bias]}]


def _raises(match, fn):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("rule,defaults,key", [
    (LION, {**LION_DEFAULTS, "eps": 1e-8}, "eps"),                    # the case
    (LION, {**LION_DEFAULTS, "momentum": 0.9}, "momentum"),
    (ADAMW, {**ADAMW_DEFAULTS, "amsgrad": True}, "amsgrad"),
    (ADAMW, {**ADAMW_DEFAULTS, "weight_decy": 0.1}, "weight_decy"),  # any unknown key
    (SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "nesterov": True}, "nesterov"),
])
def test_unknown_default_key(rule, defaults, key):
    m = model()
    msg = _raises(f"defaults: '{key}' is not a hyperparameter of the '{rule.name}' rule",
                  lambda: ZeroOptimizer(m, rule, defaults, stage=0, precision="fp32"))
    assert ", ".join(rule.defaults) in msg  # says what the rule takes


def test_unknown_default_key_rule_per_group():
    """With a rule per group `defaults` fills the groups that lack a key: each key must be
    some rule's (eps is AdamW's: accepted, it fills the AdamW group only)."""
    m = model()
    _raises(r"defaults: 'foo' is not a hyperparameter of any of the rules \('lion', 'adamw'\)",
            lambda: ZeroOptimizer(groups(m), [LION, ADAMW], {**ADAMW_DEFAULTS, "foo": 1},
                                  stage=0, precision="fp32"))
    opt = ZeroOptimizer(groups(m, **LION_DEFAULTS), [LION, ADAMW], ADAMW_DEFAULTS, stage=0,
                        precision="fp32")
    assert opt.rules == [LION, ADAMW]


@pytest.mark.parametrize("key,value,hint", [
    ("eps", 1e-8, ""),                         # AdamW's, in a Lion group
    ("momentum", 0.9, ""),                     # SGD's / Muon's
    ("decoupled_weight_decay", True, ""),      # lion-pytorch's / torch Adam's
    ("weight_decy", 0.5, "did you mean 'weight_decay'"),
    ("beta", (0.9, 0.9), "did you mean 'betas'"),
])
def test_lion_group_key(key, value, hint):
    m = model()
    before = [p.detach().clone() for p in m.parameters()]
    msg = _raises(f"param group 0: '{key}' is not a hyperparameter of the 'lion' rule",
                  lambda: zk.ZeroLion(m, precision="bf16", stage=3,
                                      param_groups=groups(m, **{key: value})))
    assert hint in msg
    # before anything changed: still fp32, same values, not sharded
    assert all(p.dtype == torch.float32 and torch.equal(p, b)
               for p, b in zip(m.parameters(), before))


@pytest.mark.parametrize("key", ["amsgrad", "maximize", "momentum", "nesterov", "use_muon",
                                 "ns_steps"])
def test_adamw_group_key(key):
    m = model()
    _raises(f"param group 1: '{key}' is not a hyperparameter of the 'adamw' rule",
            lambda: zk.ZeroAdamW(groups(m)[:1] + [{**groups(m)[1], key: False}],
                                 precision="fp32", stage=1))


def test_muon_group_keys():
    """ZeroMuon's own group key (use_muon) is allowed; another optimizer's key is not (a key
    of the other half's rule was refused already, by optimizer_muon.split_groups)."""
    m = model()
    opt = zk.ZeroMuon(m, precision="fp32", stage=0,
                      param_groups=[{"params": [m[0].weight, m[2].weight], "use_muon": True},
                                    {"params": [m[0].bias, m[2].bias], "use_muon": False}])
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    m = model()
    _raises("param group 0: 'dampening' is not a hyperparameter of the 'muon' rule",
            lambda: zk.ZeroMuon(m, precision="fp32", stage=0,
                                param_groups=groups(m, dampening=0.1)))


def test_keys_that_name_no_hyperparameter_are_allowed():
    """As torch: tags and scheduler keys ride along in a group."""
    m = model()
    opt = zk.ZeroLion(m, precision="fp32", stage=2,
                      param_groups=groups(m, name="weights", initial_lr=1e-3, lr_mult=2.0))
    assert opt.param_groups[0]["name"] == "weights"
    assert opt.param_groups[0]["weight_decay"] == 0.0  # the defaults filled the rest


def test_engine_config_lion_eps():
    """The engine already refused the config key (engine/optimizer_types.py); unchanged."""
    m = model()
    with pytest.raises(ValueError, match="optimizer.params.eps"):
        zk.initialize(model=m, config={"train_micro_batch_size_per_gpu": 1,
                                       "optimizer": {"type": "Lion",
                                                     "params": {"lr": 1e-3, "eps": 1e-8}}})
