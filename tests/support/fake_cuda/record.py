"""What the fake-CUDA rank records: host syncs, pageable copies, mixed devices, collectives,
stream waits (issue 34, item 1). Imported after torch, with the fake-CUDA shim loaded."""

from __future__ import annotations

import contextlib
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class Log:
    """One rank's record; `phase` is set by the driver (construct, forward, backward, step)."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.events: List[Dict] = []  # host syncs, pageable copies, mixed devices, host waits
        self.collectives: List[Dict] = []  # in issue order, every communicator
        self.waits: List[Dict] = []  # stream -> stream/event edges
        self.pinned: set = set()
        self.kernels: List[Dict] = []  # zerokern::* custom ops: name, devices of their tensors  # StorageImpl addresses of (fake) pinned host tensors

    def note(self, kind: str, what: str) -> None:
        self.events.append({"kind": kind, "what": what, "phase": self.phase, "where": where()})


def where() -> str:
    """The innermost zerokern frames (file:line function), outermost last."""
    out = []
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/zerokern/" in fr.filename and "/tests/" not in fr.filename:
            out.append(f"{fr.filename.split('/zerokern/', 1)[1]}:{fr.lineno} {fr.name}")
            if len(out) == 3:
                break
    return " < ".join(out)


LOG = Log()


def _host_only(args, kwargs) -> bool:
    for a in _flat((args, kwargs)):
        if isinstance(a, FakeTensor):
            return False
    dev = kwargs.get("device")
    return dev is None or torch.device(dev).type == "cpu"


def _is_pinned(t: torch.Tensor) -> bool:
    if isinstance(t, FakeTensor):
        return _storage_key(t) in LOG.pinned
    with unset_fake_temporarily():  # (asked under FakeTensorMode, a real tensor reads False)
        return t.is_pinned()


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - a tensor without storage
        return None


def _dev(t) -> Optional[str]:
    return t.device.type if isinstance(t, torch.Tensor) else None


_SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
             aten.equal.default, aten.allclose.default, aten.masked_select.default,
             aten._unique2.default}
_COPY_OPS = {aten.copy_.default, aten._to_copy.default, aten.to.dtype_layout, aten.to.device,
             aten._copy_from.default, aten._copy_from_and_resize.default}
_FACTORIES_PIN = {aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default,
                  aten.ones.default, aten.full.default, aten.empty_like.default,
                  aten.zeros_like.default}


class Recorder(TorchDispatchMode):
    """Sits above FakeTensorMode: sees every op with FakeTensor args before it runs."""

    def __init__(self, fake) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _host_only(args, kwargs):
            # Host work (flags, index lists, config checks) runs on real CPU tensors: only the
            # device is fake. A read of a CPU tensor that came from the device is a FakeTensor
            # and is flagged below.
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func in _SYNC_OPS:
            LOG.note("host_sync", str(func))
            if func is aten._local_scalar_dense.default:
                return 0  # keep going: the rank records every violation, not only the first
        if func.namespace == "zerokern":
            LOG.kernels.append({"op": func._schema.name, "phase": LOG.phase, "devices": sorted(
                {str(a.device) for a in _flat((args, kwargs)) if isinstance(a, torch.Tensor)
                 and not (a.device.type == "cpu" and a.dim() == 0)})})
        if func.namespace == "c10d":
            self._collective(func, args, kwargs)
        if func in _COPY_OPS:
            self._copy(func, args, kwargs)
            # A real host tensor bound for the device enters the fake world as a FakeTensor
            # (FakeTensorMode would try the real copy to a device this build has not).
            args = tuple(self.fake.from_tensor(a) if isinstance(a, torch.Tensor)
                         and not isinstance(a, FakeTensor) else a for a in args)
        elif func is aten._pin_memory.default or func is aten.pin_memory.default:
            out = func(*args, **kwargs)
            LOG.pinned.add(_storage_key(out))
            return out
        else:
            self._mixed(func, args)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as e:  # name the op and its arguments' kinds
            raise NotImplementedError(f"{func} on {[type(a).__name__ for a in _flat(args)]} "
                                      f"{kwargs}: {str(e)[:200]}") from None
        if kwargs.get("pin_memory") and isinstance(out, torch.Tensor):
            LOG.pinned.add(_storage_key(out))
        return out

    def _copy(self, func, args, kwargs):
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            dst_dev, non_blocking = _dev(dst), (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        else:
            src = args[0]
            dst_dev = kwargs.get("device")
            dst_dev = torch.device(dst_dev).type if dst_dev is not None else _dev(src)
            non_blocking = kwargs.get("non_blocking", False)
            dst = None
        if not isinstance(src, torch.Tensor):
            return
        s = _dev(src)
        if s == "cpu" and dst_dev == "cuda":
            pinned = _is_pinned(src)
            if src.numel() > 0 and src.dim() > 0 or not pinned:
                if not pinned:
                    LOG.note("pageable_h2d", f"{tuple(src.shape)} {src.dtype}")
                elif not non_blocking:
                    LOG.note("blocking_h2d", f"{tuple(src.shape)} {src.dtype}")
        elif s == "cuda" and dst_dev == "cpu":
            pinned = dst is not None and _is_pinned(dst)
            if not (non_blocking and pinned):
                LOG.note("d2h_sync", f"{tuple(src.shape)} {src.dtype}")

    def _mixed(self, func, args):
        devs = set()
        for a in _flat(args):
            if isinstance(a, torch.Tensor) and not (a.device.type == "cpu" and a.dim() == 0):
                devs.add(str(a.device))
        if len(devs) > 1:
            LOG.note("mixed_devices", f"{func} on {sorted(devs)}")

    def _collective(self, func, args, kwargs):
        tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        group = next((a for a in _flat(args) if type(a).__name__ in ("ScriptObject", "ProcessGroup")), None)
        LOG.collectives.append({
            "op": func._schema.name.split("::")[-1],
            "group": group_name(group),
            "shapes": [list(t.shape) for t in tensors],
            "dtypes": sorted({str(t.dtype) for t in tensors}),
            "devices": sorted({str(t.device) for t in tensors}),
            "phase": LOG.phase,
        })


def group_name(group) -> str:
    if group is None:
        return "?"
    try:
        pg = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
        return ",".join(str(r) for r in dist.get_process_group_ranks(pg)) + ":" + pg.group_name
    except Exception:  # noqa: BLE001
        return repr(group)


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x
