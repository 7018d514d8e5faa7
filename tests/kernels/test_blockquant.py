"""Block-quantized payloads (zerokern/kernels/blockquant.py, triton_blockquant.py).

The reference against a float64 evaluation of the contract (error <= scale/2, codes equal to
round-half-even of x/scale); the Triton kernels (interpreter here, compiled on a GPU run)
bitwise equal to the reference for int8/int4, blocks 32/64/128, fp32/bf16/fp16 in and out,
odd block counts and an all-zero block. Negative control: round-half-up codes differ on the
tie vector, so the tie check can fail.
"""

from __future__ import annotations

import pytest
import torch

from zerokern.kernels import blockquant as ref
from zerokern.kernels import triton_blockquant as tri

SIZES = [1, 3, 17, 40]  # blocks


def _data(nblocks, block, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nblocks * block, generator=g) * torch.logspace(-3, 3, nblocks * block)[
        torch.randperm(nblocks * block, generator=g)]
    if nblocks > 2:
        x[block:2 * block] = 0.0  # an all-zero block
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 128])
def test_reference_meets_the_float64_contract(bits, block):
    x = _data(40, block, torch.float32, 1)
    codes, scale = ref.quantize(x, block, bits)
    q = ref.BITS_Q[bits]
    x64 = x.double().view(-1, block)
    scale64 = scale.double()
    assert torch.equal(scale, (x.view(-1, block).abs().amax(1) / q))
    y = x64 / torch.where(scale64 > 0, scale64, torch.ones_like(scale64))[:, None]
    want = torch.round(y).clamp(-q, q).view(-1)
    got = (ref.unpack_int4(codes) if bits == 4 else codes).double()
    differ = (got != want)
    assert differ.float().mean() <= 1e-3 and (got - want).abs().max() <= 1
    back = ref.dequantize(codes, scale, block, bits).double()
    err = (back - x.double()).abs().view(-1, block)
    assert torch.all(err <= scale64[:, None] / 2 * (1 + 1e-6) + 1e-30)
    assert torch.all(back.view(-1, block)[1] == 0)


def test_ties_round_half_to_even_and_half_up_would_be_caught():
    x = torch.zeros(128)
    x[0] = 127.0  # absmax 127 -> scale 1.0
    x[1:7] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5])
    codes, scale = ref.quantize(x, 128, 8)
    assert scale.item() == 1.0
    assert codes[1:7].tolist() == [0, 2, 2, 0, -2, -2]
    tcodes, _ = tri.quantize(x, 128, 8)
    assert torch.equal(tcodes, codes)
    half_up = torch.floor(x[1:7] + 0.5)
    assert half_up.tolist() != codes[1:7].float().tolist()  # the check distinguishes them


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nblocks", SIZES)
def test_triton_is_bitwise_the_reference(bits, block, dtype, nblocks):
    x = _data(nblocks, block, dtype, nblocks * 7 + block + bits)
    c_ref, s_ref = ref.quantize(x, block, bits)
    c_tri, s_tri = tri.quantize(x, block, bits)
    assert torch.equal(s_tri, s_ref)
    assert c_tri.dtype == c_ref.dtype and torch.equal(c_tri, c_ref)
    for out in (torch.float32, torch.bfloat16, torch.float16):
        d_ref = ref.dequantize(c_ref, s_ref, block, bits, out)
        d_tri = tri.dequantize(c_tri, s_tri, block, bits, out)
        assert torch.equal(d_tri.view(torch.int16 if out != torch.float32 else torch.int32),
                           d_ref.view(torch.int16 if out != torch.float32 else torch.int32))


@pytest.fixture(scope="module")
def native():
    from zerokern.kernels import load_op

    return ref.NativeCodec(load_op("cpu"))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_is_bitwise_the_reference(native, bits, block, dtype):
    """csrc/cpu/blockquant_cpu.cpp (the CPU codec of the quantized collectives)."""
    for nblocks in SIZES:
        x = _data(nblocks, block, dtype, nblocks * 11 + block + bits)
        c_ref, s_ref = ref.quantize(x, block, bits)
        c_cpu, s_cpu = native.quantize(x, block, bits)
        assert torch.equal(s_cpu, s_ref)
        assert c_cpu.dtype == c_ref.dtype and torch.equal(c_cpu, c_ref)
        for out in (torch.float32, torch.bfloat16, torch.float16):
            bits_view = torch.int16 if out != torch.float32 else torch.int32
            d_ref = ref.dequantize(c_ref, s_ref, block, bits, out)
            assert torch.equal(native.dequantize(c_cpu, s_cpu, block, bits, out).view(bits_view),
                               d_ref.view(bits_view))


def test_cpu_kernel_ties_and_nonfinite_blocks(native):
    # ties: x / scale = k + 1/2 exactly (scale = 127/127 = 1): half to even, as the reference
    x = torch.zeros(128)
    x[0] = 127.0
    x[1:7] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5])
    c, _ = native.quantize(x, 128, 8)
    assert c[1:7].tolist() == [0, 2, 2, 0, -2, -2]
    # an inf or a NaN makes its block's scale non-finite: every element dequantizes non-finite,
    # the next block is untouched
    for bad in (float("inf"), float("nan")):
        y = torch.randn(256)
        y[3] = bad
        c, s = native.quantize(y, 128, 8)
        d = native.dequantize(c, s, 128, 8)
        assert not torch.isfinite(d[:128]).any() and torch.isfinite(d[128:]).all()
        assert torch.equal(d[128:], ref.dequantize(*ref.quantize(y[128:], 128, 8), 128, 8))


def test_codec_follows_the_backend():
    assert isinstance(ref.codec_for(torch.device("cpu"), "cpu"), ref.NativeCodec)
    assert isinstance(ref.codec_for(torch.device("cpu"), "auto"), ref.NativeCodec)
    assert ref.codec_for(torch.device("cpu"), "reference") is ref


def test_int4_packing_round_trips():
    c = torch.arange(-8, 8, dtype=torch.int8).repeat(8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(c)), c)
    assert ref.pack_int4(torch.tensor([1, -1], dtype=torch.int8)).tolist() == [0xF1]


def test_wire_bytes_and_bad_input():
    assert ref.wire_bytes(1024, 128, 8) == 1024 + 32
    assert ref.wire_bytes(1024, 128, 4) == 512 + 32
    with pytest.raises(ValueError, match="bits"):
        ref.quantize(torch.zeros(128), 128, 2)
    with pytest.raises(ValueError, match="block"):
        ref.quantize(torch.zeros(256), 256, 8)
    with pytest.raises(ValueError, match="multiple"):
        tri.quantize(torch.zeros(100), 32, 8)


COMPILE_CHILD = r'''
import contextlib, io, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from zerokern.kernels import triton_blockquant as tb

triton.knobs.nvidia.dump_ptxas_log = True
assert type(tb._quantize_kernel).__name__ == "JITFunction", "interpreter is on"
out = {}
for name, fn, types, const in [
    ("q8", tb._quantize_kernel, dict(x_ptr="*bf16", codes_ptr="*i8", scale_ptr="*fp32",
                                     nblocks="i32"), dict(BLOCK=128, ROWS_=tb.ROWS, Q=127,
                                                          PACK4=False)),
    ("q4", tb._quantize_kernel, dict(x_ptr="*fp32", codes_ptr="*u8", scale_ptr="*fp32",
                                     nblocks="i32"), dict(BLOCK=128, ROWS_=tb.ROWS, Q=7,
                                                          PACK4=True)),
    ("dq8bf16", tb._dequantize_kernel, dict(codes_ptr="*i8", scale_ptr="*fp32", out_ptr="*i16",
                                            nblocks="i32"),
     dict(BLOCK=128, ROWS_=tb.ROWS, PACK4=False, OUT_KIND=1)),
]:
    sig = {a: types.get(a, "constexpr") for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in types if a != "nblocks"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4))
    ptx, log = k.asm["ptx"], buf.getvalue()
    out[name] = dict(
        div_rn=len(re.findall(r"div\.rn\.f32", ptx)),
        div_approx=len(re.findall(r"div\.(full|approx)\.f32", ptx)),
        f64=len(re.findall(r"\.f64", ptx)),
        spills=sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log)),
        v4=len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
        registers=[int(x) for x in re.findall(r"Used (\d+) registers", log)])
json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_kernels_compile_for_hopper_with_ieee_division_and_no_spills(tmp_path):
    """sm_90 PTX (no GPU needed): IEEE division only, no fp64, no spills, 128-bit loads of x."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a cached kernel would skip ptxas -v
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp_path / "ptx.json"
    r = subprocess.run([sys.executable, "-c", COMPILE_CHILD, str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("ptxas is not available to Triton here")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for name, v in res.items():
        assert v["registers"], (name, "no ptxas -v log: the spill check would be vacuous")
        assert v["div_approx"] == 0 and v["f64"] == 0 and v["spills"] == 0, (name, v)
    assert res["q8"]["div_rn"] > 0 and res["q4"]["div_rn"] > 0
    assert res["q8"]["v4"] > 0  # the (ROWS, 128) bf16 tile loads 16 B per access
