"""Does a script put its model and its batches on a device before it uses them?

    python tests/examples/placement_probe.py examples/torch_loop.py --stage 2   # as the script

On a GPU a model that never moved stays on the CPU (NCCL then refuses it) and a batch that never
moved meets a CUDA model in the forward; on the CPU both run anyway, so a CI run alone cannot
tell. The probe records the storages a script moved on purpose: what `Tensor.to(device)` /
`.cuda()` returned and the params and buffers of a module after `Module.to(device)` / `.cuda()`
(any device: "cpu" counts, the call is what matters). It then checks that
* every param a zerokern optimizer is built on was moved (ZeroOptimizer.__init__), and
* every tensor given to such an optimizer's model in a forward was moved (a view of a moved
  batch counts; a 0-d tensor need not be),
raising RuntimeError otherwise, and prints how many of each it checked at exit. Used by
tests/examples (every example script runs under it) and test_quickstart.py (in-process).
"""

from __future__ import annotations

import atexit
import runpy
import sys

import torch


class Probe:
    def __init__(self) -> None:
        self.placed = set()   # data_ptrs of storages a script moved to a device
        # their storages stay alive, so no address is reused for another tensor (the storage,
        # not the tensor: ZeroAdamW re-points a param's .data at its flat buffer, which freed
        # the old storage and let a new batch land at a marked address, a flaky pass)
        self.keep = []
        self.roots = {}       # id(model) -> model, the models of zerokern optimizers
        self.optimizers = self.forwards = 0

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            self.placed.add(t.untyped_storage().data_ptr())
            self.keep.append(t.untyped_storage())

    def moved(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.placed

    def install(self, setattr_=setattr) -> None:
        from zerokern.core.optimizer import ZeroOptimizer

        probe = self
        real_to, real_cuda = torch.Tensor.to, torch.Tensor.cuda
        real_mod_to, real_mod_cuda = torch.nn.Module.to, torch.nn.Module.cuda
        real_init, real_call = ZeroOptimizer.__init__, torch.nn.Module.__call__

        def device_of(args, kwargs):
            kw = {k: v for k, v in kwargs.items() if k != "copy"}  # (Tensor.to's own)
            return torch._C._nn._parse_to(*args, **kw)[0]

        def to(self, *args, **kwargs):
            out = real_to(self, *args, **kwargs)
            if device_of(args, kwargs) is not None:
                probe.mark(out)
            return out

        def cuda(self, *args, **kwargs):
            out = real_cuda(self, *args, **kwargs)
            probe.mark(out)
            return out

        def mod_to(self, *args, **kwargs):
            out = real_mod_to(self, *args, **kwargs)
            if device_of(args, kwargs) is not None:
                for t in [*self.parameters(), *self.buffers()]:
                    probe.mark(t)
            return out

        def mod_cuda(self, *args, **kwargs):
            out = real_mod_cuda(self, *args, **kwargs)
            for t in [*self.parameters(), *self.buffers()]:
                probe.mark(t)
            return out

        def init(self, params_or_model, *args, **kwargs):
            if isinstance(params_or_model, torch.nn.Module):
                params = list(params_or_model.parameters())
                probe.roots[id(params_or_model)] = params_or_model
            else:
                params_or_model = list(params_or_model)
                params = [p for x in params_or_model
                          for p in (x["params"] if isinstance(x, dict) else [x])]
            stay = [tuple(p.shape) for p in params if not probe.moved(p)]
            if stay:
                raise RuntimeError(f"placement probe: {type(self).__name__} built on "
                                   f"{len(stay)} param(s) the script never moved to a device "
                                   f"(shapes {stay[:4]}): move the model first")
            probe.optimizers += 1
            return real_init(self, params_or_model, *args, **kwargs)

        def call(self, *args, **kwargs):
            if id(self) in probe.roots:
                # (a 0-d tensor, such as Trainer's num_items_in_batch, may stay on the CPU:
                # torch's ops take a 0-d CPU tensor with CUDA ones)
                given = [t for t in [*args, *kwargs.values()]
                         if isinstance(t, torch.Tensor) and t.dim() > 0]
                stay = [tuple(t.shape) for t in given if not probe.moved(t)]
                if stay:
                    raise RuntimeError(f"placement probe: the model got {len(stay)} input(s) "
                                       f"the script never moved to a device (shapes {stay}): "
                                       "move the batches too")
                probe.forwards += 1
            return real_call(self, *args, **kwargs)

        setattr_(torch.Tensor, "to", to)
        setattr_(torch.Tensor, "cuda", cuda)
        setattr_(torch.nn.Module, "to", mod_to)
        setattr_(torch.nn.Module, "cuda", mod_cuda)
        setattr_(ZeroOptimizer, "__init__", init)
        setattr_(torch.nn.Module, "__call__", call)

    def summary(self) -> str:
        return (f"placement probe: {self.optimizers} optimizer(s), {self.forwards} forward(s) "
                "checked")


def main() -> None:
    probe = Probe()
    probe.install()
    atexit.register(lambda: print(probe.summary(), flush=True))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
