"""Where the master and the rule's state live, and the update that runs there: the placement.

[Note: offload is a placement of the state]
`offload=None | "cpu" | "nvme"` picks one placement per optimizer, made before the buffers:
    DevicePlacement  (here)            the buffer's device; the fused kernel of `backend`
    Offloader        (offload.py)      pinned host memory; the cpu kernel, pipelined copies
    NvmeOffloader    (offload_nvme.py) files; streamed through a bounded host pool
Each buffer asks it for its state at construction (`allocate(buffer)`, while the params still
hold their original values, from which the masters are filled), and reads the state through
`buffer.master` / `buffer.rule_states` (the rule's state tensors by name, zerokern.rules) /
`steps`: nobody outside the placement overwrites those, and a placement on disk never holds
them whole in memory. Every state object is a `rule.RuleState`. The optimizer's `step()`
calls the update one way, whatever the placement and the rule:

    placement.begin(grad_scale, found_inf)
    for each (buffer gi, bucket k): placement.update_piece(gi, k, grad_piece, hyper, backend)
                                    then the buffer publishes its piece (stages 1-2)
    placement.finish()          # nvme: commit the step, or roll it back and raise

A phased rule (Muon) reads and writes some states per piece in passes instead:
`placement.map_piece_(gi, k, names, fn, params)` runs `fn(a, b, views)` on the named states
(and "master") of bucket k's piece, state elements [a, b), and with params casts the new master
into the 16-bit params: in memory one call (`map_in_memory_`), with a compact master chunk by
chunk through an expanded scratch (compact_master.py), on disk streamed through the pool
(offload_nvme.py [Note: a phased rule over NVMe]).
The reports ask it what it holds: `state.device_buffers()` per buffer (memory_report's
device categories), `host_bytes()` and `disk_bytes()` (None where it keeps nothing there).

[Note: each placement reports its own bytes]
What a placement will hold for a layout is answered by the placement class itself, from the
rule's state list: `layout_bytes(rule, state_numel, state_padding, dtype, grad_dtype)` gives
the device / host / disk bytes per category of one buffer, `fixed_bytes(...)` what it holds
once per optimizer (scalars, the NVMe I/O pool). `estimate` predicts memory_report() with
these, and the two NVMe free-space checks (optimizer.py, stage3/param_offload_checks.py) sum
their disk bytes, so no module re-derives a placement's byte formula.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from zerokern.rules import (
    Rule,
    RuleState,
    alloc_states,
    check_rule,
    map_in_memory_,
    rule_for,
)
from zerokern.rules.registry import adamw_rule
from zerokern.state import huge_pages


def _cats(rule: Rule) -> Dict[str, int]:
    return dict.fromkeys(("master", *rule.state_names), 0)


class DeviceState(RuleState):
    """One buffer's optimizer state on its device (no offload). Shapes (S = state_numel):
    master (S,) fp32, None at fp32 (the params are the master); each of the rule's states
    (S,) fp32; steps (n_buckets,) int64."""

    def __init__(self, buf, rule: Optional[Rule] = None) -> None:
        rule = adamw_rule() if rule is None else rule
        n, dev, fp32 = buf.state_numel, buf.device, torch.float32
        self.master: Optional[torch.Tensor] = None
        if buf.codec.has_master:  # (not at fp32: the params are the master)
            self.master = huge_pages.zeros(n, fp32, dev)  # [Note: streams at one page offset]
            buf.fill_master_(self.master)
        self.states = alloc_states(rule, n, lambda m, dt: huge_pages.zeros(m, dt, dev))
        self.index_states(rule)
        self.steps = torch.zeros(buf.layout.n_buckets, dtype=torch.int64, device=dev)

    def to_(self, device) -> None:
        if self.master is not None:
            self.master = self.master.to(device)
        self.states = {k: t.to(device) for k, t in self.states.items()}
        self.steps = self.steps.to(device)


class DevicePlacement:
    """The state on the device, updated by the fused kernel in place (no offload).

    master="compact" (bf16 buffers): the fp32 master is held as its low halves and tie bits,
    with the bf16 params as the high halves (compact_master.py [Note: the compact master]); a
    buffer whose master is expanded (read or written since the last step) takes the plain path.
    """

    offload = None
    movable = True  # the state follows model.to(device) (model_sync.py)

    def __init__(self, master: str = "fp32", rule: Optional[Rule] = None,
                 rules: Optional[Sequence[Rule]] = None, codec=None) -> None:
        self.master = master
        self.codec = codec  # the optimizer's ParamCodec (None: each buffer its dtype's)
        self.rule = check_rule(adamw_rule() if rule is None else rule)
        self.rules = None if rules is None else [check_rule(r) for r in rules]
        self._scratch = None

    def allocate(self, buf):
        rule = rule_for(self, buf)
        if self.codec is not None:
            buf.codec = self.codec
        if self.master == "compact" and buf.dtype == torch.bfloat16:
            from zerokern.state.compact_master import CompactState

            return CompactState(buf, rule)
        return DeviceState(buf, rule)

    @staticmethod
    def layout_bytes(rule: Rule, state_numel: int, state_padding: int, dtype: torch.dtype,
                     grad_dtype: torch.dtype, master: str = "fp32") -> dict:
        """Bytes one buffer's state takes on the device ([Note: each placement reports its
        own bytes]): "device" per category (padding apart, under "padding"). master="compact":
        2 bytes per element (padding too) and a tie bitmap (compact_master.py)."""
        from zerokern.state.compact_master import tie_bytes

        S, pad = state_numel, state_padding
        dev = _cats(rule)
        dev["padding"] = 0
        if master == "compact":
            dev["master"] = (S - pad) * 2 + tie_bytes(S)
            dev["padding"] += pad * 2
        elif dtype != torch.float32:
            dev["master"] = (S - pad) * 4
            dev["padding"] += pad * 4
        for s in rule.states:  # a per-block state: its blocks of padding only are padding
            dev[s.name] = (s.numel(S) - pad // s.block) * s.dtype.itemsize
            dev["padding"] += pad // s.block * s.dtype.itemsize
        return {"device": dev, "host": None, "disk": None}

    @staticmethod
    def fixed_bytes(rule: Rule, state_numels, dtype: torch.dtype,
                    grad_dtype: torch.dtype) -> dict:
        return {"device": {}, "host": None, "disk": None}

    def _compact_states(self):
        from zerokern.state.compact_master import CompactState

        return [g.state for g in self.buffers if isinstance(g.state, CompactState)]

    def attach(self, buffers) -> None:
        self.buffers = buffers
        for st in self._compact_states():  # the original values: compacted once verified
            st.compact_expanded()
            st.settle(wait=True)

    def begin(self, grad_scale: torch.Tensor, found_inf: torch.Tensor,
              used: Optional[torch.Tensor] = None) -> None:
        # used (the params' flags): the device path's skips are FrozenSkip's (frozen_slots.py)
        self.grad_scale, self.found_inf = grad_scale, found_inf
        states = self._compact_states() if self.master == "compact" else []
        for st in states:
            st.settle()
        live = [st.low.numel() for st in states if not st.expanded]
        if live:  # freed at finish(): never held between steps (compact_master [Note: chunk])
            from zerokern.state.compact_master import CHUNK_NUMEL

            self._scratch = torch.empty(min(CHUNK_NUMEL, max(live)), dtype=torch.float32,
                                        device=self.buffers[0].device)

    def update_piece(self, gi: int, k: int, grad: torch.Tensor, hyper: dict,
                     backend: str) -> None:
        from zerokern.state.compact_master import CompactState

        g = self.buffers[gi]
        st = g.state
        if isinstance(st, CompactState):  # a compact master (compact_master.py)
            if not st.expanded:
                st.update_piece(g, k, grad, hyper, backend, self.grad_scale, self.found_inf,
                                self._scratch)
                return
            master, out = st.expanded_piece(g, k), g.param_values(*g.state_range(k))
        else:
            master, out = g.master_piece(k), g.param_out_piece(k)
        out = None if out is None else g.codec.kernel_out(out)  # fused, or the codec's after
        rule_for(self, g).step_(master, g.moments(k), grad, out, step=g.steps[k],
                        grad_scale=self.grad_scale, found_inf=self.found_inf, backend=backend,
                        **hyper)

    def map_piece_(self, gi: int, k: int, names, fn, params: bool = False) -> None:
        """A phased rule's pass over bucket k's piece (see the module Note)."""
        from zerokern.state.compact_master import CompactState

        g = self.buffers[gi]
        st = g.state
        if isinstance(st, CompactState) and not st.expanded and "master" in names:
            st.map_piece_(g, k, names, fn, params, self._scratch)
            return
        if isinstance(st, CompactState):  # expanded: the step works on the fp32 tensor
            sl = g.state_slice(k)
            views = [st.expanded_piece(g, k) if n == "master" else st.states[n][sl]
                     for n in names]
            fn(sl.start, sl.stop, views)
            if params:
                g.codec.cast_(g.param_values(*g.state_range(k)), views[names.index("master")])
            return
        map_in_memory_(g, k, names, fn, params)

    def finish(self) -> None:
        self._scratch = None
        if self.master == "compact":
            for st in self._compact_states():
                st.finish()

    def host_bytes(self) -> Optional[dict]:
        return None

    def disk_bytes(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


def placement_class(offload: Optional[str]):
    """The placement class for `offload=` (its `layout_bytes` / `fixed_bytes` answer the
    accounting before any placement exists)."""
    if offload is None:
        return DevicePlacement
    if offload == "cpu":
        from zerokern.state.offload import Offloader

        return Offloader
    from zerokern.state.offload_nvme import NvmeOffloader

    return NvmeOffloader


def make_placement(offload: Optional[str], grad_dtype: torch.dtype, offload_path=None,
                   roles=None, master: str = "fp32", rule: Optional[Rule] = None,
                   rules: Optional[Sequence[Rule]] = None, codec=None):
    """The placement for the optimizer's `offload=` and `master=` (validated by it), holding
    `rule`'s state (zerokern.rules; ZeroAdamW's AdamW rule by default), or with `rules` (one
    per param group; `rule` then their `combine`) each buffer its group's rule's state.
    `roles`: the optimizer's ParallelPlan (comm/plan.py), over which "nvme" agrees to commit.
    `codec`: the params' format (kernels/param_codec.py; `param_format=`), handed to every
    buffer it allocates for; None: each buffer's dtype (a scaled codec: offload=None only)."""
    rule = adamw_rule() if rule is None else rule
    if offload is None:
        return DevicePlacement(master, rule, rules, codec)
    if offload == "cpu":
        from zerokern.state.offload import Offloader

        return Offloader(grad_dtype, rule=rule, rules=rules)
    from zerokern.state.offload_nvme import NvmeOffloader

    return NvmeOffloader(grad_dtype, offload_path, roles, rule=rule, rules=rules)
