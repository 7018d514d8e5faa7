"""The optimizers' docstrings say what their rules support (issue 36, item 5): `ZeroAdamW`'s
`state_bits=8` paragraph said "offload None or 'cpu'" while the 8-bit rule runs with every
offload, NVMe included (bit for bit the device's update: tests/state/test_nvme_rules.py).
Each offload the rule supports (`Rule.unsupported`, zerokern.rules [Note: what a rule
supports]) must be named in the paragraph, and one it refuses must not be offered."""

from __future__ import annotations

import re

import pytest

import zerokern as zk
from zerokern.options.args import OFFLOADS
from zerokern.rules.adamw8bit import adamw_rule_for_bits


def state_bits_paragraph() -> str:
    doc = zk.ZeroAdamW.__doc__
    m = re.search(r"state_bits:(.*?)(?=\n\s{8}\w+(?: \([^)]*\))?:)", doc, re.S)
    assert m, "ZeroAdamW's docstring documents state_bits"
    return m.group(1)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_state_bits_doc_names_the_offloads_the_rule_supports(offload):
    text = state_bits_paragraph()
    supported = adamw_rule_for_bits(8).unsupported(offload=offload) is None
    named = repr(offload).replace("'", '"') in text or (offload is None and "None" in text)
    assert supported == named, (offload, supported, text)
