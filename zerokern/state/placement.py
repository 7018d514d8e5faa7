"""Where master, exp_avg and exp_avg_sq live, and the update that runs there: the placement.

[Note: offload is a placement of the state]
`offload=None | "cpu" | "nvme"` picks one placement per optimizer, made before the buffers:
    DevicePlacement  (here)            the buffer's device; the fused kernel of `backend`
    Offloader        (offload.py)      pinned host memory; the cpu kernel, pipelined copies
    NvmeOffloader    (offload_nvme.py) files; streamed through a bounded host pool
Each buffer asks it for its state at construction (`allocate(buffer)`, while the params still
hold their original values, from which the masters are filled), and reads the state through
`buffer.master` / `exp_avg` / `exp_avg_sq` / `steps`: nobody outside the placement overwrites
those, and a placement on disk never holds them whole in memory. `ZeroAdamW.step()` calls
the update one way, whatever the placement:

    placement.begin(grad_scale, found_inf)
    for each (buffer gi, bucket k): placement.update_piece(gi, k, grad_piece, hyper, backend)
                                    then the buffer publishes its piece (stages 1-2)
    placement.finish()          # nvme: commit the step, or roll it back and raise

The reports ask it what it holds: `state.device_tensors()` per buffer (memory_report's
device categories), `host_bytes()` and `disk_bytes()` (None where it keeps nothing there).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from zerokern import kernels


class DeviceState:
    """One buffer's optimizer state on its device (no offload). Shapes (S = state_numel):
    master (S,) fp32, None at fp32 (the params are the master); exp_avg, exp_avg_sq (S,) fp32;
    steps (n_buckets,) int64."""

    def __init__(self, buf) -> None:
        n, dev, fp32 = buf.state_numel, buf.device, torch.float32
        self.master: Optional[torch.Tensor] = None
        if buf.dtype != fp32:
            self.master = torch.zeros(n, dtype=fp32, device=dev)
            buf.fill_master_(self.master)
        self.exp_avg = torch.zeros(n, dtype=fp32, device=dev)
        self.exp_avg_sq = torch.zeros(n, dtype=fp32, device=dev)
        self.steps = torch.zeros(buf.layout.n_buckets, dtype=torch.int64, device=dev)

    def device_tensors(self) -> Dict[str, torch.Tensor]:
        return {cat: t for cat, t in (("master", self.master), ("exp_avg", self.exp_avg),
                                      ("exp_avg_sq", self.exp_avg_sq)) if t is not None}

    def to_(self, device) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq", "steps"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))


class DevicePlacement:
    """The state on the device, updated by the fused kernel in place (no offload).

    master="compact" (bf16 buffers): the fp32 master is held as its low halves and tie bits,
    with the bf16 params as the high halves (compact_master.py [Note: the compact master]); a
    buffer whose master is expanded (read or written since the last step) takes the plain path.
    """

    offload = None
    movable = True  # the state follows model.to(device) (model_sync.py)

    def __init__(self, master: str = "fp32") -> None:
        self.master = master
        self._scratch = None

    def allocate(self, buf):
        if self.master == "compact" and buf.dtype == torch.bfloat16:
            from zerokern.state.compact_master import CompactState

            return CompactState(buf)
        return DeviceState(buf)

    def _compact_states(self):
        from zerokern.state.compact_master import CompactState

        return [g.state for g in self.buffers if isinstance(g.state, CompactState)]

    def attach(self, buffers) -> None:
        self.buffers = buffers
        for st in self._compact_states():  # the original values: compacted once verified
            st.compact_expanded()
            st.settle(wait=True)

    def begin(self, grad_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
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
        g = self.buffers[gi]
        m, v = g.moments(k)
        if hasattr(g.state, "expanded"):  # a compact master (compact_master.py)
            st = g.state
            if not st.expanded:
                st.update_piece(g, k, grad, hyper, backend, self.grad_scale, self.found_inf,
                                self._scratch)
                return
            master, out = st.expanded_piece(g, k), g.param_values(*g.state_range(k))
        else:
            master, out = g.master_piece(k), g.param_out_piece(k)
        kernels.adam_step_(master, m, v, grad, out,
                           step=g.steps[k], grad_scale=self.grad_scale,
                           found_inf=self.found_inf, backend=backend, **hyper)

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


def make_placement(offload: Optional[str], grad_dtype: torch.dtype, offload_path=None,
                   comm=None, master: str = "fp32"):
    """The placement for ZeroAdamW's `offload=` and `master=` (validated by the optimizer)."""
    if offload is None:
        return DevicePlacement(master)
    if offload == "cpu":
        from zerokern.state.offload import Offloader

        return Offloader(grad_dtype)
    from zerokern.state.offload_nvme import NvmeOffloader

    return NvmeOffloader(grad_dtype, offload_path, comm)
