"""The CPU block-quantization codec's paths (csrc/cpu/blockquant_cpu.cpp, issue 40): the AVX-512
bodies and the portable ones, each bitwise the reference (kernels/blockquant.py), for
quantize, dequantize and the fused dequantize-add that qgZ's CPU path sums with; the codes of
the AVX-512 quantizer, which multiplies by 1/scale and divides only near a rounding boundary
([Note: codes without a division per element]), on values placed within a few ulps of k + 1/2
(negative control: rounding x * (1/scale) without the fix-up gets some of them wrong) and on
scales too small for a reciprocal; and the into-buffer calls on payload rows (uint8 views at
an offset), as comm/quantized.py makes them.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels import blockquant as ref


@pytest.fixture(scope="module")
def op():
    from zerokern.kernels import load_op

    op = load_op("cpu")
    yield op
    op.force_isa("auto")


def _isas(op):
    """The dispatcher's ISAs this CPU runs (avx2 selects the portable bodies, as scalar)."""
    feats = op.cpu_features()
    return ["scalar"] + [isa for isa, flag in (("avx2", "avx2"), ("avx512", "avx512f"))
                         if feats.get(flag)]


def _data(nblocks, block, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = nblocks * block
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]
    if nblocks > 2:
        x[block:2 * block] = 0.0  # an all-zero block
    return x.to(dtype)


def _bits_view(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_every_isa_is_bitwise_the_reference(op, bits, block):
    codec = ref.NativeCodec(op)
    for isa in _isas(op):
        op.force_isa(isa)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for nblocks in (1, 3, 17, 301):
                x = _data(nblocks, block, dtype, nblocks + block + bits)
                c_ref, s_ref = ref.quantize(x, block, bits)
                c, s = codec.quantize(x, block, bits)
                assert torch.equal(s, s_ref) and torch.equal(c, c_ref), (isa, dtype, nblocks)
                for out in (torch.float32, torch.bfloat16, torch.float16):
                    d = codec.dequantize(c, s, block, bits, out)
                    assert torch.equal(_bits_view(d), _bits_view(
                        ref.dequantize(c_ref, s_ref, block, bits, out))), (isa, dtype, out)
                acc = torch.randn(x.numel())
                want = acc + ref.dequantize(c_ref, s_ref, block, bits)
                codec.dequantize_add_(c, s, acc, block, bits)
                assert torch.equal(_bits_view(acc), _bits_view(want)), (isa, dtype, nblocks)
    op.force_isa("auto")


def _near_ties(seed, blocks=64):
    """Blocks of absmax a (so scale = a/127) whose other elements are (k + 1/2)·scale moved by
    -3..3 ulps: x / scale lands within a few ulps of a rounding boundary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(blocks):
        a = float(10 ** (torch.rand(1, generator=g) * 60 - 30))
        s = torch.tensor(a, dtype=torch.float32) / 127
        t = (torch.randint(-127, 127, (127,), generator=g).float() + 0.5) * s
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
            up = torch.rand(127, generator=g) < 0.5
            t = torch.nextafter(t, torch.where(up, torch.tensor(float("inf")),
                                               torch.tensor(float("-inf"))))
        rows.append(torch.cat([torch.tensor([a], dtype=torch.float32), t]))
    return torch.cat(rows)


def test_codes_near_rounding_boundaries_and_tiny_scales(op):
    codec = ref.NativeCodec(op)
    x = _near_ties(7)
    c_ref, s_ref = ref.quantize(x, 128, 8)
    # negative control: the reciprocal product alone rounds some of these the other way
    s = s_ref.repeat_interleave(128)
    by_mul = torch.round(x * (1 / s)).clamp(-127, 127).to(torch.int8)
    assert (by_mul != c_ref).any()
    tiny = _data(8, 128, torch.float32, 3) * 1e-41  # subnormal absmax: 1/scale overflows
    for isa in _isas(op):
        op.force_isa(isa)
        for v in (x, tiny):
            for bits in (8, 4):
                c_ref, s_ref = ref.quantize(v, 128, bits)
                c, sc = codec.quantize(v, 128, bits)
                assert torch.equal(sc, s_ref) and torch.equal(c, c_ref), (isa, bits)
    op.force_isa("auto")


def test_nonfinite_block_has_codes_zero_and_decodes_nonfinite(op):
    codec = ref.NativeCodec(op)
    for isa in _isas(op):
        op.force_isa(isa)
        for bad in (float("inf"), float("nan")):
            y = torch.randn(384)
            y[130] = bad
            c, s = codec.quantize(y, 128, 8)
            assert not torch.isfinite(s[1]) and torch.isfinite(s[[0, 2]]).all()
            d = codec.dequantize(c, s, 128, 8)
            assert not torch.isfinite(d[128:256]).any() and torch.isfinite(d[:128]).all()
            if isa == "avx512":
                assert (c[128:256] == 0).all()
    op.force_isa("auto")


@pytest.mark.parametrize("bits", [8, 4])
def test_into_payload_rows_at_an_offset(op, bits):
    """quantize_into / dequantize_into on views of a uint8 payload, as the collectives make
    them ([Note: one payload per piece]): the same bytes and values as the reference."""
    codec = ref.NativeCodec(op)
    c = 1024
    x = _data(c // 128, 128, torch.float32, 11)
    nc = c * bits // 8
    P = nc + 4 * (c // 128)
    payload = torch.full((3, P), 0xAB, dtype=torch.uint8)
    codec.quantize_into(x, payload[1, :nc], payload[1, nc:].view(torch.float32), 128, bits)
    c_ref, s_ref = ref.quantize(x, 128, bits)
    assert torch.equal(payload[1, :nc], c_ref.view(torch.uint8))
    assert torch.equal(payload[1, nc:].view(torch.float32), s_ref)
    assert (payload[[0, 2]] == 0xAB).all()  # the neighbouring rows untouched
    out = torch.full((3, c), float("nan"))
    codec.dequantize_into(payload[1, :nc], payload[1, nc:].view(torch.float32), out[2], 128,
                          bits)
    assert torch.equal(out[2], ref.dequantize(c_ref, s_ref, 128, bits))
    assert torch.isnan(out[:2]).all()


def _near_ties_q(seed, q, dtype, blocks=48):
    """As `_near_ties` for any Q and input dtype: per block an absmax a (scale a/Q) and
    elements (k + 1/2)·scale moved by a few ulps of the input dtype (bf16/fp16: the nearest
    representable values, so exact ties are common too)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(blocks):
        a = torch.tensor(float(10 ** (torch.rand(1, generator=g) * 8 - 4)), dtype=dtype)
        s = a.float() / q
        t = ((torch.randint(-q, q, (127,), generator=g).float() + 0.5) * s).to(dtype)
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            up = torch.rand(127, generator=g) < 0.5
            t = torch.nextafter(t, torch.where(up, torch.tensor(float("inf"), dtype=dtype),
                                               torch.tensor(float("-inf"), dtype=dtype)))
        rows.append(torch.cat([a.view(1), t]))
    return torch.cat(rows)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_near_ties_every_width_and_input_dtype(op, bits, dtype):
    """Codes within a few ulps of k + 1/2 for int4 as for int8 and from 16-bit input, whose
    widening and packing orders the AVX-512 quantizer permutes ([Note: the quantizer's
    instruction budget]); 47 blocks: two groups of 16 and a partial one."""
    codec = ref.NativeCodec(op)
    q = ref.BITS_Q[bits]
    x = _near_ties_q(bits * 10 + len(str(dtype)), q, dtype, blocks=47)
    c_ref, s_ref = ref.quantize(x, 128, bits)
    if dtype == torch.float32:  # negative control: the product alone misrounds some
        s = s_ref.repeat_interleave(128)
        by_mul = torch.round(x * (1 / s)).clamp(-q, q).to(torch.int8)
        want = c_ref if bits == 8 else ref.unpack_int4(c_ref)
        assert (by_mul != want).any()
    for isa in _isas(op):
        op.force_isa(isa)
        for block in (32, 64, 128):
            c_ref, s_ref = ref.quantize(x, block, bits)
            c, s = codec.quantize(x, block, bits)
            assert torch.equal(s, s_ref) and torch.equal(c, c_ref), (isa, block)
    op.force_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_of_either_sign_in_any_block_of_a_group(op, dtype):
    """-NaN, NaN, -inf and inf, each alone in a block at several places of a 16-block group
    (the AVX-512 absmax compares |x|'s bits: a NaN's exceed inf's whatever the sign): that
    block's scale is NaN or inf and its codes 0; every other block is the reference's."""
    codec = ref.NativeCodec(op)
    nan = float("nan")
    bads = (nan, -nan, float("inf"), float("-inf"))
    for isa in _isas(op):
        op.force_isa(isa)
        for bits in (8, 4):
            for k, bad in enumerate(bads):
                x = _data(21, 64, torch.float32, 5 + k)
                where = (0, 15 * 64 + 63, 16 * 64 + 7, 20 * 64 + 31)
                for w in where:
                    x[w] = bad
                x = x.to(dtype)
                c, s = codec.quantize(x, 64, bits)
                bad_blocks = [w // 64 for w in where]
                assert torch.isnan(s[bad_blocks]).all() if bad != bad else \
                    torch.isinf(s[bad_blocks]).all(), (isa, bits, bad)
                good = [b for b in range(21) if b not in bad_blocks]
                c_ref, s_ref = ref.quantize(x, 64, bits)
                assert torch.equal(s[good], s_ref[good]), (isa, bits, bad)
                per = 64 * bits // 8
                cb, cb_ref = c.view(21, per), c_ref.view(21, per)
                assert torch.equal(cb[good], cb_ref[good]), (isa, bits, bad)
                if isa == "avx512":
                    assert (cb[bad_blocks] == 0).all()
    op.force_isa("auto")


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_edge_scales_every_out_dtype(op, bits):
    """Decoding arbitrary codes with scales whose products are subnormal, overflow to inf,
    or are NaN / inf (a non-finite block, or bytes off the wire): every finite value bitwise
    the reference's in fp32, bf16 and fp16 (and the fused add), NaN where it has NaN. The
    AVX-512 decoder converts to bf16 without a NaN fix-up when the scale is finite, and reads
    int4 values from a per-block table ([Note: the quantizer's instruction budget])."""
    codec = ref.NativeCodec(op)
    g = torch.Generator().manual_seed(bits)
    nblocks, block = 40, 64
    n = nblocks * block
    codes = torch.randint(0, 256, (n * bits // 8,), generator=g, dtype=torch.uint8)
    if bits == 8:
        codes = codes.view(torch.int8).clamp(-127, 127)
    scale = torch.randn(nblocks, generator=g).abs() * 10 ** torch.randint(
        -44, 39, (nblocks,), generator=g).float()
    scale[:6] = torch.tensor([0.0, 1e-45, 3e38, float("nan"), float("inf"), 1e-40])
    # code · s halfway between two bf16 values (low 16 bits 0x8000): ties to even both ways
    scale[6:10] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 2 ** -100 * (1 + 2 ** -8),
                                2 ** 60 * (1 + 3 * 2 ** -8)])
    want32 = ref.dequantize(codes, scale, block, bits)
    for isa in _isas(op):
        op.force_isa(isa)
        for out in (torch.float32, torch.bfloat16, torch.float16):
            d = codec.dequantize(codes, scale, block, bits, out)
            want = ref.dequantize(codes, scale, block, bits, out)
            fin = torch.isfinite(want) | torch.isinf(want)
            assert torch.equal(_bits_view(d)[fin], _bits_view(want)[fin]), (isa, out)
            assert torch.equal(torch.isnan(d), torch.isnan(want)), (isa, out)
        acc = torch.randn(n, generator=g)
        want_acc = acc + want32
        codec.dequantize_add_(codes, scale, acc, block, bits)
        fin = ~torch.isnan(want_acc)
        assert torch.equal(_bits_view(acc)[fin], _bits_view(want_acc)[fin]), isa
        assert torch.equal(torch.isnan(acc), torch.isnan(want_acc)), isa
    op.force_isa("auto")
