"""Collectives watched for a lost rank (comm/liveness.py `watched`) on two groups at once, from
two threads, issued in opposite orders on the two ranks: each group's collective must wait on
a thread of its own ([Note: one watcher thread per group]).

With one helper thread for every group (the code before this test), rank 0's thread waited in
the group-B gather for rank 1, whose thread waited in the WORLD gather for rank 0's, queued
behind rank 0's B gather: a deadlock until the process group's timeout (zerokern train's save
hit it: the async writer's commit agreement against the train-state gather). Negative control:
the same calls in the same order on both ranks complete either way.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from zerokern.comm import liveness
from zerokern.tools import spawn as zk_spawn

from ..support.harness import _CTX

PG_TIMEOUT_S = 20.0


def _two_groups(rank, ws, opposite):
    liveness.start(dist.distributed_c10d._get_default_store(), rank, ws)
    other = dist.new_group(list(range(ws)), backend="gloo")
    out = {}

    def gather(name, group):
        got = [None] * ws
        liveness.watched(lambda: dist.all_gather_object(got, (name, rank), group=group),
                         f"a test gather on {name}", group)
        out[name] = got

    first_b = rank == 0 or not opposite  # rank 0 issues B first; rank 1 (opposite) WORLD
    t = threading.Thread(target=gather, args=("B", other))
    t0 = time.monotonic()
    if first_b:
        t.start()
        time.sleep(0.3)  # B is queued (and waiting for the peer) before WORLD is issued
        gather("WORLD", None)
    else:
        gather("WORLD", None)  # (blocks until rank 0 issues it; B follows on the thread)
        t.start()
    t.join()
    return {"seconds": time.monotonic() - t0, "out": out}


def _run(opposite):
    return zk_spawn.spawn_ranks(_two_groups, 2, opposite, threads=1, timeout=60,
                                pg_timeout=PG_TIMEOUT_S, context=_CTX)


def test_two_groups_in_opposite_orders_do_not_wait_on_each_other():
    res = _run(True)
    for r in res:
        assert r["out"]["B"] == [("B", 0), ("B", 1)]
        assert r["out"]["WORLD"] == [("WORLD", 0), ("WORLD", 1)]
        assert r["seconds"] < PG_TIMEOUT_S / 2, r


def test_the_same_order_on_both_ranks_completes():  # negative control
    for r in _run(False):
        assert r["out"]["WORLD"] == [("WORLD", 0), ("WORLD", 1)]
