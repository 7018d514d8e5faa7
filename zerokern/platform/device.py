"""The device handle: streams, events, pinned memory, RNG, device facts and the collective
backend of one device type, through one object (issue 35).

[Note: one device handle]
FSDP2 reaches the accelerator through `_get_device_handle(device_type)` (the `torch.<type>`
module), so a new device type is one lookup, not a search through the code. zerokern does the
same: every module that needs a stream, an event, a device's name or its RNG asks
`handle(device)` (or `accelerator()` for "the machine's GPU, if any") and calls the
`DeviceHandle`; `torch.cuda` is named here and in two more places only (the kernels' CUDA
build, which compiles for CUDA itself, and the fake-CUDA test harness). A ROCm build of torch
answers as "cuda" (HIP behind the same module); an XPU is `handle("xpu")`: the same methods on
`torch.xpu`, with the collective backend "xccl".

The torch module is looked up at every call (`getattr(torch, type)`), never kept: the
fake-CUDA harness (tests/support/fake_cuda) replaces `torch.cuda.Stream`/`Event` with
recording stand-ins after import, and they must be the ones used.

[Note: what a device can do]
The library's choices of pinning, side streams and events ask the handle what the device can
do (`has_streams`, `pins_host_memory`), never whether its type is "cuda", so a new device type
with streams is one entry in `_STREAMED`, not an edit in every module that copies to the host.
Both are True exactly for "cuda" (ROCm too) and "xpu": for cpu, meta and cuda the answers are
what `device.type == "cuda"` gave before; an MPS device (a torch module, but no streams in it)
stays on the CPU's code path as before. The choice of which kernel runs (kernels/dispatch.py
and the kernels it picks) stays with the kernels: it is a choice of code compiled for CUDA,
not of a capability (tests/test_device_type_compares.py lists the modules that still compare
a type with "cuda", and why). No XPU has run this code: "xpu" is in `_STREAMED` because
torch.xpu has the same Stream/Event/pin_memory API as torch.cuda.

On the CPU every stream operation is a no-op: `stream()` is None, `use_stream(None)` is a null
context, `event()` is None, so callers write one code path with `if stream is not None` only
where the copy itself differs (a non-blocking copy needs pinned memory and a stream).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Optional, Union

import torch

DeviceLike = Union[str, torch.device, None]

# Device types without a runtime to drive: their stream operations are the CPU's no-ops.
_NOT_ACCELERATORS = ("cpu", "meta")
# Device types whose runtime has streams, events and page-locked host memory, so that a copy
# between the device and the host can run asynchronously ([Note: what a device can do]).
_STREAMED = ("cuda", "xpu")
# The collective backend of each device type: torch.distributed's own names.
_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}


class DeviceHandle:
    """One device type's runtime (module Note). Build it with `handle(device)`."""

    def __init__(self, device_type: str) -> None:
        self.type = device_type

    def __repr__(self) -> str:
        return f"DeviceHandle({self.type!r})"

    # -- what the device is --------------------------------------------------------------
    @property
    def module(self) -> Any:
        """`torch.<type>` (looked up now: stand-ins patched in after import are used)."""
        return getattr(torch, self.type)

    @property
    def is_accelerator(self) -> bool:
        """A device with a runtime of its own (cuda, xpu, ...): not the CPU, not `meta`
        (shapes only), and one torch has a module for."""
        return self.type not in _NOT_ACCELERATORS and getattr(torch, self.type, None) is not None

    @property
    def has_streams(self) -> bool:
        """Streams and events drive this device's work: a copy to or from the host can run on
        a side stream and be waited for by an event ([Note: what a device can do])."""
        return self.type in _STREAMED

    @property
    def pins_host_memory(self) -> bool:
        """Host buffers that exchange data with this device are pinned (page-locked), so that
        a non-blocking copy is truly asynchronous; False on the CPU. (Pinning pays only where
        a stream copies asynchronously: the same devices as `has_streams`.)"""
        return self.has_streams

    @property
    def backend(self) -> str:
        """The torch.distributed backend for tensors of this type ("nccl" for CUDA)."""
        return _BACKENDS.get(self.type, "gloo")

    def is_available(self) -> bool:
        if not self.is_accelerator:
            return True
        mod = getattr(torch, self.type, None)
        return bool(mod is not None and mod.is_available())

    def device_count(self) -> int:
        if not self.is_accelerator:
            return 1
        return self.module.device_count() if self.is_available() else 0

    def current_device(self) -> torch.device:
        """The current device of this type, with its index (cpu: `cpu`)."""
        if not self.is_accelerator:
            return torch.device("cpu")
        return torch.device(self.type, self.module.current_device())

    def indexed(self, device: DeviceLike) -> torch.device:
        """`device` with its index filled in (`cuda` -> the current `cuda:i`)."""
        d = torch.device(device) if device is not None else self.current_device()
        if d.type != "cpu" and d.index is None:
            return self.current_device()
        return d

    def set_device(self, index: int) -> None:
        if self.is_accelerator:
            self.module.set_device(index)

    def device_context(self, device: DeviceLike):
        """Makes `device` current for the block (events record on the current device's
        stream); a null context on the CPU."""
        return self.module.device(device) if self.is_accelerator else nullcontext()

    def name(self, index: int = 0) -> str:
        return self.module.get_device_name(index) if self.is_accelerator else "cpu"

    def capability(self, index: Optional[int] = None):
        """(major, minor) compute capability of a CUDA device."""
        return self.module.get_device_capability(index)

    def properties(self, index: Any):
        return self.module.get_device_properties(index)

    def mem_get_info(self, device: DeviceLike = None):
        """(free, total) bytes of the device."""
        return self.module.mem_get_info(device)

    # -- streams and events ----------------------------------------------------------------
    def stream(self, device: DeviceLike = None):
        """A new side stream on `device` (None on the CPU)."""
        if not self.is_accelerator:
            return None
        return self.module.Stream(device=device) if device is not None else self.module.Stream()

    def current_stream(self, device: DeviceLike = None):
        if not self.is_accelerator:
            return None
        return self.module.current_stream(device)

    def use_stream(self, stream):
        """Runs the block on `stream`; a null context for None (the CPU, or no side stream)."""
        return nullcontext() if stream is None else self.module.stream(stream)

    def event(self, enable_timing: bool = False):
        """A new event (None on the CPU)."""
        if not self.is_accelerator:
            return None
        return self.module.Event(enable_timing=enable_timing) if enable_timing \
            else self.module.Event()

    def recorded_event(self, stream=None):
        """An event recorded on `stream` (the current stream when None); None on the CPU."""
        ev = self.event()
        if ev is not None:
            ev.record(stream) if stream is not None else ev.record()
        return ev

    def synchronize(self, device: DeviceLike = None) -> None:
        if self.is_accelerator:
            self.module.synchronize(device)

    def empty_cache(self) -> None:
        if self.is_accelerator:
            self.module.empty_cache()

    # -- pinned host memory ------------------------------------------------------------------
    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        """Page-lock [ptr, ptr + nbytes) for async copies (cudaHostRegister); the error code."""
        return int(self.module.cudart().cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> None:
        self.module.cudart().cudaHostUnregister(ptr)

    # -- the RNG -------------------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor:
        return self.module.get_rng_state() if self.is_accelerator else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.is_accelerator:
            self.module.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        if self.is_accelerator:
            self.module.manual_seed(seed)
        else:
            torch.manual_seed(seed)


@functools.cache
def _by_type(device_type: str) -> DeviceHandle:
    return DeviceHandle(device_type)


def handle(device: Union[DeviceLike, torch.Tensor] = None) -> DeviceHandle:
    """The handle of a device, a device type, or a tensor's device; None: `accelerator()`.
    Anything with a `type` (a torch.device, or a stand-in for one) names its type."""
    if device is None:
        return accelerator()
    if isinstance(device, torch.Tensor):
        return _by_type(device.device.type)
    if isinstance(device, (str, int)):
        return _by_type(torch.device(device).type)
    return _by_type(str(device.type))


def accelerator() -> DeviceHandle:
    """The machine's accelerator (CUDA, or an XPU), if torch sees one; else the CPU's."""
    for t in ("cuda", "xpu"):
        h = _by_type(t)
        if h.is_available():
            return h
    return _by_type("cpu")


def has_accelerator() -> bool:
    return accelerator().is_accelerator
