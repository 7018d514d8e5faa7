"""A process that used a gloo group lets gloo's worker threads finish before Python finalizes.

[Note: the gloo exit race]
With torch 2.13 a gloo rank may abort after it has finished its work: "terminate called without
an active exception", SIGABRT, exit code -6. torchrun then reports the job as failed.

How it happens:
- torch keeps the default process group alive after `destroy_process_group()`. The first
  optimizer built imports torch._dynamo, which imports torch.distributed.nn.functional, and that
  module's functions take `group=group.WORLD` as a default argument.
- So gloo's worker threads outlive the script.
- A worker releases its last finished work a moment after the waiting thread has moved on. That
  release drops tensors that own Python objects, so it takes the GIL.
- If the main thread is already finalizing the interpreter, the worker gets pthread_exit instead.
  The unwind crosses a noexcept destructor and the process dies.

Core dump: pt_gloo_runloop in ~AsyncWork -> gil_scoped_acquire -> take_gil -> pthread_exit, with
the main thread in Py_FinalizeEx.

Measured on the 2-core VM, runs that crashed at exit under torchrun (2 ranks):

| script | runs crashed |
|---|---:|
| plain torch DDP + AdamW on gloo | 7 of 40 |
| examples/torch_loop.py at stage 3 | 1 of 20 |
| `zerokern train` (before cli.py's [Note: leaving a torchrun rank]) | 7 of 170 |

So the first GroupComm on a gloo group registers an atexit handler. The handler sleeps with the
GIL released: 100 ms, then on in steps of 10 ms until two scans in a row find no
`pt_gloo_runloop` thread busy, at most 10 s ($ZEROKERN_GLOO_EXIT_WAIT_S; it was 1 s, which a
runnable worker could miss on a busy machine: at the limit it says so on stderr, naming the
variable). A worker finishing its release gets the GIL now, while the interpreter is whole.

Busy is running or runnable, or blocked in a futex wait with a timeout. The scan itself holds the
GIL, so a worker that reaches its release during the scan sleeps in CPython's take_gil, which is
a timed wait (the switch interval), not state R. The first version looked for R alone and ended
there; the Python that ran next could hand that worker the GIL only after finalization had
begun (a CI run of the slow suite, 2026-11-29: examples/deepspeed_config.py zero2_fp16, rank 1,
1 abort in 692 tests). An idle worker waits on its queue with no timeout; a collective in
flight waits with gloo's, and is waited for too. Two idle scans, because a worker can start its
release between them.

The same plain DDP script with a 50 ms atexit sleep crashed in 0 of 40 runs; with 20 ms,
examples/accelerate_loop.py at stage 3 still crashed once at load ~8 (a local CI run,
2026-11-29), so the first sleep is 100 ms. Cost: about 0.1 s at exit, once per process that
used gloo. The torchrun ranks of `zerokern train` run it too:
they run the atexit handlers before `os._exit` (cli.py [Note: leaving a torchrun rank]). spawn.py's
ranks skip interpreter teardown, and with it this wait, altogether.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Callable, NoReturn, Optional

_registered = False
_FIRST_S = 0.1  # (see the Note: 20 ms missed a worker once at load ~8)
_STEP_S = 0.01
MAX_ENV = "ZEROKERN_GLOO_EXIT_WAIT_S"


def _max_s() -> float:
    """The most seconds the exit wait lasts ($ZEROKERN_GLOO_EXIT_WAIT_S, default 10)."""
    raw = os.environ.get(MAX_ENV, "").strip()
    try:
        return float(raw) if raw else 10.0
    except ValueError:
        return 10.0  # (at exit: nothing to raise to; the warning below names the variable)


_MAX_S = _max_s()


def guard_gloo_exit() -> None:
    """Register the atexit handler of [Note: the gloo exit race], once per process."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(let_gloo_workers_finish)


# futex's syscall number in /proc/<pid>/task/<tid>/syscall, by machine (Linux x86_64, aarch64).
_FUTEX_NR = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine if hasattr(os, "uname") else "")
_IDLE_SCANS = 2  # consecutive idle scans, a GIL-released sleep apart (see the Note above)


def _waits_with_a_timeout(task: str) -> bool:
    """The thread sits in a futex wait that has a timeout: a GIL wait (CPython's take_gil
    waits in steps of the switch interval) or a collective in flight (gloo waits with its
    timeout). An idle gloo worker waits on its queue's condition variable with none."""
    if _FUTEX_NR is None:
        return False
    try:
        with open(f"/proc/self/task/{task}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return False
    # "nr arg0 arg1 arg2 arg3 ..." while blocked; arg3 is futex's timeout pointer
    return len(fields) > 4 and fields[0] == str(_FUTEX_NR) and int(fields[4], 16) != 0


def _gloo_workers_running() -> bool:
    """A thread named pt_gloo_runloop is running, runnable, or blocked in a timed wait (a GIL
    wait, or a collective in flight): Linux /proc; False elsewhere."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        if name != "pt_gloo_runloop":
            continue
        if stat[stat.rfind(")") + 2] == "R" or _waits_with_a_timeout(t):
            return True
    return False


def let_gloo_workers_finish() -> None:
    """Sleep (the GIL released) until gloo's workers are idle: _FIRST_S, then until
    _IDLE_SCANS scans in a row, _STEP_S apart, find none busy, at most _MAX_S in all; past
    that, say on stderr that it timed out and what to raise (at exit there is no caller to
    raise to: [Note: timeouts under load])."""
    t0 = time.monotonic()
    deadline = t0 + _MAX_S
    time.sleep(_FIRST_S)
    idle = 0
    while True:
        idle = 0 if _gloo_workers_running() else idle + 1
        if idle == _IDLE_SCANS:
            return
        if time.monotonic() >= deadline:
            sys.stderr.write(
                f"zerokern: timed out after {time.monotonic() - t0:.1f} s waiting at exit for "
                "torch's gloo worker threads to go idle ([Note: the gloo exit race] in "
                "zerokern/comm/exit_guard.py); this process may abort while Python finalizes "
                f"(SIGABRT after its work is done). On a busy machine raise {MAX_ENV} "
                f"(now {_MAX_S:g})\n")
            sys.stderr.flush()
            return
        time.sleep(_STEP_S)


def leave_rank(main: Callable[[], Optional[int]]) -> NoReturn:
    """Run `main()` as a torchrun rank and end the process the way cli.py's [Note: leaving a
    torchrun rank] says: the atexit handlers, the output flushed, then `os._exit` (no
    interpreter finalization for gloo's worker threads to crash into). A usage error exits
    with its code; any other exception (PeerLost: a peer was killed) is printed and exits 1,
    so that torchrun sees the failure at once and restarts.

    Args:
        main: the rank's work; returns its exit code (None: 0).
    """
    try:
        code = main() or 0
    except SystemExit as e:  # a usage error (its message is printed) or --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - PeerLost (a killed peer) and any other error
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
