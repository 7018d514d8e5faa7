"""Lion's sign under cancellation (issue 36, item 4): every backend rounds c = b1*m + (1-b1)*g
and the momentum as torch ops do, each product rounded and then the sum, bit for bit.

lion-pytorch computes `exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sgn_()` and
`exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)`. Where the two rounded products cancel to
exactly 0, sign(c) is 0 and the parameter only decays; a kernel that contracts the expression
into an FMA (one rounding) gets one product's rounding error instead, sign +-1, and moves the
parameter by lr. (The converse cannot happen: when the rounded sum is nonzero, no float lies
between b1*m and its rounding, so the fused sum has the same sign.)

Planted data: pairs (m, g) with round(b1*m) == -round((1-b1)*g) and both products inexact,
among fresh random elements. Checked:
* the reference, cpu and triton (the interpreter, on CPU tensors) backends against the torch
  ops in lion-pytorch's order, bitwise (master and exp_avg);
* lion_pytorch.Lion itself, in a child with ATEN_CPU_CAPABILITY=default, bitwise. torch's
  `add(x, alpha=a)` is itself an FMA in its AVX2 / AVX-512 CPU kernels (vec::fmadd; measured
  on torch 2.13: all 2^16 results equal fma, 91% equal the two-rounding sum), so lion-pytorch's
  bits depend on the host; under the DEFAULT kernels it rounds the alpha product, as the
  written order says, and as zerokern's reference does on every host. The host's lion-pytorch
  is checked to be one of the two orderings;
* the code: no FMA in the Lion kernels of csrc/cpu/lion_cpu.cpp compiled with flags that allow
  contraction (the project's build passes -ffp-contract=off; the file's pragmas hold without
  it), nor in csrc/cuda/lion.cu's sm_90 PTX (nvcc contracts by default). The Triton kernel's
  sm_90 PTX: test_triton_compile.py::test_lion_kernels_round_every_product.
Negative controls: the emulated FMA orderings move every planted parameter by lr; a plain
`b1*m + omb1*g` in CUDA compiles to fma.rn.f32.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from zerokern.kernels.lion import lion_step_

from . import f64_reference as R

REPO = Path(__file__).resolve().parents[2]
# Exaggerated lr so a flipped sign is far outside any rounding; betas as lion-pytorch's defaults.
HP = dict(lr=0.05, beta1=0.9, beta2=0.99, weight_decay=0.1)
N_PLANTED = 1000
N_RANDOM = 3097  # 4097 elements in all: vectorized loop bodies and tails both see planted ones


def f32_scalars(hp: dict) -> dict:
    """The fp32 scalars every backend uses: formed in float64, rounded once (as lion.py)."""
    f = lambda x: torch.tensor(x, dtype=torch.float64).to(torch.float32)
    return dict(decay=f(1 - hp["lr"] * hp["weight_decay"]), lr=f(hp["lr"]),
                b1=f(hp["beta1"]), omb1=f(1 - hp["beta1"]), b2=f(hp["beta2"]),
                omb2=f(1 - hp["beta2"]))


def fma_f32(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """fp32 x*y + z rounded once, exactly: the float64 product is exact (48 bits), the float64
    sum is made round-to-odd from its TwoSum error, and round-to-odd with 29 spare bits then
    rounds correctly to fp32 (Boldo & Melquiond)."""
    p, zd = x.double() * y.double(), z.double()
    s = p + zd
    bb = s - p
    err = (p - (s - bb)) + (zd - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")),
                         torch.full_like(s, float("-inf")))
    return torch.where((err != 0) & even, torch.nextafter(s, toward), s).float()


def torch_order(p, m, g, hp):
    """lion-pytorch's update_fn in torch ops, each product rounded: (p, exp_avg) after a step."""
    s = f32_scalars(hp)
    p = p * s["decay"]
    c = m * s["b1"] + g * s["omb1"]   # exp_avg.clone().mul_(b1).add(g, alpha=1-b1)
    p = p - s["lr"] * torch.sign(c)   # p.add_(sign, alpha=-lr): an exact product
    return p, m * s["b2"] + g * s["omb2"]


def fused_order(p, m, g, hp, form: str):
    """The same step with c (and the momentum) contracted into one FMA: form "A" fuses b1*m
    (fma(b1, m, round(omb1 g)): LLVM's usual contraction), "B" fuses (1-b1)*g
    (fma(g, omb1, round(b1 m)): torch's add(alpha=) on AVX2 / AVX-512)."""
    s = f32_scalars(hp)
    p = p * s["decay"]
    b1, omb1, b2, omb2 = (s[k].expand_as(m) for k in ("b1", "omb1", "b2", "omb2"))
    if form == "A":
        c, m_new = fma_f32(b1, m, g * omb1), fma_f32(b2, m, g * omb2)
    else:
        c, m_new = fma_f32(g, omb1, m * b1), fma_f32(g, omb2, m * b2)
    return p - s["lr"] * torch.sign(c), m_new


def planted(n: int, hp: dict):
    """n pairs (m, g): round(b1*m) == -round((1-b1)*g) exactly, neither product exact."""
    s = f32_scalars(hp)
    b1, omb1 = s["b1"], s["omb1"]
    ms, gs, have = [], [], 0
    while have < n:
        m = R.log_uniform(8 * n, -4, -1)
        t1 = m * b1
        g0 = (-t1.double() / omb1.double()).float()
        hit = torch.zeros_like(m, dtype=torch.bool)
        g = g0.clone()
        for k in range(-4, 5):  # walk a few ulps around the quotient
            cand = g0
            for _ in range(abs(k)):
                cand = torch.nextafter(cand, torch.full_like(cand, float("inf") if k > 0
                                                             else float("-inf")))
            ok = (cand * omb1 == -t1) & ~hit
            g = torch.where(ok, cand, g)
            hit |= ok
        inexact = (m.double() * b1.double() != t1.double()) & \
            (g.double() * omb1.double() != (g * omb1).double())
        keep = hit & inexact
        ms.append(m[keep])
        gs.append(g[keep])
        have += int(keep.sum())
    return torch.cat(ms)[:n], torch.cat(gs)[:n]


def make_inputs(hp=HP):
    """(master, exp_avg, grad, planted mask): planted pairs scattered among random ones."""
    n = N_PLANTED + N_RANDOM
    m_pl, g_pl = planted(N_PLANTED, hp)
    m = R.log_uniform(n, -4, -1)
    g = R.log_uniform(n, -4, -1)
    where = torch.randperm(n)[:N_PLANTED]
    m[where], g[where] = m_pl, g_pl
    mask = torch.zeros(n, dtype=torch.bool)
    mask[where] = True
    return R.log_uniform(n, -3, 0), m, g, mask


def assert_bits(name, got, want):
    bad = got.view(torch.int32) != want.view(torch.int32)
    assert not bool(bad.any()), f"{name}: {int(bad.sum())}/{got.numel()} elements differ, " \
                                f"first {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"


def test_planted_pairs_cancel_and_the_fused_orderings_flip_them():
    """The construction does what it says, and the check can fail: in torch's order c is
    exactly 0 on every planted element; either FMA ordering makes it nonzero there, so the
    parameter moves by lr, and the fused momentum differs somewhere."""
    p, m, g, mask = make_inputs()
    s = f32_scalars(HP)
    c = m * s["b1"] + g * s["omb1"]
    assert bool((c[mask] == 0).all())
    want_p, want_m = torch_order(p, m, g, HP)
    for form in ("A", "B"):
        fp, fm = fused_order(p, m, g, HP, form)
        moved = (fp - want_p).abs()
        assert bool((moved[mask] >= 0.9 * HP["lr"]).all()), form
        assert bool((fp[~mask] == want_p[~mask]).all()), form  # only the cancellations flip
        assert bool((fm != want_m).any()), form


def _double_rounding_case():
    """fp32 (x, y, z) whose exact x*y + z lies just off an fp32 midpoint, so close that the
    float64 sum lands on the midpoint: rounding that to fp32 (ties to even) then goes the wrong
    way half the time. Found by search: x*y within 2^-31 of a midpoint, z = -(that distance)
    moved one fp32 ulp."""
    from fractions import Fraction

    for _ in range(100000):
        x, y = (1.0 + torch.randint(0, 1 << 23, (2,)).double() * 2.0 ** -23).tolist()
        prod = Fraction(x) * Fraction(y)
        mid = (prod * 2 ** 24).__floor__()
        mid = Fraction(mid if mid % 2 else mid + 1, 2 ** 24)  # odd multiple of 2^-24 below 2
        mid = mid if mid <= 2 else mid - Fraction(2, 2 ** 24)
        if prod >= 2 or not 0 < abs(prod - mid) < Fraction(1, 2 ** 31):
            continue
        d = torch.tensor(float(mid - prod))  # exact: few bits
        for toward in (float("inf"), float("-inf")):
            z = torch.nextafter(d, torch.tensor(toward))
            exact = prod + Fraction(float(z))
            naive = torch.tensor(float(Fraction(x) * Fraction(y)) + float(z),
                                 dtype=torch.float64).float()
            if Fraction(float(naive)) != _nearest_f32(exact):
                return torch.tensor([x]), torch.tensor([y]), z.reshape(1)
    raise AssertionError("no double-rounding case found")


def _nearest_f32(exact):
    """exact (a Fraction) rounded to fp32, ties to even, as a Fraction."""
    from fractions import Fraction

    lo = torch.tensor(float(exact)).float()
    cands = {float(v) for v in (lo, torch.nextafter(lo, torch.tensor(float("inf"))),
                                torch.nextafter(lo, torch.tensor(float("-inf"))))}
    dist = {v: abs(Fraction(v) - exact) for v in cands}
    best = [v for v in cands if dist[v] == min(dist.values())]
    if len(best) > 1:
        best = [v for v in best if int(torch.tensor(v).view(torch.int32)) % 2 == 0]
    return Fraction(best[0])


def test_fma_emulation_is_exact():
    """fma_f32 against exact rational arithmetic: a case where a plain float64 sum rounds
    twice wrongly (the reason for round-to-odd), and random triples."""
    from fractions import Fraction

    x, y, z = _double_rounding_case()
    a, b, c = (R.log_uniform(2000, -3, 3) for _ in range(3))
    a, b, c = torch.cat([x, a]), torch.cat([y, b]), torch.cat([z, c])
    got = fma_f32(a, b, c)
    for i in range(a.numel()):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert Fraction(float(got[i])) == _nearest_f32(exact), \
            (i, float(a[i]), float(b[i]), float(c[i]))


def test_backends_match_torch_order_bitwise(backend):
    """reference, cpu and triton (interpreted) against lion-pytorch's order, bit for bit."""
    p, m, g, mask = make_inputs()
    want_p, want_m = torch_order(p, m, g, HP)
    master, exp_avg = p.clone(), m.clone()
    lion_step_(master, exp_avg, g, None, **HP, step=torch.zeros((), dtype=torch.int64),
               grad_scale=torch.ones(()), found_inf=torch.zeros((), dtype=torch.bool),
               backend=backend)
    assert_bits("exp_avg", exp_avg, want_m)
    assert_bits("master (planted)", master[mask], want_p[mask])
    assert_bits("master", master, want_p)


LION_PYTORCH_CHILD = r'''
import sys
import torch
from lion_pytorch import Lion

assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", torch.backends.cpu.get_cpu_capability()
p, m, g, hp = torch.load(sys.argv[1])
param = torch.nn.Parameter(p.clone())
opt = Lion([param], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]),
           weight_decay=hp["weight_decay"])
opt.state[param]["exp_avg"] = m.clone()
param.grad = g.clone()
opt.step()
torch.save((param.detach().clone(), opt.state[param]["exp_avg"].clone()), sys.argv[2])
'''


def _lion_pytorch_step(p, m, g):
    from lion_pytorch import Lion

    param = torch.nn.Parameter(p.clone())
    opt = Lion([param], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
               weight_decay=HP["weight_decay"])
    opt.state[param]["exp_avg"] = m.clone()
    param.grad = g.clone()
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"]


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_lion_pytorch_default_kernels_match_bitwise(tmp_path):
    """lion_pytorch.Lion under ATEN_CPU_CAPABILITY=default (its ops as written, each alpha
    product rounded) equals the torch order, and so every backend, bit for bit."""
    pytest.importorskip("lion_pytorch")
    p, m, g, mask = make_inputs()
    torch.save((p, m, g, HP), tmp_path / "in.pt")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(LION_PYTORCH_CHILD))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got_p, got_m = torch.load(tmp_path / "out.pt")
    want_p, want_m = torch_order(p, m, g, HP)
    assert_bits("lion_pytorch master", got_p, want_p)
    assert_bits("lion_pytorch exp_avg", got_m, want_m)


def test_lion_pytorch_on_this_host_is_one_of_the_two_orderings():
    """On the host's own ATen kernels lion-pytorch is either the torch order (DEFAULT) or the
    FMA ordering B (AVX2 / AVX-512: add(alpha=) is vec::fmadd): the difference the pinned
    DEFAULT child above removes. Prints which."""
    pytest.importorskip("lion_pytorch")
    p, m, g, mask = make_inputs()
    got_p, got_m = _lion_pytorch_step(p, m, g)
    orders = {"torch order": torch_order(p, m, g, HP),
              "fma (alpha fused)": fused_order(p, m, g, HP, "B")}
    same = [k for k, (wp, wm) in orders.items()
            if torch.equal(got_p.view(torch.int32), wp.view(torch.int32))
            and torch.equal(got_m.view(torch.int32), wm.view(torch.int32))]
    print(f"lion-pytorch on {torch.backends.cpu.get_cpu_capability()}: {same}")
    assert len(same) == 1, same


# ---- the code: no FMA where the expression is ---------------------------------------------------

def _asm_functions(asm: str, needle: str) -> dict:
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^(\S+):\n(.*?)\.size\s+\1,", asm, re.S | re.M)
            if needle in m.group(1)}


X86_FMA = re.compile(r"\bvfn?m(add|sub)\w*")
CXX = shutil.which("g++")


@pytest.mark.skipif(CXX is None or sys.platform != "linux" or "x86_64" not in os.uname().machine,
                    reason="needs g++ on x86-64 Linux")
@pytest.mark.slow  # (25 s of g++ builds; the built op's flags are checked by default)
def test_cpu_lion_has_no_fma_even_where_contraction_is_allowed(tmp_path):
    """csrc/cpu/lion_cpu.cpp compiled for x86-64-v3 (FMA available) with -ffp-contract=fast,
    i.e. without the project's -ffp-contract=off: the pragmas keep every lion_chunk FMA-free,
    and the loop stays vectorized (ymm multiplies). Before them: 3-33 FMAs per variant."""
    from torch.utils.cpp_extension import include_paths

    inc = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    asm = tmp_path / "lion_cpu.s"
    r = subprocess.run([CXX, "-O3", "-std=c++17", "-fPIC", "-fopenmp", "-march=x86-64-v3",
                        "-ffp-contract=fast", "-DTORCH_EXTENSION_NAME=zk_lion_probe",
                        "-DTORCH_API_INCLUDE_EXTENSION_H", *inc, "-w", "-S",
                        str(REPO / "csrc" / "cpu" / "lion_cpu.cpp"), "-o", str(asm)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    chunks = _asm_functions(asm.read_text(), "lion_chunk")
    assert len(chunks) >= 9, sorted(chunks)  # 3 grad types x 3 outputs
    fmas = {k: len(X86_FMA.findall(body)) for k, body in chunks.items()}
    assert not any(fmas.values()), fmas
    assert any(re.search(r"vmulps\s+[^\n]*ymm", body) for body in chunks.values())


NVCC = shutil.which("nvcc")
NVCC_FLAGS = ["-arch=sm_90", "-O3", "-std=c++17", "-D__CUDA_NO_HALF_OPERATORS__",
              "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-D__CUDA_NO_HALF2_OPERATORS__", "-ptx"]


def _ptx_entries(ptx: str, needle: str) -> dict:
    parts = re.split(r"^\.visible \.entry |^\.entry ", ptx, flags=re.M)
    return {p.split("(", 1)[0]: p for p in parts[1:] if needle in p.split("(", 1)[0]}


def _nvcc_ptx(src: Path, out: Path) -> str:
    r = subprocess.run([NVCC, *NVCC_FLAGS, f"-I{src.parent}", str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out.read_text()


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_cuda_lion_ptx_has_no_fma(tmp_path):
    """csrc/cuda/lion.cu for sm_90 under nvcc's default --fmad=true: every zk_lion_kernel
    instantiation is FMA-free (__fmul_rn / __fadd_rn). Before: 26 fma.rn in the file."""
    ptx = _nvcc_ptx(REPO / "csrc" / "cuda" / "lion.cu", tmp_path / "lion.ptx")
    entries = _ptx_entries(ptx, "zk_lion_kernel")
    assert len(entries) == 9, sorted(entries)  # 3 grad types x 3 outputs
    fmas = {k: re.findall(r"\bfma\.\w+", body) for k, body in entries.items()}
    assert not any(fmas.values()), fmas


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_cuda_fma_check_sees_a_contracted_expression(tmp_path):
    """Negative control: the plain expression the kernel used to have compiles to fma.rn.f32."""
    src = tmp_path / "plain.cu"
    src.write_text("__global__ void zk_lion_kernel_plain(float* c, const float* m, "
                   "const float* g, float b1, float omb1) {\n"
                   "  int i = threadIdx.x; c[i] = b1 * m[i] + omb1 * g[i];\n}\n")
    entries = _ptx_entries(_nvcc_ptx(src, tmp_path / "plain.ptx"), "zk_lion_kernel")
    assert any(re.search(r"\bfma\.rn\.f32", body) for body in entries.values()), entries
