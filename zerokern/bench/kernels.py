"""Kernel microbenchmarks: adam_step_ and grad_stats_ per backend against the torch paths users
write today, and against the machine's ceilings measured in the same run (DESIGN §6).

[Note: what is compared]
- Cases (`--dtype-cases`):
  - bf16 / fp16: 16-bit grad in, fp32 master/m/v updated, 16-bit param_out written.
    The torch baseline is the mixed-precision path: `master.grad.copy_(grad16)`, then
    `AdamW([master], fused=True).step()`, then `param16.copy_(master)` ("torch-fused"); the
    same with `foreach=True` ("torch-foreach").
  - fp32: fp32 grad, no param_out; the baseline is a plain `AdamW(fused=True)` step.
  - grad_stats_ against `torch.linalg.vector_norm(g)` + `g.isfinite().all()` ("torch-norm").
- Byte floors are derived from the dtypes of each case (`adam_bytes`): read master, m, v and
  the grad, write master, m, v and param_out. bf16 gives DESIGN §6's 28n; fp32 without
  param_out is 16n read + 12n written = 28n as well. grad_stats_ reads the grad once (2n / 4n).
  Every provider's GB/s is floor bytes / median time (effective bandwidth), so the numbers
  compare directly; the torch mixed path really moves >= 40n (cast 6n + step 28n + cast-back
  6n).
- Ceilings, timed in the same round-robin at the same size, fp32, 8n bytes each:
  - in-place `x.mul_(1.0000001)` (read-modify-write): the fair ceiling on a CPU, because
    adam_step_ updates master, m and v in place the same way, while a copy's destination lines
    cost a CPU an extra read for ownership (copy ran at 0.66x RMW here at 2^26);
  - preallocated `dst.copy_(src)`: the fair ceiling on a GPU, which writes without that read.

[Note: shared state]
All providers of one size share one set of random buffers (master, m, v, grads, param_out);
the torch optimizers take one step to create their state, then get the shared m and v swapped
in. Each provider thus starts from the same prepared data, and memory stays ~50 B/element
instead of ~20 B per provider, so 2^30 elements fit on an 80 GB H100. The caches are flushed
before every timed call, so no provider inherits data warmed by the one before it.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

import torch

from zerokern.platform.device import handle

from .. import kernels as zk
from ..rules.adamw import ADAMW
from . import common, kernel_rules, kernel_rules_ns
from .kernel_cases import (  # noqa: F401 - re-exported: kernels.Case etc. are its API
    DTYPES,
    HYPER,
    PROVIDERS,
    REFERENCE_MAX_LOG2,
    TARGET_CPU_FP32,
    TARGET_CPU_MIXED,
    TARGET_GPU_COPY,
    TORCH_PROVIDERS,
    ZK_BACKENDS,
    Case,
    Timed,
    _zk_adam,
    adam_bytes,
    make_case,
)
from .kernels_args import _flatten, build_parser  # noqa: F401 - kernels.build_parser is API

RMW_FACTOR = 1.0000001  # rounds to 1 + 1 ulp: 100 reps change x by ~1e-5 relative, no overflow
_BROKEN: set = set()  # zk backends that failed to build or run in this process


# ---------------------------------------------------------------------------- providers


def runnable_zk_backends(device: torch.device) -> Dict[str, str]:
    """zk backend -> '' if it can run on `device`, else the reason it cannot."""
    status = zk.backend_status()
    out = {}
    for b in ZK_BACKENDS:
        ok, why = status.get(b, (False, "unknown backend"))
        if ok and b == "cpu" and device.type != "cpu":
            ok, why = False, "needs CPU tensors"
        if ok and b == "cuda" and device.type != "cuda":
            ok, why = False, "needs CUDA tensors"
        out[b] = "" if ok else why
    return out


def default_providers(device: torch.device) -> List[str]:
    why_not = runnable_zk_backends(device)
    # Triton on CPU tensors means the interpreter: minutes per call at these sizes.
    zks = [b for b in ZK_BACKENDS
           if not why_not[b] and not (b == "triton" and device.type == "cpu")]
    return zks + list(TORCH_PROVIDERS)


def _torch_opt(param, grad32, m, v, foreach: bool) -> torch.optim.Optimizer:
    """AdamW over `param` with prepared state: one real step, then the shared m and v."""
    param.grad = grad32
    opt = torch.optim.AdamW([param], **HYPER, **({"foreach": True} if foreach else
                                                  {"fused": True}))
    opt.step()
    state = opt.state[param]
    # torch's state names are the AdamW rule's: the step's own m, v are freed here
    state.update(zip(ADAMW.state_names, (m, v)))
    return opt


def _zk_stats(backend: str, grad, device) -> Callable[[], None]:
    found_inf = torch.zeros((), dtype=torch.bool, device=device)
    sumsq = torch.zeros((), dtype=torch.float32, device=device)

    def fn():
        zk.grad_stats_(grad, found_inf, sumsq, backend=backend)

    fn()
    return fn


def _torch_stats(grad) -> Callable[[], None]:
    def fn():
        # What clip_grad_norm_ + an inf check cost a user today: two passes over the grad.
        torch.linalg.vector_norm(grad)
        grad.isfinite().all()

    return fn


def bytes_needed_per_elem(cases: Sequence[Case], providers: Sequence[str], ref: bool) -> int:
    """Peak bytes per element one size allocates (for skipping sizes that cannot fit)."""
    need = 12 + 12  # master, m, v; ceilings: rmw x (4) + copy src, dst (8)
    need += sum(4 for c in cases if c.mixed) + (4 if any(not c.mixed for c in cases) else 0)
    if any(p in providers for p in ("torch-fused", "torch-foreach")):
        need += 4 + 8  # fp32 master.grad of the mixed path; m, v of the prep step (transient)
    if "torch-foreach" in providers:
        need += 8      # _foreach_sqrt(v) and friends allocate n-sized temporaries
    if "torch-norm" in providers:
        need += 4      # isfinite() bool tensor, plus slack for the norm's partials
    if ref:
        need += 40     # the reference spec's temporaries
    return need


def build_timed(n: int, log2n: int, cases: Sequence[Case], providers: Sequence[str],
                device: torch.device, explicit_ref: bool, skipped: List[dict],
                adam: bool = True) -> List[Timed]:
    """The ceilings, then (adam=True) the adam_step_ / grad_stats_ rows, at n elements."""
    gen = torch.Generator(device=device).manual_seed(1234 + log2n)

    def rand(scale: float, positive: bool = False) -> torch.Tensor:
        # Fresh random data, never zeros; |v| > 0 keeps sqrt(v) away from denormals.
        if positive:
            return torch.rand(n, generator=gen, device=device).mul_(scale).add_(1e-8)
        return torch.randn(n, generator=gen, device=device).mul_(scale)

    master, m, v = rand(1.0), rand(1e-3), rand(1e-6, positive=True)
    timed: List[Timed] = []

    x = rand(1.0)
    src, dst = rand(1.0), torch.empty(n, device=device)
    timed.append(Timed("ceiling", "fp32", "rmw", 8, lambda: x.mul_(RMW_FACTOR)))
    timed.append(Timed("ceiling", "fp32", "copy", 8, lambda: dst.copy_(src)))
    if not adam:
        return timed

    zks = [b for b in providers if b in ZK_BACKENDS
           and (b != "reference" or explicit_ref or log2n <= REFERENCE_MAX_LOG2)]
    grad32_mixed = None  # the fp32 master.grad of the torch mixed path, shared by 16-bit cases
    for case in cases:
        grad = rand(1e-3).to(case.grad_dtype)
        param_out = master.to(case.param_out_dtype) if case.mixed else None
        floor = adam_bytes(case.grad_dtype, case.param_out_dtype)
        gfloor = case.grad_dtype.itemsize
        for b in zks:
            if b in _BROKEN:
                continue
            try:
                timed.append(Timed("adam_step_", case.name, b, floor,
                                   _zk_adam(b, master, m, v, grad, param_out, device),
                                   "torch-fused"))
                timed.append(Timed("grad_stats_", case.name, b, gfloor,
                                   _zk_stats(b, grad, device), "torch-norm"))
            except (zk.BuildError, RuntimeError, ValueError) as e:
                _BROKEN.add(b)  # a failed JIT build costs ~1 min: don't retry it every size
                skipped.append({"provider": b, "case": case.name, "log2n": log2n,
                                "reason": str(e).splitlines()[0][:300]})
        if case.mixed:
            if grad32_mixed is None and ({"torch-fused", "torch-foreach"} & set(providers)):
                # Filled, not empty: the prep step reads it before the first timed copy_.
                grad32_mixed = grad.float()
            for p in ("torch-fused", "torch-foreach"):
                if p not in providers:
                    continue
                # Each optimizer gets its own leaf alias of master: torch keys state by tensor.
                param = master.view(-1)
                opt = _torch_opt(param, grad32_mixed, m, v, foreach=(p == "torch-foreach"))

                def fn(opt=opt, param=param, grad=grad, param_out=param_out):
                    param.grad.copy_(grad)      # upcast the 16-bit grad into the fp32 grad
                    opt.step()
                    param_out.copy_(param)      # cast-back: the extra 6n pass of DESIGN §6

                timed.append(Timed("adam_step_", case.name, p, floor, fn, "torch-fused"))
        elif "torch-fused" in providers:
            param = master.view(-1)
            opt = _torch_opt(param, grad, m, v, foreach=False)
            timed.append(Timed("adam_step_", case.name, "torch-fused", floor, opt.step,
                               "torch-fused"))
        if "torch-norm" in providers:
            timed.append(Timed("grad_stats_", case.name, "torch-norm", gfloor,
                               _torch_stats(grad), "torch-norm"))
    return timed


# ---------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    # Rows, targets and output live in kernels_report (it imports this module's constants).
    from .kernels_report import (
        COLUMNS,
        evaluate_targets,
        make_rows,
        plot,
        render_markdown,
        sections,
    )

    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    wall0 = time.perf_counter()
    cuda = handle("cuda")
    if args.device == "cuda" and not cuda.is_available():
        parser.error("--device cuda: no CUDA device visible to torch")
    device = torch.device(args.device or ("cuda" if cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(common.usable_cpus())  # all cores this process may use
    if args.reps is not None and args.reps < 1 or args.warmup is not None and args.warmup < 0:
        parser.error("--reps must be >= 1 and --warmup >= 0")

    sizes = _flatten(args.sizes) or ([12, 14] if args.quick else
                                     list(range(20, 27 if device.type == "cpu" else 31, 2)))
    reps = args.reps or (2 if args.quick else 15 if device.type == "cpu" else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    cases = [make_case(c) for c in (_flatten(args.dtype_cases) or ["bf16", "fp32"])]
    explicit = _flatten(args.providers)
    providers = explicit or default_providers(device)
    reasons = runnable_zk_backends(device)
    for p in providers:
        if p in reasons and reasons[p]:
            parser.error(f"provider {p!r} cannot run on {device.type}: {reasons[p]}")
    explicit_ref = bool(explicit and "reference" in explicit)
    rules = _flatten(args.rules) or ["adamw", *kernel_rules.RULES]
    other_rules = [r for r in rules if r != "adamw"]

    env = common.environment(device)
    print(f"zerokern kernel benchmark on {env['device_name']} ({env['usable_cpus']} CPUs, "
          f"torch {env['torch']}): sizes {[f'2^{s}' for s in sizes]}, providers "
          f"{providers}, cases {[c.name for c in cases]}, {reps} reps + {warmup} warm-up",
          flush=True)
    env["other_cpu_load_before"] = common.other_load_now()
    warnings = [w for w in [common.busy_warning(env["other_cpu_load_before"], "before the run")]
                if w and device.type == "cpu"]
    for w in warnings:
        print(w, flush=True)
    other_load = common.OtherLoad()
    flush = common.CacheFlusher(device)
    rows: List[dict] = []
    skipped: List[dict] = []
    for log2n in sizes:
        n = 1 << log2n
        ref = "reference" in providers and (explicit_ref or log2n <= REFERENCE_MAX_LOG2)
        need = max(bytes_needed_per_elem(cases, providers, ref) if "adamw" in rules else 0,
                   kernel_rules.BYTES_NEEDED if other_rules else 0) * n
        free = common.free_memory_bytes(device)
        if need > 0.85 * free:
            msg = f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            print(f"  skip 2^{log2n}: {msg}", flush=True)
            skipped.append({"log2n": log2n, "reason": msg})
            continue
        t0 = time.perf_counter()
        timed = build_timed(n, log2n, cases, providers, device, explicit_ref, skipped,
                            adam="adamw" in rules)
        times = common.round_robin([(t.key, t.fn) for t in timed], device, reps, warmup, flush)
        new = make_rows(timed, times, n, log2n)
        rows += new
        del timed, times
        handle(device).empty_cache()
        if other_rules:  # their own round-robin, with its own ceilings (kept out of the rows)
            zks = [b for b in providers if b in ZK_BACKENDS
                   and (b != "reference" or explicit_ref or log2n <= REFERENCE_MAX_LOG2)]
            timed = build_timed(n, log2n, cases, providers, device, explicit_ref, skipped,
                                adam=False)
            timed += kernel_rules.build_rule_timed(
                n, log2n, cases, other_rules, zks, device, skipped,
                peers=not explicit or bool(set(explicit) & set(TORCH_PROVIDERS)))
            times = common.round_robin([(t.key, t.fn) for t in timed], device, reps, warmup,
                                       flush)
            rows += [r for r in make_rows(timed, times, n, log2n) if r["op"] != "ceiling"]
            del timed, times
            handle(device).empty_cache()
        brief = ", ".join(f"{r['op']} {r['provider']} {r['gbps']:.0f}" for r in rows
                          if r["log2n"] == log2n and r["case"] == cases[0].name
                          and r["provider"] in ("cpu", "cuda", "triton", "zk-pieces"))
        print(f"  2^{log2n}: {time.perf_counter() - t0:.1f} s  ({cases[0].name} GB/s: {brief})",
              flush=True)

    ns_rows = []
    if "muon" in rules:
        shapes = _flatten(args.ns_shapes) or list(
            kernel_rules_ns.QUICK_SHAPES if args.quick else kernel_rules_ns.DEFAULT_SHAPES)
        t0 = time.perf_counter()
        ns_rows = kernel_rules_ns.run(shapes, device, reps, warmup, flush)
        print(f"  Newton-Schulz {len(shapes)} shapes: {time.perf_counter() - t0:.1f} s",
              flush=True)
    if not rows:
        print("nothing measured (every size skipped)")
        return 1
    targets = evaluate_targets(rows, device)
    env["other_cpu_load_during"] = other_load.fraction()
    during = common.busy_warning(env["other_cpu_load_during"], "during the run")
    if during and device.type == "cpu":
        warnings.append(during)
        print(during)
    if "cpu" in providers and device.type == "cpu":
        try:  # which SIMD path the cpu backend dispatched to decides its numbers
            env["zk_cpu_isa"] = zk.load_op("cpu").selected_isa()
        except Exception as e:  # noqa: BLE001 - a label only; the rows already say what ran
            env["zk_cpu_isa"] = f"unknown ({type(e).__name__})"
    payload = dict(benchmark="kernels", env=env, command=" ".join(["bench_kernels", *(argv or [])]),
                   sizes=sizes, providers=providers, cases=[c.name for c in cases], reps=reps,
                   warmup=warmup, hyper=HYPER, quick=args.quick,
                   byte_floors={c.name: {"adam_step_": adam_bytes(c.grad_dtype, c.param_out_dtype),
                                         "grad_stats_": c.grad_dtype.itemsize} for c in cases},
                   targets=targets, skipped=skipped, warnings=warnings, rows=rows,
                   rules=rules, ns_rows=ns_rows,
                   rule_floors={r: {c.name: kernel_rules.rule_floor(kernel_rules.rule_of(r), c)
                                    for c in cases} for r in other_rules})
    for title, sel in sections(rows, cases):
        common.print_table(sel, COLUMNS, title=f"\n{title}")
    if ns_rows:
        common.print_table(ns_rows, kernel_rules_ns.COLUMNS,
                           title=f"\n{kernel_rules_ns.title()}")
    print()
    for t in targets:
        print(f"{t['status']:>5}  {t['target']}  (value {common.fmt_value(t['value'])})")
    stem = args.stem or f"kernels-{env['device_kind']}" + ("-quick" if args.quick else "")
    payload["wall_s"] = time.perf_counter() - wall0  # before plotting: measurement time only
    out = [common.write_json(args.out / f"{stem}.json", payload),
           common.write_text(args.out / f"{stem}.md", render_markdown(payload, cases))]
    if not args.no_plot:
        try:
            out.append(plot(rows, cases, args.out / f"{stem}.png",
                            f"zerokern kernels on {env['device_name']} ({env['device_kind']})"))
        except ImportError:
            print("matplotlib not installed: no plot (pip install matplotlib)")
    print(f"wall time {time.perf_counter() - wall0:.1f} s; wrote " + ", ".join(map(str, out)))
    return 0
