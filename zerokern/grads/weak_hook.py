"""The one hook wrapper (grad_sync.py, stage3/runtime.py, stage3/guards.py): a callable that runs
`obj.<name>(*args)` through a weak reference, eagerly.

[Note: weak, eager hooks]
- Weak: hooks live in C++ (tensor, grad-accumulator and module hooks) where the garbage
  collector cannot see a cycle back to the optimizer, so a strong reference there would keep
  `del opt, model` from freeing anything. A dead target makes the hook a no-op.
- Eager: the body is never traced by dynamo (stage 3 under torch.compile). The hooks issue
  collectives and swap `p.data`, which dynamo would turn into in-place ops on the params
  (autograd then sees the saved params "modified by an inplace operation").
- The body is wrapped with torch.compiler.disable at the first call, not at import: that
  imports torch._dynamo and with it triton, which must not happen at `import zerokern`
  (triton reads TRITON_INTERPRET when it is first imported).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

_EAGER: list = []


def weak_hook(obj, name: str) -> Callable:
    """A hook calling `obj.<name>(*args)` (its result, or None once obj is gone)."""
    ref = weakref.ref(obj)

    def hook(*args):
        return _eager()(ref, name, args)
    return hook


def _eager():
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_body))
    return _EAGER[0]


def _body(ref, name: str, args: tuple):
    obj = ref()
    return None if obj is None else getattr(obj, name)(*args)
