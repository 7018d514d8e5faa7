"""Issue 24, item 8 (Triton): the launch arguments of `adam_step_` and every launch's options.

* The five float hyperparameters were split into float32 halves through two CPU tensors each:
  10 `torch.tensor` calls per `adam_step_` (~31 us measured). Now plain float packing, cached on
  the values: a repeated call makes no `torch.tensor` at all (old code: 10; this test failed),
  and the halves equal torch's float32 rounding, +-inf past float32's range included.
* Every launch pins `enable_fp_fusion` ([Note: fp fusion pinned]): in a child process with the
  compiled kernels (no TRITON_INTERPRET) and TRITON_DEFAULT_FP_FUSION unset, the launch options
  Triton binds for adam_step_, grad_stats_ and the fused compact step all have fusion on and
  Triton's "TRITON_DEFAULT_FP_FUSION is unset" warning never fires (old code: it fired, once per
  rank).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zerokern.kernels import triton_kernels as tk

from .test_triton_compile import _triton_and_ptxas_present

REPO = Path(__file__).resolve().parents[2]


def test_repeated_adam_step_makes_no_cpu_tensors(monkeypatch):
    n = 64
    t = [torch.randn(n) for _ in range(3)]
    t[2] = t[2].abs()
    g, out = torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
              step=torch.zeros((), dtype=torch.int64), grad_scale=torch.tensor(1.0),
              found_inf=torch.zeros((), dtype=torch.bool))
    tk.adam_step_(*t, g, out, **kw)  # first call: fills the cache
    calls = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    tk.adam_step_(*t, g, out, **kw)
    assert calls == []


@pytest.mark.parametrize("x", [1e-3, 0.999, 1 / 3, 1e-8, 0.0, -2.5, 3.4e38, 1e39, -1e300, 1e-46])
def test_float32_halves_match_torch(x):
    hi, lo = tk._hi_lo(x)
    want_hi = float(torch.tensor(x, dtype=torch.float32))
    assert hi == want_hi
    if abs(want_hi) != float("inf"):
        assert lo == float(torch.tensor(x - want_hi, dtype=torch.float32))


CHILD = r'''
import json, sys, warnings
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from zerokern.kernels import compact_triton as ct, triton_kernels as tk

backend = make_backend(GPUTarget("cuda", 90, 32))
seen = []
for jf in (tk._adam_scalars_kernel, tk._adam_step_kernel, tk._advance_step_kernel,
           tk._grad_stats_partial_kernel, tk._grad_stats_final_kernel, ct._compact_adam_kernel):
    binder = create_function_from_signature(jf.signature, jf.params, backend)
    def run(*args, grid, warmup, _b=binder, _name=jf.fn.__name__, **kwargs):
        _, _, opts = _b(*args, **kwargs)
        seen.append((_name, bool(backend.parse_options(dict(opts)).enable_fp_fusion)))
    jf.run = run
m = dict(device="meta")
t = lambda n=4096, dt=torch.float32: torch.empty(n, dtype=dt, **m)
flag = torch.zeros((), dtype=torch.bool, **m)
kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
          step=torch.zeros((), dtype=torch.int64, **m), grad_scale=torch.ones((), **m),
          found_inf=flag)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tk.adam_step_(t(), t(), t(), t(dt=torch.bfloat16), t(dt=torch.bfloat16), **kw)
    tk.grad_stats_(t(dt=torch.bfloat16), flag, torch.zeros((), **m))
    ct.compact_adam_step_(t(dt=torch.int16), t(512, torch.uint8), t(dt=torch.bfloat16), t(),
                          t(), t(dt=torch.bfloat16), flag, **kw)
json.dump(dict(seen=seen, warnings=[str(x.message) for x in w]), open(sys.argv[1], "w"))
'''


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_every_launch_pins_fp_fusion_without_the_env(tmp_path):
    why = _triton_and_ptxas_present()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    script, out = tmp_path / "child.py", tmp_path / "out.json"
    script.write_text(textwrap.dedent(CHILD))
    r = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    import json

    res = json.loads(out.read_text())
    names = {n for n, _ in res["seen"]}
    assert {"_adam_scalars_kernel", "_adam_step_kernel", "_advance_step_kernel",
            "_grad_stats_partial_kernel", "_grad_stats_final_kernel",
            "_compact_adam_kernel"} <= names
    assert all(on for _, on in res["seen"]), res["seen"]
    assert not [x for x in res["warnings"] if "FP_FUSION" in x], res["warnings"]
    assert "FP_FUSION" not in r.stderr
