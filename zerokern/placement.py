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

from . import kernels


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
    """The state on the device, updated by the fused kernel in place (no offload)."""

    offload = None
    movable = True  # the state follows model.to(device) (model_sync.py)

    def allocate(self, buf) -> DeviceState:
        return DeviceState(buf)

    def attach(self, buffers) -> None:
        self.buffers = buffers

    def begin(self, grad_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        self.grad_scale, self.found_inf = grad_scale, found_inf

    def update_piece(self, gi: int, k: int, grad: torch.Tensor, hyper: dict,
                     backend: str) -> None:
        g = self.buffers[gi]
        m, v = g.moments(k)
        kernels.adam_step_(g.master_piece(k), m, v, grad, g.param_out_piece(k),
                           step=g.steps[k], grad_scale=self.grad_scale,
                           found_inf=self.found_inf, backend=backend, **hyper)

    def finish(self) -> None:
        pass

    def host_bytes(self) -> Optional[dict]:
        return None

    def disk_bytes(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


def make_placement(offload: Optional[str], grad_dtype: torch.dtype, offload_path=None,
                   comm=None):
    """The placement for ZeroAdamW's `offload=` (arguments validated by the optimizer)."""
    if offload is None:
        return DevicePlacement()
    if offload == "cpu":
        from .offload import Offloader

        return Offloader(grad_dtype)
    from .offload_nvme import NvmeOffloader

    return NvmeOffloader(grad_dtype, offload_path, comm)
