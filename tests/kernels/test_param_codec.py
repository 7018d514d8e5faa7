"""The param codec (kernels/param_codec.py): the 16-bit cast-back as the kernels had it, and
FP8 params with a per-param scale agreed across ranks, against a float64 spec.

The spec (float64 where the format leaves no rounding to choose; the fp32 roundings the
format defines done explicitly):
    amax  = max |master| over the whole param (every rank's part)
    scale = fp32(amax / 448), 1 where amax = 0
    code  = e4m3(clamp(fp32(master / scale), +-448))       round to nearest even
    value = dtype(fp32(code * scale))
Ranks are simulated in one process here (a param split between two "ranks' pieces", whose
agreement is the MAX of both amax); tests/stage3/test_param_fp8.py runs them as gloo ranks
through ZeroAdamW.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels.param_codec import (
    FP8_DTYPE,
    Float8Codec,
    ParamCodec,
    check_param_format,
    make_param_codec,
)

# One tolerance table for this file: everything is exact (the spec rounds where the format does).
TOL = {
    "codes": 0,    # FP8 codes bitwise the spec's
    "decoded": 0,  # decoded 16-bit values bitwise the spec's
    "cast": 0,     # the 16-bit cast-back bitwise master.to(dtype)
}


def spec_param(master: torch.Tensor, dtype: torch.dtype):
    """The float64 spec of one whole param: (codes as fp32 values, decoded, scale)."""
    m = master.double()
    amax = m.abs().max()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    q = (m / scale.double()).float().clamp(-448, 448)
    codes = q.to(FP8_DTYPE)
    value = (codes.double() * scale.double()).float().to(dtype)
    return codes, value, scale


def _params(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    # per-param magnitudes apart (1e-3 .. 1e2), so one scale for all would lose the small ones
    return [torch.randn(n, generator=g) * 10.0 ** (i % 6 - 3) for i, n in enumerate(sizes)]


def _spans(sizes, lo, hi):
    """(slot, a, b) of flat [lo, hi) over params laid out back to back, local to lo."""
    out, off = [], 0
    for i, n in enumerate(sizes):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((i, a - lo, b - lo))
        off += n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_16bit_codec_is_the_kernels_cast_back(dtype):
    c = ParamCodec(dtype)
    params = torch.zeros(4097, dtype=dtype)
    master = torch.randn(4097) * 3
    assert c.has_master == (dtype != torch.float32)
    assert c.fused == (dtype != torch.float32)
    out = c.kernel_out(params)
    assert (out is params) if c.has_master else (out is None)
    c.cast_(params, master)
    assert TOL["cast"] == 0
    assert torch.equal(params.view(torch.uint8), master.to(dtype).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes", [(1,), (127, 4097), (5, 1, 300, 4097, 64)])
def test_fp8_one_rank_matches_spec(dtype, sizes):
    params = _params(sizes, seed=len(sizes))
    master = torch.cat(params)
    c = Float8Codec(dtype)
    assert c.kernel_out(torch.zeros(3, dtype=dtype)) is None  # the kernels write no FP8
    codes = torch.zeros(master.numel(), dtype=FP8_DTYPE)
    scales = torch.zeros(len(sizes))
    c.encode_(master, codes, _spans(sizes, 0, master.numel()), scales)
    out = torch.zeros(master.numel(), dtype=dtype)
    c.decode_(codes, out, _spans(sizes, 0, master.numel()), scales)
    off = 0
    for i, p in enumerate(params):
        s_codes, s_value, s_scale = spec_param(p, dtype)
        assert scales[i].item() == s_scale.item()
        assert torch.equal(codes[off:off + p.numel()].view(torch.uint8), s_codes.view(torch.uint8))
        assert torch.equal(out[off:off + p.numel()], s_value)
        # and the spec is a real quantization: 3 mantissa bits, relative error <= 2^-4 of amax
        rel = (s_value.double() - p.double()).abs().max() / p.double().abs().max()
        assert 0 < rel <= 2.0 ** -4 + 2.0 ** -8
        off += p.numel()


def _two_ranks(dtype, sizes, cut, agreed: bool):
    """Encode a flat master split at `cut` as two ranks would, with or without the agreement
    (MAX of both ranks' amax); decode the whole (the gathered codes) with each rank's scales.
    Returns (decoded as rank 0 sees it, rank 0's scales, rank 1's scales)."""
    master = torch.cat(_params(sizes, seed=7))
    n = master.numel()
    pieces = [(0, cut), (cut, n)]
    amax = []
    for lo, hi in pieces:  # each rank's own amax (what the agreement combines)
        amax.append(Float8Codec(dtype).amax_(master[lo:hi], _spans(sizes, lo, hi),
                                             torch.zeros(len(sizes))))
    codes = torch.zeros(n, dtype=FP8_DTYPE)
    scales = []
    for r, (lo, hi) in enumerate(pieces):
        other = amax[1 - r]
        agree = (lambda t, o=other: torch.maximum(t, o, out=t)) if agreed else None
        s = torch.zeros(len(sizes))
        Float8Codec(dtype, agree).encode_(master[lo:hi], codes[lo:hi], _spans(sizes, lo, hi),
                                          s)
        scales.append(s)
    out = torch.zeros(n, dtype=dtype)
    Float8Codec(dtype).decode_(codes, out, _spans(sizes, 0, n), scales[0])
    return master, out, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_two_ranks_agree_on_a_straddling_param(dtype):
    sizes = (300, 4097, 127)
    cut = 300 + 1000  # param 1 straddles the two ranks' pieces
    master, out, scales = _two_ranks(dtype, sizes, cut, agreed=True)
    assert torch.equal(scales[0], scales[1])  # every rank derives the same scales
    off = 0
    for i, n in enumerate(sizes):
        _, s_value, _ = spec_param(master[off:off + n], dtype)
        assert torch.equal(out[off:off + n], s_value), f"param {i}"
        off += n


def test_fp8_negative_control_unagreed_scales_differ_from_spec():
    """Without the agreement each rank scales its part of param 1 by its own amax: the scales
    differ between ranks, and the gathered param decodes away from the spec."""
    dtype, sizes, cut = torch.bfloat16, (300, 4097, 127), 1300
    master = torch.cat(_params(sizes, seed=7))
    master[cut + 5] = 50.0 * master[300:cut].abs().max()  # rank 1's part of param 1 is larger
    n = master.numel()
    # (re-run the two ranks on this master)
    pieces = [(0, cut), (cut, n)]
    codes = torch.zeros(n, dtype=FP8_DTYPE)
    scales = []
    for lo, hi in pieces:
        s = torch.zeros(len(sizes))
        Float8Codec(dtype).encode_(master[lo:hi], codes[lo:hi], _spans(sizes, lo, hi), s)
        scales.append(s)
    assert scales[0][1] != scales[1][1]
    out = torch.zeros(n, dtype=dtype)
    Float8Codec(dtype).decode_(codes, out, _spans(sizes, 0, n), scales[0])
    _, s_value, _ = spec_param(master[300:300 + 4097], dtype)
    assert not torch.equal(out[300:300 + 4097], s_value)


def test_fp8_zero_param_and_padding():
    c = Float8Codec(torch.bfloat16)
    master = torch.zeros(256)
    master[:100] = 0.0  # an all-zero param: scale 1, codes 0
    master[100:200] = torch.linspace(-2, 2, 100)
    codes = torch.full((256,), 3.0).to(FP8_DTYPE)  # padding [200, 256) left as it is
    scales = torch.zeros(2)
    c.encode_(master, codes, [(0, 0, 100), (1, 100, 200)], scales)
    assert scales[0].item() == 1.0
    assert torch.equal(codes[:100].float(), torch.zeros(100))
    assert torch.equal(codes[200:].float(), torch.full((56,), 3.0))


def test_param_format_validation():
    bf16 = torch.bfloat16
    check_param_format(None, bf16, 2)
    check_param_format("fp8", bf16, 3, offload=(None, None))
    with pytest.raises(TypeError, match="param_format"):
        check_param_format(8, bf16, 3)
    with pytest.raises(ValueError, match="param_format must be None or 'fp8'"):
        check_param_format("fp4", bf16, 3)
    with pytest.raises(ValueError, match="stage=2"):
        check_param_format("fp8", bf16, 2)
    with pytest.raises(ValueError, match="precision"):
        check_param_format("fp8", torch.float32, 3)
    with pytest.raises(ValueError, match="offload='cpu'"):
        check_param_format("fp8", bf16, 3, offload=(None, "cpu"))
    assert isinstance(make_param_codec(bf16, "fp8"), Float8Codec)
    assert type(make_param_codec(bf16, None)) is ParamCodec
    with pytest.raises(ValueError, match="storage_dtype"):
        ParamCodec(torch.float64)
