"""The device handle (zerokern/platform/device.py, [Note: one device handle]): the one module
that names `torch.cuda`, CPU no-ops, and stand-ins patched in after import are the ones used.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from zerokern.platform import device as dev_mod
from zerokern.platform.device import accelerator, handle

from .test_gpu_static_checks import _dotted

PKG = Path(__file__).resolve().parents[1] / "zerokern"


def modules_naming_torch_cuda(sources) -> set:
    """Files whose code (not comments or docstrings) reads an attribute of `torch.cuda`."""
    out = set()
    for name, text in sources:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and _dotted(node).startswith("torch.cuda."):
                out.add(name)
                break
    return out


def test_torch_cuda_is_named_by_the_device_handle_only():
    sources = [(str(p.relative_to(PKG.parent)), p.read_text()) for p in PKG.rglob("*.py")]
    assert modules_naming_torch_cuda(sources) == set(), \
        "name streams, events, pinned memory and devices through zerokern.platform.device"


def test_the_check_can_fail():
    snippet = "import torch\n\ndef f():\n    return torch.cuda.Stream()\n"
    docstring_only = '"""torch.cuda.Stream in prose"""\n# torch.cuda.Event in a comment\n'
    assert modules_naming_torch_cuda([("a.py", snippet), ("b.py", docstring_only)]) == {"a.py"}


def test_cpu_handle_is_a_no_op():
    h = handle("cpu")
    assert handle(torch.zeros(1)) is h and handle(torch.device("cpu")) is h
    assert not h.is_accelerator and h.backend == "gloo"
    assert h.stream() is None and h.event() is None and h.recorded_event() is None
    assert h.current_stream() is None
    with h.use_stream(None), h.device_context("cpu"):
        pass
    h.synchronize()
    h.empty_cache()
    assert h.current_device() == torch.device("cpu") and h.device_count() == 1
    state = h.get_rng_state()
    h.manual_seed(3)
    a = torch.rand(2)
    h.set_rng_state(state)
    h.manual_seed(3)
    assert torch.equal(a, torch.rand(2))


def test_types_and_backends():
    assert handle("cuda:1") is handle("cuda") and handle("cuda").backend == "nccl"
    assert handle("xpu").backend == "xccl"
    # this machine has no accelerator: the CPU's handle
    assert accelerator() is (handle("cuda") if torch.cuda.is_available() else handle("cpu"))


def test_stand_ins_patched_after_import_are_used(monkeypatch):
    """The fake-CUDA harness replaces torch.cuda's Stream and Event after import: the handle
    looks them up at each call (tests/support/fake_cuda)."""
    made = []

    class Stream:
        def __init__(self, device=None):
            made.append(("stream", device))

    class Event:
        def __init__(self, enable_timing=False):
            made.append(("event", enable_timing))

        def record(self, stream=None):
            made.append(("record", stream))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    h = dev_mod.handle("cuda")
    s = h.stream("cuda:0")
    ev = h.recorded_event(s)
    assert isinstance(s, Stream) and isinstance(ev, Event)
    assert made == [("stream", "cuda:0"), ("event", False), ("record", s)]
