"""The chaos run, short (issue 39): `zerokern train` under `torchrun --max-restarts`, two ranks
SIGKILLed (one while a checkpoint is being written), ends bitwise equal to an uninterrupted run.

zerokern/bench/chaos.py [Note: the chaos run]: 40 steps of GPT tiny on 2 gloo ranks,
--save-every 10 (async saves), --resume auto; 2 kills by the supervisor, the seed fixed here.
Checks: torchrun's exit code 0 (every kill survived within --max-restarts), the final
checkpoint and every one both runs committed byte-equal (consolidated params, each rank's
shard of the masters and optimizer states), each attempt resumed from a committed checkpoint
(steps recomputed <= 2 save intervals: an async save still writing when the rank died is not
committed), and every survivor raised PeerLost naming the rank and exited on its own within seconds
(torchrun's monitor at 10 s, so that it seldom stops them first).

On the code before this test (see the commit): the restarted attempt's liveness read the dead
ranks' pids left in torchrun's shared store and raised PeerLost at once, and gloo's rendezvous
could read a dead rank's address; the job used up its restarts and failed (exit 1).
About 40-80 s on the 2-core VM (reference 8 s, chaos run 25-35 s when idle).
"""

from __future__ import annotations

import pytest

from zerokern.bench import chaos

SEED = 1  # draws a mid-save kill first, then a random one (rank 0 both times)
SAVE_EVERY = 10


def _check_run(r: dict, kinds: list, steps: int = 40) -> None:
    """The checks every chaos run passes: exit 0, every kill of `kinds` survived, the final and
    every committed checkpoint bitwise the uninterrupted run's, each attempt resumed from a
    committed checkpoint with at most 2 save intervals recomputed."""
    log = open(r["log"]).read()[-4000:]
    assert r["exit_code"] == 0, log
    assert r["kills_survived"] == len(kinds) and len(r["kills"]) == len(kinds), r["kills"]
    assert sorted(k["kind"] for k in r["kills"]) == sorted(kinds)
    assert r["final_bitwise_equal"], r["checkpoints_compared"]
    assert r["bytes_lost"] == 0
    assert f"step{steps:08d}" in r["checkpoints_compared"]
    for k in r["kills"]:
        assert k["resumed_from"] is not None and k["resumed_from"] % SAVE_EVERY == 0, k
        assert 0 <= k["recomputed"] <= 2 * SAVE_EVERY, k


@pytest.mark.slow  # [Note: the slow mark] (pyproject.toml): two torchrun jobs, 30-60 s
def test_killed_ranks_restart_and_end_bitwise_the_uninterrupted_run(tmp_path):
    r = chaos.run_chaos(tmp_path, steps=40, save_every=SAVE_EVERY, kills=2, seed=SEED,
                        seq=64, batch=8, timeout_s=300, log=lambda m: None)
    _check_run(r, ["mid-save", "random"])
    for k in r["kills"]:
        if k["kind"] == "mid-save":  # nothing of the save in flight was committed
            assert k["resumed_from"] < int(k["saving"].rsplit("step", 1)[1][:8]), k
    # every survivor named the lost rank (PeerLost) and exited on its own, far below the
    # 120 s process group timeout (measured: PeerLost 0.02-0.54 s after the kill, exit 0.04 s
    # later); or torchrun's poll (every 10 s, chaos.MONITOR_S) fell in between and stopped
    # it: then within that poll. Not both kills so: one survivor at least is measured.
    own = 0
    for k in r["kills"]:
        for rank, exit_s in k["exit_s"].items():
            if int(rank) in k["sigtermed"]:
                assert exit_s is not None and exit_s < chaos.MONITOR_S + 2, k
                continue
            own += 1
            assert k["detect_s"][rank] is not None and k["detect_s"][rank] < 3.0, k
            assert exit_s is not None and exit_s < 4.0, k
    assert own >= 1, r["kills"]


@pytest.mark.slow  # [Note: the slow mark]: four torchrun jobs, 2-4 min on the 2-core VM
def test_a_restart_at_three_ranks_keeps_the_global_batch_and_is_bitwise_its_own_run(tmp_path):
    """[Note: a restart at another world size] (zerokern/bench/chaos.py): a kill ends the 2-rank
    job, a 3-rank job resumes (resharded) with the global batch kept by the accumulation (3
    micro-batches of 8 per rank on 2 ranks, 2 on 3). The checkpoints before the resize equal
    the 2-rank reference's bit for bit; those after it equal an uninterrupted 3-rank run's from
    that checkpoint bit for bit; the final params differ from the 2-rank reference's (the sums'
    order differs: not bitwise) by far less than a wrong load would (bf16 model: 0.025 at most
    measured, as Adam's normalised update turns the reordering's rounding into up to lr per
    step; a load of other state differs by O(1)). On the code before it, run_chaos had no
    resize_to (and nothing compared a run at the new size with its own uninterrupted run)."""
    r = chaos.run_chaos(tmp_path, steps=40, save_every=SAVE_EVERY, kills=2, seed=SEED,
                        seq=64, batch=8, timeout_s=600, log=lambda m: None, resize_to=3,
                        global_batch=48)
    log = open(r["log"]).read()[-4000:]
    assert r["exit_code"] == 0, log
    assert r["job_exit_codes"][0] != 0  # the first job ended with its last kill
    assert r["kills_survived"] == 2, r["kills"]
    z = r["resize"]
    assert z is not None, r
    assert z["global_batch_kept_logged"], z
    assert (z["micro_batches_before"], z["micro_batches_after"]) == (3, 2), z
    assert z["before_checkpoints"] >= 1 and z["before_bytes_differ"] == 0, z
    assert z["after_bitwise_equal"] and z["after_bytes_differ"] == 0, z
    assert z["loss_curve_equals_new_size_run"], z
    assert r["final_bitwise_equal"] and r["bytes_lost"] == 0, r["checkpoints_compared"]
    assert 0 < z["final_max_abs_diff_vs_reference"] < 0.1, z
    assert [k["nproc"] for k in r["kills"] if k["ends_job"]] == [2]


@pytest.mark.slow  # [Note: the slow mark]: two torchrun jobs, 1-2 min on the 2-core VM
def test_a_kill_mid_nvme_write_and_mid_save_end_bitwise_the_uninterrupted_run(tmp_path):
    """[Note: a mid-write kill] (zerokern/bench/chaos.py): `zerokern train --offload nvme`
    (each rank's master and moments in files under the save dir), 3 kills: mid-save, mid-write
    (the victim SIGKILLs itself in an NVMe state write of a step, on the supervisor's request:
    train/chaos_kill.py) and random. The final checkpoint and every one both runs committed
    equal an uninterrupted nvme run's bit for bit; the attempt after the mid-write kill resumed
    from a committed checkpoint (the torn step's half was never committed, and the files are
    scratch), with at most 2 save intervals recomputed; no killed rank's state files are left
    (a restarted rank removes its dead predecessor's). On the code before it, `zerokern train`
    had no --offload nvme (and run_chaos no offload=): the test cannot run there."""
    r = chaos.run_chaos(tmp_path, steps=40, save_every=SAVE_EVERY, kills=3, seed=SEED,
                        seq=64, batch=8, timeout_s=600, log=lambda m: None, offload="nvme")
    _check_run(r, ["mid-save", "mid-write", "random"])
    (w,) = [k for k in r["kills"] if k["kind"] == "mid-write"]
    assert "offset" in w["writing"] and w["writing"].endswith(")"), w
    # the step being written when it died is past the checkpoint the next attempt resumed from
    assert w["resumed_from"] < int(w["writing"].rsplit("step ", 1)[1].rstrip(")")), w
    assert r["nvme_files_left"] == [], r["nvme_files_left"]
    for k in r["kills"]:  # every survivor learned of the death (or torchrun stopped it)
        for rank, exit_s in k["exit_s"].items():
            assert exit_s is not None, k
            if int(rank) not in k["sigtermed"]:
                assert k["detect_s"][rank] is not None and k["detect_s"][rank] < 3.0, k
