"""The built-in rules by name: the registry the engine's defaults, `zerokern estimate`, the CLI
and checkpoints look rules up in.

A module of its own, importing the concrete rules at the top: the package's `__init__` (the
`Rule` interface) imports none of them, so no import runs from the interface back down to the
rules that subclass it, and the import-linter sees every edge (issue 35: the lazy imports that
hid that loop are gone).
"""

from __future__ import annotations

from zerokern.rules import Rule, check_rule
from zerokern.rules.adafactor import ADAFACTOR
from zerokern.rules.adamw import ADAMW
from zerokern.rules.adamw8bit import ADAMW8BIT
from zerokern.rules.lion import LION
from zerokern.rules.muon import MUON

RULES = {"adamw": ADAMW, "adamw8bit": ADAMW8BIT, "lion": LION, "muon": MUON,
         "adafactor": ADAFACTOR}


def adamw_rule() -> Rule:
    """The default rule (ZeroAdamW's), for callers that build buffers without an optimizer."""
    return ADAMW


def rule_by_name(name) -> Rule:
    """The built-in rules by name ("adamw", "adamw8bit", "lion", "muon", "adafactor"):
    estimate's and the CLI's `optimizer=` (the "muon" rule alone: ZeroMuon's AdamW params are
    the estimate's to add); a Rule is checked and returned as it is.

    Args:
        name: a rule's name, or a `Rule`.

    Raises:
        ValueError: an unknown name.
    """
    if isinstance(name, Rule):
        return check_rule(name)
    if name not in RULES:
        raise ValueError(f"optimizer must be one of {tuple(RULES)} (or a zerokern.rules.Rule), "
                         f"got {name!r}")
    return RULES[name]
