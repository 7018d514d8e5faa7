"""master="compact" (zerokern/compact_master.py): the fp32 master as low halves + tie bits under
the bf16 params, bit for bit.

Unit tests of compact/expand over adversarial bit patterns: all 2^16 low halves under several
high halves (both parities, ±0, subnormals, the largest finite values, ±inf), exact ties at
both parities, NaN refused by `verify`; a negative control (tie bits dropped) must fail.
The training tests (test_compact_master_training.py) compare whole runs with master="fp32".
"""

from __future__ import annotations

import pytest
import torch

import zerokern as zk
from zerokern.state import compact_master as C

# High halves (the bf16 pattern of hi << 16): +0, -0, smallest subnormals, 1.0 (0x3F80, even),
# 0x3F81 (odd), negatives of both parities, the largest finite (0x7F7F, 0xFF7F), the ones just
# below ±inf's neighbours, and ±inf itself (only low half 0 is not NaN there: filtered).
HIGHS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x7F7E, 0x7F7F,
         0xFF7E, 0xFF7F, 0x7F80, 0xFF80, 0x00FF, 0x0080, 0x807F]


def _patterns() -> torch.Tensor:
    """fp32 tensor of every (hi, lo) pair above, NaN patterns left out."""
    lo = torch.arange(65536, dtype=torch.int64)
    bits = torch.cat([(h << 16) | lo for h in HIGHS])
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    x = bits.view(torch.float32)
    return x[~torch.isnan(x)].contiguous()


def _roundtrip(x: torch.Tensor, drop_ties: bool = False) -> torch.Tensor:
    n = x.numel()
    pad = (-n) % 8
    x = torch.cat([x, torch.zeros(pad)])
    low = torch.empty(x.numel(), dtype=torch.int16)
    ties = torch.empty(x.numel() // 8, dtype=torch.uint8)
    C.compact_(low, ties, x)
    if drop_ties:
        ties.zero_()
    b = x.to(torch.bfloat16)
    out = C.expand_(torch.empty_like(x), low, ties, b)
    return out[:n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_every_low_half_under_every_high_half_roundtrips_bit_exactly():
    x = _patterns()
    assert x.numel() == 16 * 65536 + 2  # every low half of 16 high halves; ±inf: low 0 only
    assert torch.equal(_bits(_roundtrip(x)), _bits(x))


def test_exact_ties_at_both_parities_and_their_bits():
    # lo == 0x8000: hi odd rounds up (carry, a tie bit), hi even rounds down (no bit).
    his = torch.tensor([0x3F80, 0x3F81, 0x0000, 0x0001, 0xBF80, 0xBF81, 0x7F7E, 0x7F7F, 0xFF7F,
                        0x8001, 0x8000, 0x0002], dtype=torch.int64)
    bits = (his << 16) | 0x8000
    x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    low = torch.empty(16, dtype=torch.int16)
    ties = torch.empty(2, dtype=torch.uint8)
    full = torch.cat([x, torch.zeros(4)])
    C.compact_(low, ties, full)
    want = (his & 1).bool()
    assert torch.equal(C.unpack_ties(ties)[:12], want)
    assert torch.equal(_bits(_roundtrip(x)), _bits(x))
    # the largest odd finite value ties upwards into inf: still exact
    assert torch.isinf(x[7].to(torch.bfloat16))


def test_negative_control_without_tie_bits_the_roundtrip_fails():
    x = _patterns()
    out = _roundtrip(x, drop_ties=True)
    wrong = (_bits(out) != _bits(x))
    assert wrong.any()
    # exactly the ties with an odd high half
    ties = ((_bits(x) & 0xFFFF) == 0x8000) & (((_bits(x) >> 16) & 1) == 1)
    assert torch.equal(wrong, ties)


def test_random_values_and_specials():
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-40, 38, (100_000,),
                                                                           generator=g),
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45,
                                 torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max,
                                 torch.finfo(torch.float32).tiny, 3.0e38, 1.0, -1.0])])
    assert torch.equal(_bits(_roundtrip(x)), _bits(x))


@pytest.mark.parametrize("native", [True, False])
def test_cpu_op_and_torch_version_agree_bit_for_bit(native):
    """compact_/expand_ use the CPU op (csrc/cpu/compact_cpu.cpp) on the CPU; the torch
    version (other devices, or no build) must give the same bits, NaN flag included."""
    x = torch.cat([_patterns(), torch.zeros(6)])
    low, ties = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel() // 8,
                                                                       dtype=torch.uint8)
    nan = torch.zeros((), dtype=torch.bool)
    if native:
        assert C._native(x) is not None  # the op is built and used here
        C.compact_(low, ties, x, nan)
    else:
        C.compact_torch_(low, ties, x)
    low2, ties2 = torch.empty_like(low), torch.empty_like(ties)
    C.compact_torch_(low2, ties2, x)
    assert torch.equal(low, low2) and torch.equal(ties, ties2) and not bool(nan)
    out = C.expand_(torch.empty_like(x), low, ties, x.to(torch.bfloat16)) if native else \
        C.expand_torch_(torch.empty_like(x), low, ties, x.to(torch.bfloat16))
    assert torch.equal(_bits(out), _bits(x))
    y = x.clone()
    y.view(torch.int32)[5] = 0x7F800001  # a NaN sets the flag
    C.compact_(low, ties, y, nan)
    assert bool(nan)


def test_verify_refuses_nan_and_mismatch():
    x = torch.tensor([1.0, 2.5, -3.0, 0.0, 1e-40, float("inf"), -0.0, 7.0])
    b = x.to(torch.bfloat16)
    assert bool(C.verify(x, b))
    for nan_bits in (0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF):  # canonical too
        y = x.clone()
        y.view(torch.int32)[2] = nan_bits
        assert not bool(C.verify(y, y.to(torch.bfloat16)))
    y = x.clone()
    y[1] = 2.51  # a master that does not round to the param
    assert not bool(C.verify(y, b))


def test_option_is_validated_naming_the_argument():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="master must be one of"):
        zk.ZeroAdamW(m, stage=1, precision="bf16", master="half")
    with pytest.raises(ValueError, match="needs precision='bf16'"):
        zk.ZeroAdamW(m, stage=1, precision="fp16", master="compact")
    with pytest.raises(ValueError, match="needs precision='bf16'"):
        zk.ZeroAdamW(m, stage=1, precision="fp32", master="compact")
    with pytest.raises(ValueError, match="offload='cpu'"):
        zk.ZeroAdamW(m, stage=1, precision="bf16", master="compact", offload="cpu")
    with pytest.raises(ValueError, match="stages 0-2"):
        zk.ZeroAdamW(m, stage=3, precision="bf16", master="compact")
    assert m.weight.dtype == torch.float32  # nothing changed before the error


def test_single_process_bitwise_and_master_reads_expand_then_recompact():
    """World size 1, stage 1: bitwise the fp32-master run; reading master expands it (held),
    the next step compacts it again; a NaN master written from outside stays expanded."""
    def run(master, poke=False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
        opt = zk.ZeroAdamW(m, stage=1, precision="bf16", master=master, bucket_mb=0.001,
                           backend="reference")
        for s in range(3):
            x = torch.randn(8, 40, generator=torch.Generator().manual_seed(s)).bfloat16()
            m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            if poke and s == 1:
                g = opt.flat_groups[0]
                assert not g.state.expanded
                before = opt.memory_report()["measured"]["master"]
                _ = g.master
                assert g.state.expanded
                assert opt.memory_report()["measured"]["master"] == before + 4 * (g.state_numel -
                                                                     g.state_padding)
        return m, opt
    ma, oa = run("fp32")
    mb, ob = run("compact", poke=True)
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    st = ob.flat_groups[0].state
    assert not st.expanded and st.compact_pieces > 0
    assert torch.equal(oa.flat_groups[0].master.view(torch.int32),
                       ob.flat_groups[0].master.view(torch.int32))
    # a NaN written into the master from outside: the compaction refuses it, it stays expanded
    g = ob.flat_groups[0]
    g.master[3] = float("nan")
    x = torch.randn(8, 40).bfloat16()
    mb(x).float().square().mean().backward()
    ob.step()
    assert g.state.expanded


def test_a_step_that_makes_a_nan_master_raises_instead_of_keeping_other_bits():
    """The compact step proves exactness by construction except for NaN (its bits cannot be
    rebuilt from the bf16 param): an inf master with lr * weight_decay == 1 becomes inf * 0 =
    NaN in the kernel, and step() says so."""
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    opt = zk.ZeroAdamW(m, stage=1, precision="bf16", master="compact", backend="reference")

    def step():
        m(torch.randn(4, 16).bfloat16()).float().sum().backward()
        opt.step()
        opt.zero_grad()

    with torch.no_grad():
        m.weight[0, 0] = float("inf")  # taken into the master (model_sync), then compacted
    step()
    st = opt.flat_groups[0].state
    assert not st.expanded and st.compact_pieces == 0  # that step ran on the expanded master
    step()
    assert st.compact_pieces > 0 and torch.isinf(m.weight[0, 0])
    opt.param_groups[0]["lr"] = opt.param_groups[0]["weight_decay"] = 1.0
    with pytest.raises(RuntimeError, match="NaN in the fp32 master"):
        step()


def test_state_dicts_are_interchangeable_between_fp32_and_compact_masters():
    """opt.state_dict() holds a real fp32 master either way: a compact optimizer loads an
    fp32-master one's state and both then train bit for bit alike."""
    def build(master):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 3))
        return m, zk.ZeroAdamW(m, stage=2, precision="bf16", master=master, bucket_mb=0.001,
                               backend="reference")

    def step(m, opt, s):
        x = torch.randn(6, 24, generator=torch.Generator().manual_seed(s)).bfloat16()
        m(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    ma, oa = build("fp32")
    mb, ob = build("compact")
    for s in range(2):
        step(ma, oa, s)  # only the fp32 one trains; the compact one takes its state
    mb.load_state_dict(ma.state_dict())
    ob.load_state_dict(oa.state_dict())
    for s in range(2, 5):
        step(ma, oa, s)
        step(mb, ob, s)
    assert all(torch.equal(p.view(torch.int16), q.view(torch.int16))
               for p, q in zip(ma.parameters(), mb.parameters()))
    assert ob.flat_groups[0].state.compact_pieces > 0 and not ob.flat_groups[0].state.expanded
    a, b = oa.state_dict()["state"][0], ob.state_dict()["state"][0]
    assert all(torch.equal(a[k], b[k]) for k in a)
