"""Recording stand-ins for torch.cuda's runtime on a CPU-only build (issue 34, item 1).

Streams and events record what waits on what (record.LOG.waits); every host wait
(Stream/Event.synchronize, torch.cuda.synchronize) is a host-sync event in the log. Device
queries answer as one node of 8 H100s would.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import types

import torch

_ids = itertools.count(1)
_CURRENT = {"device": 0, "stream": {}}


def install(record, shim=None) -> None:
    cuda = torch.cuda

    class Stream:
        def __init__(self, device=None, priority=0, **kw):
            self.device = torch.device("cuda", _index(device))
            self.id = next(_ids)
            self.priority = priority

        def wait_stream(self, other):
            record.LOG.waits.append({"waiter": self.id, "on_stream": other.id, "phase": record.LOG.phase})

        def wait_event(self, event):
            record.LOG.waits.append({"waiter": self.id, "on_event": event.id, "phase": record.LOG.phase})

        def record_event(self, event=None):
            event = event or Event()
            event.record(self)
            return event

        def synchronize(self):
            record.LOG.note("host_wait", "Stream.synchronize")

        def query(self):
            return True

        def __eq__(self, other):
            return isinstance(other, Stream) and other.id == self.id

        def __hash__(self):
            return self.id

        @property
        def cuda_stream(self):
            return self.id

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.id = next(_ids)
            self.stream = None

        def record(self, stream=None):
            self.stream = (stream or current_stream()).id

        def wait(self, stream=None):
            (stream or current_stream()).wait_event(self)

        def synchronize(self):
            record.LOG.note("host_wait", "Event.synchronize")

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    def _index(device=None):
        if device is None:
            return _CURRENT["device"]
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return d.index if d.index is not None else _CURRENT["device"]

    def current_stream(device=None):
        i = _index(device)
        if i not in _CURRENT["stream"]:
            _CURRENT["stream"][i] = default_stream(i)
        return _CURRENT["stream"][i]

    _defaults = {}

    def default_stream(device=None):
        i = _index(device)
        if i not in _defaults:
            _defaults[i] = Stream(i)
        return _defaults[i]

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        i = s.device.index
        prev = current_stream(i)
        _CURRENT["stream"][i] = s
        try:
            yield
        finally:
            _CURRENT["stream"][i] = prev

    class device:
        def __init__(self, d):
            self.idx = _index(d) if d is not None and d != -1 else _CURRENT["device"]

        def __enter__(self):
            self.prev, _CURRENT["device"] = _CURRENT["device"], self.idx

        def __exit__(self, *exc):
            _CURRENT["device"] = self.prev

    def set_device(d):
        _CURRENT["device"] = _index(d)

    def synchronize(device=None):
        record.LOG.note("host_wait", "torch.cuda.synchronize")

    props = types.SimpleNamespace(name="fake H100", total_memory=80 << 30, major=9, minor=0,
                                  multi_processor_count=132)
    stubs = dict(
        Stream=Stream, Event=Event, current_stream=current_stream, default_stream=default_stream,
        stream=stream, device=device, set_device=set_device, synchronize=synchronize,
        # False: with True, torch.tensor(data, device="cuda") builds its tensor below the Python
        # dispatch modes (a real CUDA allocation, which this build has not). zerokern's
        # optimizer path never reads it (engine.py's default backend and the toolchain probe
        # do; the scenarios name their backends).
        is_available=lambda: False, device_count=lambda: 8, current_device=lambda: _CURRENT["device"],
        get_device_capability=lambda d=None: (9, 0), get_device_name=lambda d=None: props.name,
        get_device_properties=lambda d=None: props, mem_get_info=lambda d=None: (70 << 30, 80 << 30),
        empty_cache=lambda: None, is_initialized=lambda: True, init=lambda: None,
        memory_allocated=lambda d=None: 0, max_memory_allocated=lambda d=None: 0,
        reset_peak_memory_stats=lambda d=None: None, is_bf16_supported=lambda *a, **k: True,
    )
    if shim is not None:  # cudaHostRegister: the shim's pinned registry (fake_cuda.cpp)
        shim.zk_fake_cuda_host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        shim.zk_fake_cuda_host_unregister.argtypes = [ctypes.c_void_p]
        cudart = types.SimpleNamespace(
            cudaHostRegister=lambda p, n, f: shim.zk_fake_cuda_host_register(p, n, f),
            cudaHostUnregister=lambda p: shim.zk_fake_cuda_host_unregister(p),
            cudaGetErrorString=lambda e: f"fake cuda error {e}")
        stubs["cudart"] = lambda: cudart
        # torch answers is_pinned() False for every pointer until the CUDA context was lazily
        # initialised (the first pinned allocation does it), as on a GPU where a registered
        # buffer comes after torch's first CUDA use: initialise it now.
        torch.empty(1, pin_memory=True)
    for k, v in stubs.items():
        setattr(cuda, k, v)

    def record_stream(t, s):  # the caching allocator's "in use on stream s" mark
        record.LOG.waits.append({"record_stream": s.id, "phase": record.LOG.phase})

    torch.Tensor.record_stream = record_stream
    _CURRENT["reset"] = lambda: (_CURRENT["stream"].clear(), _defaults.clear(),
                                 _CURRENT.__setitem__("device", 0))


def reset() -> None:
    if "reset" in _CURRENT:
        _CURRENT["reset"]()
