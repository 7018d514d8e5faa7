"""zerokern.checkpoint.save(..., async_save=True) (async_save.py [Note: asynchronous saves]).

In process (world size 1):
- the async checkpoint is the state at the save() call, although training goes on while it is
  written, and its files are byte for byte a synchronous save's of that state;
- a write that fails in the background (ENOSPC injected into the file writes of the writer
  thread only) reaches the caller at wait(), once; the previous checkpoint is untouched and
  still loads, training goes on unharmed, and the next save commits;
- a disk failing mid-save (ENOSPC or EIO at a file's second write, EIO at a data file's
  fsync): the error keeps its errno and carries a note naming the checkpoint; every committed
  byte is unchanged and the training state equals a run that never saved, bit for bit;
- the same failure with no wait() surfaces at the next save() instead (nothing written then);
- a process that exits without wait() commits the pending save at exit (atexit);
- the staging buffer is reused across saves (bounded: one copy of the share);
- the next opt.step() waits for the staging copy (made slow here), with a negative control
  (no step hook: the checkpoint is not the state at save()).
2 gloo ranks (one spawn, sub-cases): async saves while the main thread trains (its
collectives run while the checkpoint's agreement runs on its own group), the loads are the
saved states; one rank's background write fails -> every rank raises at wait(), the
previous checkpoint intact; the engine's save_checkpoint(async_save=True) and DeepSpeed's
`checkpoint.writer.decoupled` config, load_checkpoint without a tag.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import zerokern.checkpoint as ck
from zerokern.checkpoint import format as ck_format

from ..support import models as M
from ..support.harness import cached, case, one_thread, run_cases  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _files(d: str) -> dict:
    """Every file's bytes; meta.json without its creation time (and so its crc line)."""
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    meta = ck_format.read_meta(d)
    meta.pop("created")
    out["meta.json"] = meta
    return out


def _fresh_load(path, stage=1, precision="bf16"):
    model = M.make_model(M.MODEL_SEED + 5)
    opt = M.zero_opt(model, stage, precision, backend="reference")
    ck.load(path, model, opt)
    return model, opt


def _state(model, opt) -> dict:
    return {"params": M.snapshot(model), "opt": opt.state_dict()}


def _same_state(a: dict, b: dict) -> bool:
    if not M.bitwise_equal(a["params"], b["params"]):
        return False
    return all(M.bitwise_equal(x, y) for x, y in zip(a["opt"]["state"], b["opt"]["state"]))


def test_async_save_is_the_state_at_the_call_and_the_sync_bytes(tmp_path):
    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16", backend="reference")
    M.train_zero(model, opt, 0, 1, 2)
    want = _state(model, opt)
    ck.save(str(tmp_path / "sync"), model, opt)
    handle = ck.save(str(tmp_path / "async"), model, opt, async_save=True)
    M.train_zero(model, opt, 0, 1, 2, start=2)  # training goes on while it is written
    assert handle.wait() == str(tmp_path / "async")
    assert handle.done()
    assert _same_state(_state(*_fresh_load(str(tmp_path / "async"))), want)
    assert _files(str(tmp_path / "async")) == _files(str(tmp_path / "sync"))
    handle.close()  # idempotent after wait
    ck.wait()  # nothing pending: returns at once


@pytest.mark.parametrize("hook", [True, False], ids=["step_waits", "negative_control"])
def test_next_step_waits_for_the_staging_copy(tmp_path, hook, monkeypatch):
    """The copy runs in the writer thread (here made slow); the next opt.step() waits for it.
    Negative control: without the step pre-hook, the step changes the state mid-copy and the
    checkpoint is not the state at save()."""
    from zerokern.checkpoint import async_save

    real = async_save._stage_big

    def slow(job, carve, events):
        time.sleep(0.5)
        return real(job, carve, events)

    monkeypatch.setattr(async_save, "_stage_big", slow)
    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16", backend="reference")
    M.train_zero(model, opt, 0, 1, 1)
    want = _state(model, opt)
    if not hook:
        monkeypatch.setattr(opt, "register_step_pre_hook", lambda fn: None)
    h = ck.save(str(tmp_path / "ck"), model, opt, async_save=True)
    M.train_zero(model, opt, 0, 1, 1, start=1)
    h.wait()
    got = _state(*_fresh_load(str(tmp_path / "ck")))
    assert _same_state(got, want) == hook
    assert (h.stall_s > 0.2) == hook


def _enospc_in_writer_thread():
    """DataFile.write that fails with ENOSPC in any thread but the main one."""
    real = ck_format.DataFile.write

    def write(self, t):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, t)
    return mock.patch.object(ck_format.DataFile, "write", write)


@pytest.mark.parametrize("where", ["wait", "next_save"])
def test_background_enospc_is_raised_once_and_keeps_the_previous_checkpoint(tmp_path, where):
    path = str(tmp_path / "ck")
    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16", backend="reference")
    M.train_zero(model, opt, 0, 1, 1)
    ck.save(path, model, opt)
    first = _state(model, opt)
    with open(os.path.join(path, "meta.json"), "rb") as f:
        meta_before = f.read()
    M.train_zero(model, opt, 0, 1, 1, start=1)
    with _enospc_in_writer_thread():
        handle = ck.save(path, model, opt, async_save=True)
        M.train_zero(model, opt, 0, 1, 1, start=2)  # training is unharmed meanwhile
        if where == "wait":
            with pytest.raises(OSError, match="No space left") as ei:
                handle.wait()
            handle.wait()  # raised once: the caller has handled it
        else:
            with pytest.raises(OSError, match="No space left") as ei:
                ck.save(path, model, opt, async_save=True)
    assert ei.value.errno == errno.ENOSPC
    with open(os.path.join(path, "meta.json"), "rb") as f:
        assert f.read() == meta_before  # nothing committed was touched
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the failed save's tmp dir is gone
    assert _same_state(_state(*_fresh_load(path)), first)
    M.train_zero(model, opt, 0, 1, 1, start=3)  # training goes on
    now = _state(model, opt)
    ck.save(path, model, opt, async_save=True).wait()
    assert _same_state(_state(*_fresh_load(path)), now)


class _DiskFails:
    """A disk failing in the writer thread only, mid-save: the `nth` DataFile.write (bytes of
    the file already written before it) or the fsync of a data file, with errno `code`."""

    def __init__(self, code: int, where: str, nth: int = 2) -> None:
        self.code, self.where, self.nth, self.calls = code, where, nth, 0

    def _fail(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.calls += 1
            if self.calls >= self.nth:
                raise OSError(self.code, os.strerror(self.code))

    def __enter__(self):
        if self.where == "write":
            real = ck_format.DataFile.write

            def write(df, t):
                self._fail()
                return real(df, t)
            self._patch = mock.patch.object(ck_format.DataFile, "write", write)
        else:
            real = os.fsync

            def fsync(fd):
                self._fail()
                return real(fd)
            self._patch = mock.patch.object(ck_format.os, "fsync", fsync)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


def _all_bytes(d) -> dict:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("code,where", [(errno.ENOSPC, "write"), (errno.EIO, "write"),
                                        (errno.EIO, "fsync")], ids=["ENOSPC-write",
                                                                    "EIO-write", "EIO-fsync"])
def test_a_disk_failing_mid_save_is_a_clear_error_and_harms_nothing(tmp_path, code, where):
    """Issue 39 (a disk that fails): the error reaches the caller at wait() with its errno and
    a note naming the checkpoint and saying nothing was committed (on the code before it, a
    bare OSError naming no file: the note check fails there); every committed byte is
    unchanged; the training state equals, bit for bit, a run that never saved."""
    path = str(tmp_path / "ck")
    ref_model = M.make_model()
    ref_opt = M.zero_opt(ref_model, 1, "bf16", backend="reference")
    M.train_zero(ref_model, ref_opt, 0, 1, 3)  # never saved
    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16", backend="reference")
    M.train_zero(model, opt, 0, 1, 1)
    ck.save(path, model, opt)
    committed = _all_bytes(path)
    M.train_zero(model, opt, 0, 1, 1, start=1)
    with _DiskFails(code, where) as disk:
        handle = ck.save(path, model, opt, async_save=True)
        M.train_zero(model, opt, 0, 1, 1, start=2)
        with pytest.raises(OSError) as ei:
            handle.wait()
    assert disk.calls >= 2  # it failed in the middle: something was written before
    assert ei.value.errno == code
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert f"asynchronous save to {path} failed" in notes, notes
    assert errno.errorcode[code] in notes and "Nothing of it was committed" in notes, notes
    assert _all_bytes(path) == committed  # nothing committed was touched
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the failed save's tmp dir is gone
    assert _same_state(_state(model, opt), _state(ref_model, ref_opt))  # training unharmed


def test_staging_buffer_is_reused_across_saves(tmp_path):
    from zerokern.checkpoint import async_save

    model = M.make_model()
    opt = M.zero_opt(model, 1, "bf16", backend="reference")
    ck.save(str(tmp_path / "a"), model, opt, async_save=True).wait()
    buf = async_save.staging_buffer()
    M.train_zero(model, opt, 0, 1, 1)
    ck.save(str(tmp_path / "b"), model, opt, async_save=True).wait()
    again = async_save.staging_buffer()
    assert again.data_ptr() == buf.data_ptr() and again.numel() == buf.numel()
    # bounded: one copy of this rank's share (fp32 master + 2 moments) plus the extras
    state = sum(4 * 3 * p.numel() for p in {id(p): p for p in model.parameters()
                                            if p.requires_grad}.values())
    assert state <= buf.numel() <= state + 64 * 1024


_EXIT_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
torch.set_num_threads(1)
import zerokern.checkpoint as ck
from tests.support import models as M
model = M.make_model()
opt = M.zero_opt(model, 1, "bf16", backend="reference")
M.train_zero(model, opt, 0, 1, 1)
ck.save(sys.argv[1], model, opt, async_save=True)
print("EXITING", flush=True)
"""


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
def test_exit_without_wait_commits_the_pending_save(tmp_path):
    path = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _EXIT_CHILD, path, REPO], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "EXITING" in out.stdout
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    ck.verify(path)


# ---- 2 gloo ranks --------------------------------------------------------------------------------
def _two_rank_worker(rank, ws, root):
    def train_while_saving():
        model = M.make_model()
        opt = M.zero_opt(model, 2, "fp32", backend="reference")
        M.train_zero(model, opt, rank, ws, 2)
        snap = M.full_snapshot(model, opt)
        handle = ck.save(os.path.join(root, "a"), model, opt, async_save=True)
        M.train_zero(model, opt, rank, ws, 3, start=2)  # collectives on the main thread
        handle.wait()
        model2 = M.make_model(M.MODEL_SEED + 3)
        opt2 = M.zero_opt(model2, 1, "fp32", backend="reference")
        ck.load(os.path.join(root, "a"), model2, opt2)
        return M.bitwise_equal(M.full_snapshot(model2, opt2), snap)

    def one_rank_fails():
        model = M.make_model()
        opt = M.zero_opt(model, 2, "fp32", backend="reference")
        M.train_zero(model, opt, rank, ws, 1)
        d = os.path.join(root, "b")
        ck.save(d, model, opt)
        with open(os.path.join(d, "meta.json"), "rb") as f:
            before = f.read()
        M.train_zero(model, opt, rank, ws, 1, start=1)
        patch = _enospc_in_writer_thread() if rank == 1 else mock.patch.dict({})
        with patch:
            handle = ck.save(d, model, opt, async_save=True)
            M.train_zero(model, opt, rank, ws, 1, start=2)
            try:
                handle.wait()
                err = None
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        dist.barrier()
        with open(os.path.join(d, "meta.json"), "rb") as f:
            same = f.read() == before
        left = sorted(s for s in os.listdir(root) if s.startswith("b"))
        return {"error": err, "unchanged": same, "left": left}

    def engine_async_and_latest():
        import zerokern

        from ..engine import common as E

        E.launcher_env(rank)
        cfg = E.base_config(2, gas=1)
        cfg["checkpoint"] = {"writer": {"decoupled": True}}
        torch.manual_seed(0)
        model = E.gpt2()
        engine, *_ = zerokern.initialize(model=model, config=cfg)
        d = os.path.join(root, "engine")
        for step in range(3):
            loss = engine(E.tokens(step, 0, rank), labels=E.tokens(step, 0, rank)).loss
            engine.backward(loss)
            engine.step()
            if step == 1:
                snap = {k: v.clone() for k, v in engine.module.state_dict().items()}
                engine.save_checkpoint(d, client_state={"at": step})  # decoupled: async
        ck.wait()
        with open(os.path.join(d, "latest")) as f:
            tag = f.read().strip()
        engine.load_checkpoint(d)  # no tag: `latest`
        same = all(torch.equal(v, snap[k]) for k, v in engine.module.state_dict().items())
        # `latest` pointing at a corrupt checkpoint: the scan finds the newest complete one
        engine.save_checkpoint(d, tag="bad", async_save=False)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(d, "bad", "zero", "meta.json"), "r+b") as f:
                f.seek(10)
                f.write(b"#")
        dist.barrier()
        import warnings

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            path, client = engine.load_checkpoint(d)
        return {"tag": tag, "same": same, "fallback": os.path.basename(path), "client": client,
                "warned": any("bad" in str(x.message) for x in w)}

    return run_cases({"train_while_saving": train_while_saving,
                      "one_rank_fails": one_rank_fails,
                      "engine_async_and_latest": engine_async_and_latest})


def _two(tmp_path_factory_root):
    return cached(_two_rank_worker, 2, tmp_path_factory_root)


@pytest.fixture(scope="module")
def two_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("async2"))


def test_two_ranks_async_save_while_training(two_root):
    assert case(_two(two_root), "train_while_saving") == [True, True]


def test_two_ranks_one_background_failure_raises_everywhere(two_root):
    res = case(_two(two_root), "one_rank_fails")
    for r in res:
        assert r["error"] is not None and "No space left" in r["error"], res
        assert r["unchanged"] and r["left"] == ["b"], res


def test_engine_decoupled_save_and_load_latest(two_root):
    res = case(_two(two_root), "engine_async_and_latest")
    for r in res:
        assert r["tag"] == "global_step2" and r["same"], res
        assert r["fallback"] == "global_step2" and r["client"] == {"at": 1}, res
        assert r["warned"], res
