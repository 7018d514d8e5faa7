"""`master="compact"`: the bf16 run's fp32 master held exactly in 2 bytes (+1 bit) per element.

[Note: the compact master]
With bf16 params the param IS `bf16(master)`, round-to-nearest-even on the bit pattern m:
`b = (m + 0x7FFF + ((m >> 16) & 1)) >> 16` (DESIGN §3: the kernel's cast-back is bitwise
`.to(bf16)`). So the master is its low half `l = m & 0xFFFF` (int16 `low`) plus the bf16 param b
the model already holds: `hi = b - carry`, carry = 1 iff l > 0x8000, or l == 0x8000 and hi is
odd. That exact tie cannot be told from b and l (for an even b, 65537 masters round to it: one
more than 16 bits can name), so its carry is one bit per element (`ties`, uint8, packed). A
dense bitmap, not a sparse index list: its size is fixed (the estimate is exact) and making it
needs no data-dependent allocation, so the step stays free of host syncs on a GPU (DESIGN §3).
Master bytes per element: 2 + 1/8 instead of 4. Little-endian: fp32 viewed as int16 pairs is
[low, high], so expanding writes `low` and `b - carry` into an (n, 2) int16 view of fp32 memory.

Exactness. For every non-NaN m with b = RNE(m), expand(compact(m), b) == m bit for bit (the
cases: l < 0x8000 no round-up, b = hi; l > 0x8000 b = hi + 1; l == 0x8000 b = hi + (hi & 1),
the tie bit; never wrapping below NaN patterns). Unit tests check every one of the 2^16 low
halves with several high halves (tests/state/test_compact_master.py).
- Step path (compact): bucket k's piece is expanded chunk by chunk into an fp32 scratch, the same
  fused kernel runs on the chunk with param_out the chunk's params, and the chunk is compacted
  back (AdamW on the cpu and triton backends runs all three as one pass, bit for bit the same:
  [Note: fused compact step on the CPU] below, compact_triton.py). Proved by construction:
  the kernel writes b = RNE(new master) (or, skipped, changes neither), so only a NaN master
  can break it; a NaN check per chunk feeds a device flag, read
  at finish() on the CPU and one step later from a pinned copy on a GPU (no sync), and a NaN
  raises there (its bits are gone: never a silently different master).
- Other paths (`master` read or written between steps: model_sync, checkpoint save/load,
  state_dict): reading `master` materializes an expanded fp32 tensor that is the truth until a
  step ends. That step runs the kernel on it whole; then finish() compacts it and VERIFIES every
  element (`master.to(bf16)` equals the param bits, and no NaN); only a verified compaction with
  no `master` access since drops the expanded tensor (at once on the CPU; on a GPU when the
  flag's copy has landed, a step later). A mismatch or a NaN keeps it expanded.
Writes that bypass `p._version` (`p.data.copy_()`) are not seen (model_sync.py); with the fp32
master the next step overwrites them, here they move the master to their neighbourhood.

[Note: chunk size and cost]
CHUNK_NUMEL = 2^20: a 4 MiB scratch, freed at finish() (never held between steps), and a chunk's
expand / kernel / compact working set (~18 B per element) stays in the L3 cache. On the CPU
expand and compact are one pass each (csrc/cpu/compact_cpu.cpp, NaN check fused; the torch ops
below take 7x longer): 0.35 + 0.36 ms per 2^20 elements on one thread, the Adam kernel 0.45 ms.
benchmarks/compact_step_time.py (23.2M GPT, 2 gloo ranks, bf16, step() interleaved with an
fp32-master twin, shared 2-core VM): stage 2 +5 / +20 / +9 ms over 37-40 ms in three runs,
stage 1 +13 ms; chunks of 2^17 +14 ms, 2^22 +21 ms. `verify` (torch ops: a cast, a compare
and a NaN test per element; 1.85 ms per 2^20 elements on one thread, ~21 ms for a rank's 11.6M
here) runs only in the step after an outside access (a checkpoint, state_dict, a param write).

[Note: fused compact step on the CPU] (issue 40)
The chunked path above makes three passes per 2^20-element chunk (expand into the scratch, the
Adam kernel on it, compact with the NaN test), each a call from Python with its own argument
checks and OpenMP fork/join. A cProfile of the stage-1 bf16 engine step (2 gloo ranks, 20M GPT)
put adam_step at ~60 ms, compact_expand 25 ms and compact_store 12 ms a step, and bf16's engine
overhead (zk - bare) / (DeepSpeed - bare) at 0.23 / 0.27 / 0.21 (stages 1-3, r5: target <= 0.2)
where fp32 met it. So AdamW on the cpu backend takes one op (csrc/cpu/compact_adam_cpu.cpp,
`compact_adam_step_` in kernels/compact_bits.py) that reads low, the tie bits, the bf16 param,
m, v and the grad once, rebuilds the master in registers, runs the Adam kernel's update
(kernels_scalar.cpp operation for operation, the same fp64 host scalars) and writes param (RNE),
low, ties, m and v, with the NaN test: 14.1 B read + 12.1 B written per element with a bf16
grad, no scratch, one call per piece. AVX-512 / AVX2 / scalar by the extension's ISA dispatch,
like the Adam kernel. A skipped step writes nothing, step included, and still flags a NaN
master, as the chain's compact_ does (which rewrites low/ties from their own expansion: the same
bytes for any state compact_ wrote). Bit for bit the chain on every ISA, 1 and 2 threads
(tests/state/test_compact_cpu_fused.py); the chain stays for the other rules, the reference
backend, traced calls and as the reference (FUSED_CPU = False).
Measured 2026-11-29 (shared 2-core Xeon VM, AVX-512; `benchmarks/compact_cpu_fused.py --sizes
20 24 --threads 1 2 --reps 9`, load 1.6, medians, the three rotated in one process), ms per
call, bf16 grads: the chain / this op / master="fp32"'s Adam step on the same shard:
    2^20, 1 thread    2.10 / 0.70 / 0.76   (op / chain 0.33, op / fp32 0.92)
    2^24, 1 thread   47.8 / 22.3 / 24.5    (0.47, 0.91)
    2^24, 2 threads  30.9 / 13.3 / 14.3    (0.43, 0.93)
(2^20 on 2 threads: 23.9 / 8.0 / 8.2, all three waiting on a descheduled thread of the pool.)
So the compact step now costs what the fp32 master's does, for 2 + 1/8 master bytes an element.
Engine, stage 1 bf16, step phase per rank, process CPU ms (`benchmarks/engine_phase_cpu.py
--stage 1 --precision bf16 --variants kept --reps 8`, before and after alternated, load 4-6):
grad buffer kept 111 / 92 and 179 / 146 before, 63 / 55 and 55 / 54 after; freed (the
engine's stage-1 default) 103 / 84 and 158 / 125 before, 92 / 80 and 109 / 113 after.
`zerokern bench --engine --precisions bf16`, overhead zk/DS (CPU) at stages 1-3, three runs
alternated: after 0.18 / 0.19 / 0.17 (load 1.8-4.7), before (main) 0.19 / 0.36 / 0.18 (load
2.5-5.4), after 0.19 / 0.24 / 0.19 (load 4.1-5.1); r5 had 0.23 / 0.27 / 0.21
(benchmarks/results/engine-20m-n2-issue40-20261129-r6*.md).
Open: inside the engine (stage 1, pieces of 6.5M elements, both ranks stepping at once) the op
took 15-38 ms of thread CPU per piece with the grad buffer kept and 22-60 ms freed (the
engine's stage-1 default; load 4), i.e. 2.5-9 ns an element against 1.3 alone; the freed
buffer's extra cost was also seen in the step phase (engine_phase_cpu --variants freed kept:
112-136 vs 62-67 ms) and is not explained yet (before this op, freed and kept cost the same).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from zerokern import kernels

# the bit operations (kernels/compact_bits.py), re-exported
from zerokern.kernels.compact_bits import (
    TIE,
    _native,
    compact_,
    compact_adam_step_,
    compact_torch_,
    expand_,
    expand_torch_,
    tie_bytes,
    unpack_ties,
    verify,
)
from zerokern.kernels.custom_ops import hyper_args, use_op
from zerokern.platform.device import handle
from zerokern.rules import Rule, RuleState, alloc_states
from zerokern.rules.adamw import AdamWRule

CHUNK_NUMEL = 1 << 20
# AdamW on the cpu backend takes the one-pass op ([Note: fused compact step on the CPU]);
# False runs the chunked three-pass chain instead (tests and benchmarks compare the two).
FUSED_CPU = True

__all__ = ["CHUNK_NUMEL", "TIE", "CompactState", "_native", "compact_", "compact_torch_",
           "expand_", "expand_torch_", "tie_bytes", "unpack_ties", "verify"]


class _HostFlag:
    """A device bool read on the host without a sync: at once on the CPU, from a pinned copy
    once its event has completed on a GPU (None until then)."""

    def __init__(self, flag: torch.Tensor) -> None:
        self.event = None
        if handle(flag.device).has_streams:
            # (issue 24, item 8) On the flag's device: the copy runs on that device's current
            # stream, and Event.record() records on the *current device's* stream, so with
            # params on cuda:1 and cuda:0 current the event would complete without the copy.
            dev = handle(flag.device)
            with dev.device_context(flag.device):
                self.host = torch.empty(1, dtype=torch.bool, pin_memory=True)
                self.host.copy_(flag.reshape(1), non_blocking=True)
                self.event = dev.recorded_event()
        else:
            self.host = flag.reshape(1).clone()

    def read(self, wait: bool = False) -> Optional[bool]:
        if self.event is not None and not self.event.query():
            if not wait:
                return None
            self.event.synchronize()
        return bool(self.host[0])


class CompactState(RuleState):
    """One bf16 buffer's state on its device with a compact master (see the Note). Shapes
    (S = state_numel): low (S,) int16; ties (S/8,) uint8; the rule's states (S,) fp32 each;
    steps (n_buckets,) int64; the expanded master (S,) fp32 only while it is the truth."""

    def __init__(self, buf, rule: Rule) -> None:
        self.rule = rule
        n, dev, fp32 = buf.state_numel, buf.device, torch.float32
        assert n % 8 == 0, n
        self._buf = weakref.ref(buf)
        self.low = torch.zeros(n, dtype=torch.int16, device=dev)
        self.ties = torch.zeros(tie_bytes(n), dtype=torch.uint8, device=dev)
        self._expanded: Optional[torch.Tensor] = torch.zeros(n, dtype=fp32, device=dev)
        buf.fill_master_(self._expanded)  # the original values; compacted at attach
        self.states = alloc_states(rule, n, lambda m, dt: torch.empty(m, dtype=dt, device=dev))
        self.index_states(rule)
        self.steps = torch.zeros(buf.layout.n_buckets, dtype=torch.int64, device=dev)
        self._gen = 0            # `master` accesses so far
        self._pending = None     # (gen, _HostFlag): a compaction of the expanded, verified
        self._nan = None         # device bool: a compact step produced a NaN master
        self._nan_flag = None
        self.compact_pieces = 0  # pieces updated through the scratch (tests, diagnostics)

    # -- the master, for everyone outside the step ------------------------------------------
    @property
    def master(self) -> torch.Tensor:
        """(S,) fp32, a real tensor that is the truth until the next step ends (it may be
        written); the step compacts it again once verified."""
        if self._expanded is None:
            g = self._buf()
            out = torch.empty(self.low.numel(), dtype=torch.float32, device=self.low.device)
            for k in range(g.layout.n_buckets):
                sl = g.state_slice(k)
                expand_(out[sl], self.low[sl], self.ties[sl.start // 8:sl.stop // 8],
                        g.param_values(*g.state_range(k)))
            self._expanded = out
        self._gen += 1
        self._pending = None
        return self._expanded

    @property
    def expanded(self) -> bool:
        return self._expanded is not None

    def expanded_piece(self, g, k: int) -> torch.Tensor:
        """Bucket k's part of the expanded master, for the step (not an outside access)."""
        return self._expanded[g.state_slice(k)]

    def device_buffers(self, padding: int):
        """(category, tensor, padding elements) held: memory_report's master is the bytes
        really held (low halves + tie bits, and the expanded master while present)."""
        yield "master", self.low, padding
        yield "master", self.ties, 0
        if self._expanded is not None:
            yield "master", self._expanded, padding
        for cat, t in self.states.items():
            yield cat, t, padding // self.blocks.get(cat, 1)

    def device_tensors(self) -> dict:
        out = {"master": self.low, "master_ties": self.ties, **self.states}
        if self._expanded is not None:
            out["master_expanded"] = self._expanded
        return out

    def to_(self, device) -> None:
        for name in ("low", "ties", "_expanded", "steps", "_nan"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        self.states = {k: t.to(device) for k, t in self.states.items()}
        self._pending = self._nan_flag = None

    # -- the step (DevicePlacement calls these) ----------------------------------------------
    def settle(self, wait: bool = False) -> None:
        """Drop the expanded master if its verified compaction has come back clean and nobody
        read `master` since; raise if a compact step made a NaN master."""
        if self._nan_flag is not None and self._nan_flag.read(wait):
            raise RuntimeError(
                "zerokern: an optimizer step produced NaN in the fp32 master (a NaN lr or betas, "
                "or an inf master with lr * weight_decay == 1); master='compact' keeps a master "
                "through its bf16 param, which cannot hold a NaN's bits. Use master='fp32'")
        if self._pending is not None:
            gen, flag = self._pending
            ok = flag.read(wait)
            if ok is None:
                return
            self._pending = None
            if ok and gen == self._gen:
                self._expanded = None

    def compact_expanded(self) -> None:
        """After a step on the expanded master: write its compaction, verify it (device)."""
        g = self._buf()
        ok = torch.ones((), dtype=torch.bool, device=self.low.device)
        for k in range(g.layout.n_buckets):
            sl = g.state_slice(k)
            m = self._expanded[sl]
            compact_(self.low[sl], self.ties[sl.start // 8:sl.stop // 8], m)
            ok &= verify(m, g.param_values(*g.state_range(k)))
        self._pending = (self._gen, _HostFlag(ok))

    def update_piece(self, g, k: int, grad, hyper: dict, backend: str, grad_scale, found_inf,
                     scratch: torch.Tensor) -> None:
        """Bucket k's piece: expand a chunk into scratch, the fused kernel, compact it back
        (on the triton backend one fused kernel does all three: kernels/compact_triton.py)."""
        sl = g.state_slice(k)
        s0, n = sl.start, sl.stop - sl.start
        param = g.param_values(*g.state_range(k))
        states = self.views(sl)
        step = self.steps[k]
        if self._nan is None:
            self._nan = torch.zeros((), dtype=torch.bool, device=self.low.device)
        kind = kernels.resolve(backend, self.low.device) \
            if isinstance(self.rule, AdamWRule) else None
        if kind == "cpu" and FUSED_CPU and not use_op(self.low) and _native(self.low):
            # [Note: fused compact step on the CPU] (AdamW's one-pass op; the chunked path
            # below stays for the other rules, the reference backend and traced calls)
            m, v = states
            compact_adam_step_(self.low[sl], self.ties[s0 // 8:sl.stop // 8], param, m, v, grad,
                               self._nan, step=step, grad_scale=grad_scale,
                               found_inf=found_inf, **hyper)
            self.compact_pieces += 1
            return
        if kind == "triton":
            # [Note: fused compact step] in kernels/compact_triton.py (AdamW's fused kernel;
            # other rules take the chunked path below)
            m, v = states
            args = (self.low[sl], self.ties[s0 // 8:sl.stop // 8], param, m, v, grad, self._nan)
            if use_op(self.low):  # [Note: kernels as custom ops] (kernels/custom_ops.py)
                h, h_t = hyper_args([hyper[k] for k in ("lr", "beta1", "beta2", "eps",
                                                        "weight_decay")])
                torch.ops.zerokern.compact_adam_step_(*args, h, h_t, hyper["adamw"], step,
                                                      grad_scale, found_inf)
            else:
                from zerokern.kernels import compact_triton

                compact_triton.compact_adam_step_(*args, step=step, grad_scale=grad_scale,
                                                  found_inf=found_inf, **hyper)
            self.compact_pieces += 1
            return
        s = step.clone()  # every chunk is the same step: advance a copy, store it once
        for lo in range(0, n, scratch.numel()):
            hi = min(n, lo + scratch.numel())
            x = scratch[:hi - lo]
            low, ties = self.low[s0 + lo:s0 + hi], self.ties[(s0 + lo) // 8:(s0 + hi) // 8]
            expand_(x, low, ties, param[lo:hi])
            s.copy_(step)
            self.rule.step_(x, self.views(slice(s0 + lo, s0 + hi)), grad[lo:hi], param[lo:hi],
                            step=s,
                            grad_scale=grad_scale, found_inf=found_inf, backend=backend,
                            **hyper)
            compact_(low, ties, x, self._nan)
        step.copy_(s)
        self.compact_pieces += 1

    def map_piece_(self, g, k: int, names, fn, params: bool, scratch: torch.Tensor) -> None:
        """A phased rule's pass over bucket k's piece (placement.py; Muon's update): each chunk
        of the master expanded into `scratch`, `fn(a, b, views)` on it and the named states,
        the params cast from it (`.to(bf16)` bitwise) and the chunk compacted back, as
        update_piece does around a fused kernel (so the master stays the fp32 one bit for
        bit; Note: the compact master)."""
        if not params:
            raise ValueError("a pass that writes the compact master must write the params "
                             "(params=True): the master's high half is the bf16 param")
        sl = g.state_slice(k)
        s0, n = sl.start, sl.stop - sl.start
        param = g.param_values(*g.state_range(k))
        if self._nan is None:
            self._nan = torch.zeros((), dtype=torch.bool, device=self.low.device)
        for lo in range(0, n, scratch.numel()):
            hi = min(n, lo + scratch.numel())
            x = scratch[:hi - lo]
            low, ties = self.low[s0 + lo:s0 + hi], self.ties[(s0 + lo) // 8:(s0 + hi) // 8]
            expand_(x, low, ties, param[lo:hi])
            views = []
            for nm in names:
                b = self.blocks.get(nm, 1)
                views.append(x if nm == "master" else
                             self.states[nm][(s0 + lo) // b:(s0 + hi) // b])
            fn(s0 + lo, s0 + hi, views)
            param[lo:hi].copy_(x)
            compact_(low, ties, x, self._nan)
        self.compact_pieces += 1

    def finish(self) -> None:
        if self._nan is not None:
            self._nan_flag = _HostFlag(self._nan)
        if self._expanded is not None:
            self.compact_expanded()
        self.settle()
