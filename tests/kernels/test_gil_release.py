"""The CPU kernels release the GIL while they run ([Note: the kernels release the GIL],
kernels/native.py): a thread calling one leaves the interpreter to the others.

With the interpreter's switch interval raised to 1 s, a thread that holds the GIL keeps it until
its call returns. A worker thread signals, then makes one long call; the main thread, woken by
the signal, can only look at the worker's `done` flag while the call runs if the call released
the GIL. Negative control: a C call that holds the GIL (building a 100 MB bytes object) is
always seen done. Three tries each, so a loaded machine cannot fail a releasing kernel."""

import sys
import threading

import pytest
import torch

from zerokern.kernels.build import load_op

N = 16_000_000  # ~10-40 ms per call on one core


def _seen_running(fn) -> bool:
    """Whether the main thread ran while fn ran on a worker thread."""
    started, done = threading.Event(), [False]

    def work():
        started.set()
        fn()
        done[0] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        t = threading.Thread(target=work)
        t.start()
        started.wait()
        running = not done[0]
        t.join()
    finally:
        sys.setswitchinterval(old)
    return running


def _any_of_three(fn) -> bool:
    return any(_seen_running(fn) for _ in range(3))


@pytest.fixture(scope="module")
def bufs():
    torch.manual_seed(0)
    p, g = torch.randn(N), torch.randn(N)
    return p, torch.zeros(N), torch.zeros(N), g


# The ops are called directly: the Python wrappers run torch ops, which release the GIL
# around themselves, so a call through them would be seen running whatever the kernel did.
def test_adam_step_releases_the_gil(bufs):
    p, m, v, g = bufs
    op = load_op("cpu")
    step, one, found = torch.zeros((), dtype=torch.int64), torch.ones(()), torch.zeros(())
    assert _any_of_three(lambda: op.adam_step(p, m, v, g, None, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                              True, step, one, found))


def test_grad_stats_releases_the_gil(bufs):
    g = torch.cat([bufs[3]] * 4)  # a few ms per pass: make it long enough to be seen
    op = load_op("cpu")
    found, sumsq = torch.zeros(()), torch.zeros(())
    assert _any_of_three(lambda: op.grad_stats(g, found, sumsq))


def test_negative_control_a_call_holding_the_gil_is_never_seen_running():
    assert not _any_of_three(lambda: b"\x01" * 100_000_000)
