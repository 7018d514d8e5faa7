"""A replaced replica joins a running HSDP job (issue 39): checkpoint/replica_join.py
[Note: a replaced replica joins], comm/quorum.py [Note: a replica quorum].

The slow test runs zerokern/bench/replica_join.py [Note: the replica-join run]: 2 replicas x 2
ranks, each replica its own torchrun, one rank SIGKILLed mid-run; the run must end bitwise
equal to one never killed, with the live replicas' processes never restarted. The fast tests
check the pieces a kill cannot reach on demand: which replica is the source after a failure
(a torn replica is refused, a replica one step ahead wins), which errors a rank survives, and
the arguments.
"""

from __future__ import annotations

import pytest

from zerokern.checkpoint.replica_join import ReplicaJob, ReplicaJobError
from zerokern.comm import quorum
from zerokern.comm.errors import PeerLost, RankAborted
from zerokern.comm.liveness import Lost


def test_source_is_the_whole_replica_furthest_on():
    # (replica, holds state, step count) per rank: replica 1 is new
    assert ReplicaJob._source([(0, True, 7), (0, True, 7), (1, False, -1), (1, False, -1)]) \
        == (0, [1])
    # every replica new (the job's first start): no source, all take replica 0's
    assert ReplicaJob._source([(0, False, -1), (1, False, -1)]) == (None, [0, 1])
    # replica 1 completed the agreement of step 8 before the loss, replica 2 did not
    assert ReplicaJob._source([(0, False, -1), (1, True, 8), (1, True, 8), (2, True, 7),
                               (2, True, 7), (0, False, -1)]) == (1, [0, 2])
    # nothing to do: every replica whole and equal
    assert ReplicaJob._source([(0, True, 3), (1, True, 3)]) == (0, [])


def test_a_torn_replica_is_not_a_source():
    # replica 0's ranks disagree (one updated, one did not): it may not send
    with pytest.raises(ReplicaJobError, match="restart the job from its last checkpoint"):
        ReplicaJob._source([(0, True, 8), (0, True, 7), (1, False, -1), (1, False, -1)])
    # ...but another whole replica still is
    assert ReplicaJob._source([(0, True, 8), (0, True, 7), (1, True, 7), (1, True, 7),
                               (2, False, -1), (2, False, -1)]) == (1, [0, 2])


def _job(replica=0, replicas=2, shards=2, shard_rank=0):
    q = quorum.Quorum(quorum.dist.HashStore(), replica=replica, replicas=replicas,
                      shards=shards, shard_rank=shard_rank)
    return ReplicaJob(q, lambda mesh: (None, None))


def test_survivable_errors_are_other_replicas_losses():
    job = _job(replica=1)  # ranks 2 and 3 of 4
    other = PeerLost(Lost(0, "vm", 123, "its process exited"), 2)
    mine = PeerLost(Lost(3, "vm", 124, "its process exited"), 2)
    assert job.survivable(other)
    assert not job.survivable(mine)  # this replica lost a rank: it restarts as a whole
    assert job.survivable(RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by "
                                       "peer"))
    aborted = RankAborted("rank 1 failed")
    aborted.origin = 1
    assert job.survivable(aborted)
    aborted.origin = 2
    assert not job.survivable(aborted)
    assert not job.survivable(ValueError("a bug of this rank"))  # not a lost peer: raise
    assert not job.survivable(RuntimeError("shape mismatch"))


def test_recover_raises_what_it_cannot_survive_and_retries_a_failed_join():
    job = _job(replica=1)
    mine = PeerLost(Lost(3, "vm", 124, "its process exited"), 2)
    with pytest.raises(PeerLost):  # this replica lost a rank: the error stands
        job.recover((None, None), mine, {"step": 3})
    calls = []

    def join(objects, client_state):  # the first join meets another replica's loss
        calls.append(client_state)
        if len(calls) == 1:
            raise PeerLost(Lost(0, "vm", 123, "its process exited"), 2)
        return ("model", "opt"), {"step": 3}
    job.join = join
    other = PeerLost(Lost(0, "vm", 123, "its process exited"), 2)
    assert job.recover((None, None), other, {"step": 3}) == (("model", "opt"), {"step": 3})
    assert calls == [{"step": 3}, {"step": 3}]
    job.join = lambda objects, client_state: (_ for _ in ()).throw(ValueError("a bug"))
    with pytest.raises(ValueError, match="a bug"):  # not a lost peer: raised, not retried
        job.recover((None, None), other, {"step": 3})


def test_arguments_are_checked():
    store = quorum.dist.HashStore()
    with pytest.raises(ValueError, match="replicas must be >= 2"):
        quorum.Quorum(store, replica=0, replicas=1, shards=2, shard_rank=0)
    with pytest.raises(ValueError, match="replica=2 is not one of the 2 replicas"):
        quorum.Quorum(store, replica=2, replicas=2, shards=2, shard_rank=0)
    with pytest.raises(ValueError, match="shard_rank=2"):
        quorum.Quorum(store, replica=0, replicas=2, shards=2, shard_rank=2)
    with pytest.raises(TypeError, match="shards must be an int"):
        quorum.Quorum(store, replica=0, replicas=2, shards=2.0, shard_rank=0)
    with pytest.raises(TypeError, match="store must be"):
        quorum.Quorum("127.0.0.1:1", replica=0, replicas=2, shards=2, shard_rank=0)
    with pytest.raises(ValueError, match="backend"):
        quorum.Quorum(store, replica=0, replicas=2, shards=2, shard_rank=0, backend="mpi")
    with pytest.raises(ValueError, match="address must be 'host:port'"):
        quorum.connect("nohost")
    with pytest.raises(TypeError, match="build must be callable"):
        ReplicaJob(quorum.Quorum(store, replica=0, replicas=2, shards=1, shard_rank=0), 3)
    with pytest.raises(TypeError, match="quorum must be"):
        ReplicaJob(object(), lambda mesh: ())
    q = quorum.Quorum(store, replica=1, replicas=3, shards=4, shard_rank=2)
    assert (q.rank, q.world_size, q.formed()) == (6, 12, 0)


@pytest.mark.slow  # [Note: the slow mark]: three runs of 4 ranks, ~60-120 s on 2 cores
@pytest.mark.parametrize("stage", [2, 3])
def test_a_killed_replica_is_replaced_and_the_run_is_bitwise_the_uninterrupted_one(
        tmp_path, stage):
    from zerokern.bench import replica_join

    # backend="reference": this is about the ranks, not the kernels (no C++ build needed)
    r = replica_join.run(tmp_path, replicas=2, shards=2, steps=16, kill_at=6, save_every=5,
                         stage=stage, backend="reference", timeout_s=600, log=lambda m: None)
    j, rs = r["join"], r["restart"]
    assert r["reference"]["exit_codes"] == [0, 0], r["reference"]
    assert j["exit_codes"] == [0, 0], j
    assert j["kill"] is not None and j["kill"]["rank"] == 2, j["kill"]
    # the final state equals the run never killed, on both replicas
    assert j["bitwise_equal"], j["checkpoints_compared"]
    assert j["replicas_equal"], j
    # the live replica kept its processes; the victim's were started again by its torchrun
    assert j["live_ranks_never_restarted"], j
    assert all(n == 2 for n in j["victim_replica_starts"].values()), j
    # the new processes took replica 0's state mid-run: they trained on from the killed step
    # (a replica that started over would log step 1 first, and the final state would differ)
    assert all(s is not None and s > 1 for s in j["first_step_after_join"].values()), j
    live = [x for x in j["joins"] if x["rank"] in (0, 1)]
    assert live and all(x["source"] == 0 and x["receivers"] == [1] for x in live), j["joins"]
    assert j["back_s"] is not None
    # the restart from disk, for comparison, ends equal too
    assert rs["exit_codes"] == [0] and rs["final_bitwise_equal"], rs
    assert rs["resumed_from"] is not None and rs["resumed_from"] % 5 == 0, rs
