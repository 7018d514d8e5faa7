"""ZeRO-Offload (`offload="cpu"`): the master, the rule's state and the update live on the host.

Per (flat group, bucket) piece of n elements, in chunks of `chunk_numel` (DESIGN §2, offload):

    device grad piece --D2H--> pinned host grad chunk          (copy stream)
    the rule's cpu kernel: host master and states updated, 16-bit param chunk into pinned memory
    pinned param chunk --H2D--> device param piece             (copy stream)
    then, as without offload: all-gather (stages 1-2); stage 3 keeps the shard.

On a GPU the copies run on their own stream, so chunk i+1 travels while the CPU updates chunk
i and chunk i-1 travels back. On a CPU-only machine the "device" buffers are host memory too;
the host buffers are still distinct from the working ones, so the same path runs (and is
tested in CI) with plain copies.

[Note: the one blocking wait]
The host cannot update a chunk before its gradient (and the step's grad_scale and found_inf,
computed on the device after the stats all-reduce) have arrived in host memory: `_wait` on the
chunk's copy event is that wait, and it is the only one. It is inherent to computing on the
host (ZeRO-Offload blocks there too). Nothing else reads a device value on the host: the
step's branches stay on host state, and the skip on overflow happens inside the kernel, which
reads found_inf from the copied host scalar; the host also reads that copy (host memory,
after the wait) to skip the param copies of an overflowed step.

[Note: chunk size]
`CHUNK_NUMEL` = 2^22 elements (16 MiB of fp32 master per chunk). Measured on the 2-core EPYC,
23.2M-param GPT, stage 2, bf16, the offloaded step (`benchmarks/results/offload-20m-s2-bf16.md`):
2^14: 113 ms, 2^16: 45 ms, 2^18: 42 ms, 2^20: 31 ms, 2^22: 27 ms. Each chunk is one kernel
call (argument checks, an OpenMP fork), so small chunks pay per call; on a CPU-only machine
nothing overlaps, so fewer is better. On a GPU, 2^22 elements is 8 MiB of 16-bit grad per copy
(full PCIe bandwidth), and the pipeline's fill, the first chunk's copy, is about 0.3 ms at
25 GB/s: a small price against a step of many chunks.
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from zerokern.platform.device import handle
from zerokern.rules import (
    Rule,
    RuleState,
    alloc_states,
    check_rule,
    map_in_memory_,
    rule_for,
)
from zerokern.rules.registry import adamw_rule
from zerokern.state import pinned

CHUNK_NUMEL = 1 << 22


class HostState(RuleState):
    """One buffer's optimizer state on the host, and its pinned staging buffers (the
    placement's per-buffer state, placement.py). The master is fp32 at every precision: at fp32
    the device params are then only the working copy. Shapes (S = state_numel): master and
    the rule's states (S,) fp32; steps (n_buckets,) int64 on the host; grad (S,) the reduce
    dtype and param (S,) the model dtype (None at fp32): staging, distinct buffers."""

    def __init__(self, buf, grad_dtype: torch.dtype, rule: Rule) -> None:
        self.pin = handle(buf.device).pins_host_memory
        n = buf.state_numel
        fp32 = torch.float32
        self.master = pinned.host_empty(n, fp32, self.pin).zero_()
        buf.fill_master_(self.master)
        self.states = alloc_states(rule, n, lambda m, dt: pinned.host_empty(m, dt, self.pin))
        self.index_states(rule)
        self.steps = torch.zeros(buf.layout.n_buckets, dtype=torch.int64)
        self.fp32 = not buf.codec.has_master  # the params are the master: no staging
        self.grad = pinned.host_empty(n, grad_dtype, self.pin)
        self.param = None if self.fp32 else pinned.host_empty(n, buf.codec.storage_dtype,
                                                              self.pin)

    def device_tensors(self) -> dict:
        return {}  # all of it is host bytes (Offloader.host_bytes)

    def host_tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.grad, self.param) if t is not None]


class CopyPipeline:
    """What offload="cpu" and offload="nvme" share on the device side: the copy stream, this
    step's [grad_scale, found_inf] on the host, and [Note: the one blocking wait]."""

    def _init_copies(self, device: torch.device) -> None:
        self.streamed = handle(device).has_streams  # pinned host buffers, a copy stream
        # This step's [grad_scale, found_inf] on the host, once for every group; found_inf is
        # read through the numpy view once it has arrived (a host read of host memory, no
        # device sync), to skip an overflowed step's copies.
        self.scalars = pinned.host_empty(2, torch.float32, self.streamed)
        self.scalars_np = self.scalars.numpy()
        # the used flags' host copy (frozen_slots.HostUnused, set by the optimizer as
        # `self.unused`): one fp32 per param of the buffers, read through its numpy view
        bufs = getattr(self, "buffers", None) or getattr(self, "groups", None) or []
        n_flags = sum(len(g.params) for g in bufs)
        self.flags_host = pinned.host_empty(max(n_flags, 1), torch.float32, self.streamed)
        self.flags_np = self.flags_host.numpy()
        self.unused = getattr(self, "unused", None)
        self._planned = False
        self._flags_shipped = False
        self.dev = handle(device)
        self.stream = self.dev.stream(device) if self.streamed else None
        # Host seconds in the blocking wait and in the cpu kernel (benchmark diagnostics;
        # perf_counter reads the host clock, not a device value).
        self.wait_s = 0.0
        self.kernel_s = 0.0

    # -- copies: async on the copy stream on a GPU, plain copies on a CPU-only machine --------
    def _copy(self, dst: torch.Tensor, src: torch.Tensor):
        if not self.streamed:
            dst.copy_(src)
            return None
        with self.dev.use_stream(self.stream):
            dst.copy_(src, non_blocking=True)
            return self.dev.recorded_event(self.stream)

    def _wait(self, ev) -> None:
        if ev is not None:
            t0 = time.perf_counter()
            ev.synchronize()  # [Note: the one blocking wait]
            self.wait_s += time.perf_counter() - t0

    def _ship_scalars(self, grad_scale: torch.Tensor, found_inf: torch.Tensor,
                      used: Optional[torch.Tensor] = None):
        """Copy this step's scalars to the host (after the device computed them), and the
        params' used flags (summed over the ranks) behind them in the same stream: the one
        wait covers them (frozen_slots.py [Note: a param no rank used, on the host])."""
        self._planned = False
        if self.streamed:
            self.stream.wait_stream(self.dev.current_stream(self.stream.device))
        self._flags_shipped = used is not None and self.unused is not None and \
            used.numel() == self.flags_host.numel()
        if self._flags_shipped:
            self._copy(self.flags_host, used)
        self._copy(self.scalars[0:1], grad_scale.reshape(1).float())
        return self._copy(self.scalars[1:2], found_inf.reshape(1).float())

    def _plan_unused(self) -> None:
        """Once per step, after the wait for the scalars: which params no rank used (host
        memory), their host lags advanced on a step that runs."""
        if self._planned or self.unused is None:
            return
        self._planned = True
        if not self._flags_shipped:
            self.unused.unused = set()
            return
        self.unused.plan_(self.flags_np, self.scalars_np[1] == 0)

    def _chunk_update(self, gi: int, f_lo: int, master, states, grad, param_out,
                      step: torch.Tensor, hyper: dict, backend: str, rule: Rule):
        """_host_update of one chunk starting at flat f_lo of buffer gi, params no rank used
        left as they were (frozen_slots.HostUnused)."""
        if self.unused is None:
            return self._host_update(master, states, grad, param_out, step, hyper, backend,
                                     rule)
        self._plan_unused()
        return self.unused.update_(
            gi, f_lo, master, states, grad, param_out, step,
            lambda m, st, gr, po, s: self._host_update(m, st, gr, po, s, hyper, backend, rule))

    def _host_update(self, master, states, grad, param_out, step: torch.Tensor, hyper: dict,
                     backend: str, rule: Optional[Rule] = None) -> torch.Tensor:
        """One chunk through the cpu kernel with this step's host scalars; returns the chunk's
        advanced step counter (every chunk of a piece is the same step: the kernel advances a
        copy, and the caller stores it once the piece is done)."""
        s = step.clone()
        t0 = time.perf_counter()
        (self.rule if rule is None else rule).step_(
            master, states, grad, param_out, step=s, grad_scale=self.scalars[0],
            found_inf=self.scalars[1],
            backend="reference" if backend == "reference" else "cpu", **hyper)
        self.kernel_s += time.perf_counter() - t0
        return s

    def end(self) -> None:
        """The device may use the params once every H2D copy has landed (stream order)."""
        if self.streamed:
            self.dev.current_stream(self.stream.device).wait_stream(self.stream)


class Offloader(CopyPipeline):
    """offload="cpu": the state in host memory (HostState per buffer); the update runs for
    every piece of every buffer on the host, pipelined with the copies (placement.py)."""

    offload = "cpu"
    movable = False  # the host state was built for the device the params were on

    def __init__(self, grad_dtype: torch.dtype, chunk_numel: Optional[int] = None,
                 rule: Optional[Rule] = None, rules: Optional[List[Rule]] = None) -> None:
        self.rule = check_rule(adamw_rule() if rule is None else rule)
        # one rule per param group (zerokern.rules [Note: a rule per param group]), or None
        self.rules = None if rules is None else [check_rule(r) for r in rules]
        chunk_numel = CHUNK_NUMEL if chunk_numel is None else chunk_numel
        if not (isinstance(chunk_numel, int) and chunk_numel >= 128 and chunk_numel % 128 == 0):
            raise ValueError(f"offload chunk_numel must be a positive multiple of 128, got "
                             f"{chunk_numel!r}")
        self.chunk = chunk_numel
        self.grad_dtype = grad_dtype
        self.states: List[HostState] = []

    def allocate(self, buf) -> HostState:

        st = HostState(buf, self.grad_dtype, rule_for(self, buf))
        self.states.append(st)
        return st

    def attach(self, buffers) -> None:
        self.buffers = buffers
        self._init_copies(buffers[0].device)

    def begin(self, grad_scale: torch.Tensor, found_inf: torch.Tensor,
              used: Optional[torch.Tensor] = None) -> Optional[object]:
        """Ship this step's scalars (and the params' used flags) to the host (after the
        device computed them)."""
        self.scalars_ev = self._ship_scalars(grad_scale, found_inf, used)
        return self.scalars_ev

    def update_piece(self, gi: int, k: int, grad: torch.Tensor, hyper: dict,
                     backend: str) -> None:
        """Update bucket k's piece of buffer gi on the host; write the params back."""

        g = self.buffers[gi]
        rule = rule_for(self, g)
        st = g.state
        sl = g.state_slice(k)
        master = st.master[sl]
        hgrad = st.grad[sl]
        hparam = None if st.fp32 else st.param[sl]
        dev_out = g.param_out_piece(k)  # the device params (fp32 too: master is on the host)
        step = st.steps[k]
        n = master.numel()
        f_lo = g.state_range(k)[0]  # flat index of the piece's first element
        # D2H of every chunk is queued at once (the copy stream runs ahead of the CPU).
        evs = [self._copy(hgrad[lo:lo + self.chunk], grad[lo:lo + self.chunk])
               for lo in range(0, n, self.chunk)]
        self._wait(self.scalars_ev)
        if self.scalars_np[1] != 0:  # overflow: nothing changes (DESIGN §3), no copies either
            self.end()  # the queued grad copies still read the device grads: order them
            return
        new_step = step
        for i, lo in enumerate(range(0, n, self.chunk)):
            hi = min(lo + self.chunk, n)
            self._wait(evs[i])
            states = st.views(slice(sl.start + lo, sl.start + hi))  # chunks: whole blocks
            new_step = self._chunk_update(gi, f_lo + lo, master[lo:hi], states,
                                          hgrad[lo:hi],
                                          None if hparam is None else hparam[lo:hi], step,
                                          hyper, backend, rule)
            src = master[lo:hi] if hparam is None else hparam[lo:hi]
            self._copy(dev_out[lo:hi], src)  # H2D while the CPU does the next chunk
        step.copy_(new_step)
        self.end()  # bucket k's params are on the device before its all-gather is issued

    def map_piece_(self, gi: int, k: int, names, fn, params: bool = False) -> None:
        """A phased rule's pass over bucket k's piece (placement.py): on the host views
        (the params no rank used left as they were: frozen_slots.HostUnused.map_)."""
        g = self.buffers[gi]
        if self.unused is not None:
            self._wait(self.scalars_ev)
            self._plan_unused()
            f_lo, s0 = g.state_range(k)[0], g.state_slice(k).start
            inner = fn

            def fn(a, b, views):
                self.unused.map_(gi, f_lo + a - s0, views, lambda: inner(a, b, views))
        map_in_memory_(g, k, names, fn, params)

    def finish(self) -> None:
        """After every piece (offload_nvme commits here; the host state needs nothing)."""

    def close(self) -> None:
        pass

    def disk_bytes(self) -> Optional[dict]:
        return None

    def host_bytes(self) -> dict:
        out = dict.fromkeys(("master", *self.rule.state_names, "host_staging"), 0)
        for st in self.states:
            out["master"] += st.master.untyped_storage().nbytes()
            for k, t in st.states.items():
                out[k] += t.untyped_storage().nbytes()
            out["host_staging"] += sum(t.untyped_storage().nbytes() for t in st.host_tensors())
        out["host_staging"] += self.scalars.untyped_storage().nbytes()
        return out

    # -- placement.py [Note: each placement reports its own bytes] ------------------------------
    @staticmethod
    def layout_bytes(rule: Rule, state_numel: int, state_padding: int, dtype: torch.dtype,
                     grad_dtype: torch.dtype, master: str = "fp32") -> dict:
        """HostState of one buffer: an fp32 master and the rule's states (padding included),
        a grad staging piece (reduce dtype) and a param staging piece (not at fp32)."""
        S = state_numel
        host = {"master": S * 4, **{s.name: s.numel(S) * s.dtype.itemsize for s in rule.states}}
        host["host_staging"] = S * grad_dtype.itemsize + \
            (0 if dtype == torch.float32 else S * dtype.itemsize)
        return {"device": {}, "host": host, "disk": None}

    @staticmethod
    def fixed_bytes(rule: Rule, state_numels, dtype: torch.dtype,
                    grad_dtype: torch.dtype) -> dict:
        """The [grad_scale, found_inf] host scalars, once."""
        return {"device": {}, "host": {"host_staging": 2 * 4}, "disk": None}
