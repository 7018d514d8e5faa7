"""Checkpoint agreement under load ([Note: timeouts under load], docs/troubleshooting.md).

Every step of save and load that can fail on one rank ends in an all-ranks agreement
(checkpoint/collective.py). A rank that is slow there (still writing its files on a busy node)
and comes after the process group's timeout made the others fail with gloo's bare "Timed out
waiting 2000ms for recv operation to complete". Now they raise CollectiveTimeout, which says
what it waited for, how long, and the setting to raise; with that setting raised the same slow
rank is waited for, and a real save and load of a model goes through.
"""

from __future__ import annotations

import time

import pytest
import torch

from zerokern.tools import spawn as zk_spawn

# the setting by name (a literal: this file also runs against the code before it)
PG_TIMEOUT_ENV = "ZEROKERN_PG_TIMEOUT_S"

from ..support.harness import _CTX

SHORT, LATE = 2.0, 5.0


def _slow_agree(rank, ws):
    import torch.distributed as dist

    from zerokern.checkpoint.collective import Collective

    c = Collective(None, rank, ws)
    c.agree(None)  # both here: the group is up
    if rank == 1:
        time.sleep(LATE)
    try:
        c.agree(None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return None, dist.get_world_size()


def _run(fn, *args):
    return zk_spawn.spawn_ranks(fn, 2, *args, threads=1, timeout=120, grace=30,
                                pg_timeout=SHORT, context=_CTX)


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_a_slow_rank_in_the_agreement_raises_the_named_timeout(monkeypatch):
    monkeypatch.delenv(PG_TIMEOUT_ENV, raising=False)
    (typ, msg), _ = _run(_slow_agree)
    assert typ == "CollectiveTimeout", (typ, msg)
    assert f"timed out after {SHORT:.0f} s" in msg and "checkpoint" in msg, msg
    assert PG_TIMEOUT_ENV in msg and "init_process_group" in msg, msg


@pytest.mark.slow  # [Note: the slow mark]: waits 5 s by design
def test_with_the_setting_raised_the_slow_rank_is_waited_for(monkeypatch):
    monkeypatch.setenv(PG_TIMEOUT_ENV, "60")
    assert _run(_slow_agree) == [(None, 2), (None, 2)]


def _slow_save(rank, ws, path):
    import zerokern as zk
    from zerokern import checkpoint
    from zerokern.checkpoint import writer

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = zk.ZeroAdamW(model, stage=2, precision="fp32", lr=1e-2)
    model(torch.ones(4, 16)).sum().backward()
    opt.step()
    if rank == 1:  # this rank's files take LATE s longer than the peer's wait
        real = writer._pause
        writer._pause = lambda point: time.sleep(LATE) if point == "files_written" else real(point)
    checkpoint.save(path, model, opt)
    want = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpoint.load(path, model, opt)
    return all(torch.equal(a, b) for a, b in zip(want, model.parameters()))


@pytest.mark.slow  # [Note: the slow mark]: waits 5 s by design
def test_a_save_with_one_slow_rank_goes_through_with_the_setting_raised(monkeypatch, tmp_path):
    monkeypatch.setenv(PG_TIMEOUT_ENV, "60")
    assert _run(_slow_save, str(tmp_path / "ck")) == [True, True]
