"""offload="nvme" (ZeRO-Infinity's optimizer half) at stages 1-3, world sizes 1-3, gloo ranks.

master/m/v live in files under a temporary offload_path and stream through the I/O pool each
step. Small chunks (1024 elements, the smallest O_DIRECT-aligned one) make every buffer many
chunks, and chunks straddle the tiny buckets' pieces; the `big` cases use larger buckets so a
piece spans several chunks too.

Tolerances: the same cpu kernel runs on the same elements with the same scalars as without
offload and as offload="cpu", so params, masters and moments must agree *bitwise*.
"""

from __future__ import annotations

import errno
import functools
import gc
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

import zerokern as zk
from zerokern.accounting import estimate as E

from ..optimizer import test_overflow as OV
from ..support import models as M
from ..support.harness import cached, case, run_cases

STEPS = 4
CHUNK = 1024
# [Note: the slow mark] (pyproject.toml): the largest world runs in CI's -m slow pass
# N=2 in the default suite (the smallest world with shards); N=1 and 3 in the slow pass
WORLD_SIZES = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)]
STAGES = [1, 2, 3]
PRECISIONS = ["fp32", "bf16", "fp16"]


def _nvme_opt(model, stage, prec, path, chunk=CHUNK, **kw):
    opt = M.zero_opt(model, stage, prec, offload="nvme", offload_path=path, **kw)
    opt.offloader.configure(chunk_numel=chunk, queue_depth=3)
    return opt


def _states(opt, model, prec):
    return {k: M.gather_state(opt, model, k) for k in ("master", "exp_avg", "exp_avg_sq")
            if prec != "fp32" or k != "master"}


def _parity(rank, ws, stage, prec, big=False, micro=1):
    """None, "cpu" and "nvme" runs of the same training: params and state bitwise equal."""
    kw = {"max_grad_norm": 0.05}  # clipping active (the grads' norm is larger)
    if big:
        kw["bucket_mb"] = 0.05  # ~25k-element buckets: a piece spans several 1024-chunks
    runs = {}
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        for off in (None, "cpu", "nvme"):
            model = M.make_model()
            opt = (_nvme_opt(model, stage, prec, d, **kw) if off == "nvme" else
                   M.zero_opt(model, stage, prec, offload=off, **kw))
            rec = M.train_zero(model, opt, rank, ws, STEPS, micro=micro)
            runs[off] = (model, opt, rec, _states(opt, model, prec))
        m2, o2, r2, s2 = runs["nvme"]
        pieces = [g.layout.piece_numel(k) for g in o2.flat_groups
                  for k in range(g.layout.n_buckets)]
        out = {"moved": M.rel_err(r2["params"][-1], M.snapshot(M.make_model())),
               "chunks_per_piece_max": max(-(-n // o2.offloader.chunk) for n in pieces),
               "chunks": sum(-(-f.n // o2.offloader.chunk) for f in o2.offloader.files),
               "n_files": len(os.listdir(d)), "direct": o2.offloader.direct}
        for ref in (None, "cpu"):
            _, _, r, s = runs[ref]
            out[f"params_{ref}"] = all(M.bitwise_equal(a, b)
                                       for a, b in zip(r2["params"], r["params"]))
            out[f"state_{ref}"] = all(M.bitwise_equal(s2[k], s[k]) for k in s)
            out[f"norm_{ref}"] = r2["grad_norm"] == r["grad_norm"]
            out[f"skipped_{ref}"] = r2["skipped"] == r["skipped"]
        o2.close()
        out["n_files_after_close"] = len(os.listdir(d))
    return out


def _resume(rank, ws, stage):
    """zerokern.checkpoint save/load with NVMe state, and resharding to and from no offload."""
    prec = "bf16"
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        ck = os.path.join(d, "ck")
        # every rank needs the same checkpoint path: rank 0's dir name goes to all
        obj = [ck]
        torch.distributed.broadcast_object_list(obj, src=0)
        ck = obj[0] + f"-s{stage}"
        model = M.make_model()
        full = M.train_zero(model, _nvme_opt(model, stage, prec, d), rank, ws, STEPS)
        model1 = M.make_model()
        opt1 = _nvme_opt(model1, stage, prec, d)
        M.train_zero(model1, opt1, rank, ws, 2)
        zk.checkpoint.save(ck, model1, opt1)
        sd = opt1.state_dict()
        out = {}
        for off in ("nvme", None):  # the NVMe checkpoint into NVMe and into no offload
            model2 = M.make_model()
            opt2 = (_nvme_opt(model2, stage, prec, d) if off else M.zero_opt(model2, stage, prec))
            zk.checkpoint.load(ck, model2, opt2)
            rec = M.train_zero(model2, opt2, rank, ws, STEPS - 2, start=2)
            out[f"ckpt_{off}"] = M.bitwise_equal(rec["params"][-1], full["params"][-1])
        # a checkpoint of a run without offload, loaded into NVMe
        model3 = M.make_model()
        opt3 = M.zero_opt(model3, stage, prec)
        M.train_zero(model3, opt3, rank, ws, 2)
        ck3 = ck + "-plain"
        zk.checkpoint.save(ck3, model3, opt3)
        model4 = M.make_model()
        opt4 = _nvme_opt(model4, stage, prec, d)
        zk.checkpoint.load(ck3, model4, opt4)
        rec = M.train_zero(model4, opt4, rank, ws, STEPS - 2, start=2)
        out["ckpt_from_plain"] = M.bitwise_equal(rec["params"][-1], full["params"][-1])
        ref = M.full_snapshot(model1, opt1)  # (collective at stage 3)
        if rank == 0:
            cons = zk.checkpoint.consolidate(ck)
            out["consolidate"] = all(torch.equal(cons[n].to(torch.bfloat16), ref[n])
                                     for n in M.trainable_names(model1))
        # state_dict / load_state_dict of the same layout
        model5 = M.make_model()
        opt5 = _nvme_opt(model5, stage, prec, d)
        opt5.load_state_dict(sd)
        if stage != 3:
            params = M.full_snapshot(model1, opt1)
            for n, p in model5.named_parameters():
                p.data.copy_(params[n])
        rec = M.train_zero(model5, opt5, rank, ws, STEPS - 2, start=2)
        out["state_dict"] = M.bitwise_equal(rec["params"][-1], full["params"][-1])
    return out


def _snapshot(opt, model):
    return {"params": M.full_snapshot(model, opt),
            "state": {k: M.gather_state(opt, model, k) for k in ("master", "exp_avg",
                                                                 "exp_avg_sq")},
            "steps": [g.steps.clone() for g in opt.flat_groups],
            "scale": float(opt.loss_scale)}


def _same(a, b):
    return (M.bitwise_equal(a["params"], b["params"])
            and all(M.bitwise_equal(a["state"][k], b["state"][k]) for k in a["state"])
            and all(torch.equal(x, y) for x, y in zip(a["steps"], b["steps"]))
            and a["scale"] == b["scale"])


def _fault(rank, ws, stage, kind):
    """ENOSPC injected into the writer (on the last rank, at its 3rd write), or a truncated
    state file: every rank raises, nothing changes; the step then succeeds when retried.
    bf16: an fp16 run's step may overflow at the dynamic scale's start and be skipped (no I/O)."""
    prec = "bf16"
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        model0 = M.make_model()
        ref = M.train_zero(model0, _nvme_opt(model0, stage, prec, d), rank, ws, STEPS)
        model = M.make_model()
        opt = _nvme_opt(model, stage, prec, d)
        M.train_zero(model, opt, rank, ws, 2)
        before = _snapshot(opt, model)
        off = opt.offloader
        victim = rank == ws - 1
        target = off.files[0].paths[2]
        saved = None
        if victim and kind == "enospc":
            count = [0]

            def fault(path, offset):
                count[0] += 1
                if count[0] == 3:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            off.fault_hook = fault
        elif victim:  # truncate v of the first buffer to half a chunk
            with open(target, "rb") as fh:
                saved = fh.read()
            os.truncate(target, 2048)
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(2, rank, ws)))
        error = None
        try:
            opt.step()
        except (OSError, RuntimeError) as e:
            error = (type(e).__name__, str(e))
        off.fault_hook = None
        if saved is not None:  # put the file back (its mmap view past the truncation would
            with open(target, "r+b") as fh:  # fault), then look at the state and retry
                fh.write(saved)
        after = _snapshot(opt, model)
        opt.step()  # the same grads: the step that failed, now completing
        rec = M.train_zero(model, opt, rank, ws, STEPS - 3, start=3)
        return {"error": error, "victim": victim, "target": target,
                "unchanged": _same(before, after),
                "retry_bitwise": M.bitwise_equal(rec["params"][-1], ref["params"][-1])}


def _memory(rank, ws, stage, prec):
    """memory_report's device, host (pinned/pageable) and disk bytes equal the estimate."""
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        torch.manual_seed(1234)
        model = M.make_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            opt = zk.ZeroAdamW(model, stage=stage, precision=prec, bucket_mb=M.BUCKET_MB,
                               offload="nvme", offload_path=d, backend="cpu")
        for step in range(2):
            M.loss_fn(model, M.rank_tokens(step, rank, ws)).backward()
            opt.step()
            opt.zero_grad()
        rep = opt.memory_report()
        with torch.device("meta"):
            spec = E.spec_from_model(M.make_model(), "tiny-lm")
        est = E.estimate(spec, ws, stage, prec, M.BUCKET_MB, "nvme", rank, "gloo")
        files = sum(os.path.getsize(p) for p in opt.offloader.paths())
        return {"measured": rep["measured"], "est_bytes": est["bytes"],
                "host": rep["host_measured"], "est_host": est["host"],
                "pageable": rep["host_pageable_total"], "est_pageable": est["host_pageable"],
                "pinned": rep["host_pinned_total"], "est_pinned": est["host_pinned"],
                "disk": rep["disk_measured"], "est_disk": est["disk"], "files": files,
                "disk_formula": rep["disk_formula_total"], "disk_total": rep["disk_measured_total"],
                "padding_bound": sum(g.layout.padding for g in opt.flat_groups) * 4 * 3 * 2
                + 3 * 2 * 4096 * len(opt.flat_groups)}


def _gc(rank, ws):
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        model = M.make_model()
        opt = _nvme_opt(model, 2, "bf16", d)
        M.train_zero(model, opt, rank, ws, 1)
        n = len(os.listdir(d))
        del opt
        gc.collect()
        return {"before": n, "after": len(os.listdir(d))}


def _worker(rank, ws):
    cases = {}
    for stage in STAGES:
        for prec in PRECISIONS:
            cases[f"parity_{stage}_{prec}"] = functools.partial(_parity, rank, ws, stage, prec)
        cases[f"big_{stage}"] = functools.partial(_parity, rank, ws, stage, "bf16", big=True)
        cases[f"accum_{stage}"] = functools.partial(_parity, rank, ws, stage, "bf16", micro=2)
        cases[f"resume_{stage}"] = functools.partial(_resume, rank, ws, stage)
        for kind in ("enospc", "truncate"):
            cases[f"{kind}_{stage}"] = functools.partial(_fault, rank, ws, stage, kind)
        for kind in ("fp16_dynamic", "bf16"):
            cases[f"overflow_{stage}_{kind}"] = functools.partial(
                _overflow, rank, ws, kind, stage)
        for prec in ("fp32", "bf16"):
            cases[f"memory_{stage}_{prec}"] = functools.partial(_memory, rank, ws, stage, prec)
    cases["gc"] = functools.partial(_gc, rank, ws)
    return run_cases(cases)


def _overflow(rank, ws, kind, stage):
    with tempfile.TemporaryDirectory(prefix="zk_nvme_") as d:
        return OV._case(rank, ws, kind, stage, offload="nvme", offload_path=d)


def _results(ws):
    return cached(_worker, ws)


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_parity_with_no_offload_and_cpu_offload(ws, stage, prec):
    for r, res in enumerate(case(_results(ws), f"parity_{stage}_{prec}")):
        assert res["moved"] > 1e-4, "training must move the params"
        assert res["chunks"] >= 4, "every buffer must run several chunks"
        for ref in (None, "cpu"):
            assert res[f"params_{ref}"], f"rank {r}: params differ from offload={ref}"
            assert res[f"state_{ref}"], f"rank {r}: master/m/v differ from offload={ref}"
            assert res[f"norm_{ref}"] and res[f"skipped_{ref}"]
        assert res["n_files"] > 0 and res["n_files_after_close"] == 0


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("what", ["big", "accum"])
def test_many_chunks_per_piece_and_accumulation(ws, stage, what):
    for r, res in enumerate(case(_results(ws), f"{what}_{stage}")):
        if what == "big":
            assert res["chunks_per_piece_max"] >= 2, "a piece must span several chunks"
        assert res["params_None"] and res["state_None"], f"rank {r}"
        assert res["params_cpu"] and res["state_cpu"], f"rank {r}"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["fp16_dynamic", "bf16"])
def test_overflow_skip(ws, stage, kind):
    for r, res in enumerate(case(_results(ws), f"overflow_{stage}_{kind}")):
        assert res["skipped"], f"rank {r}: not skipped"
        for what, same in res["unchanged"].items():
            assert same, f"rank {r}: the skipped step changed {what}"
        if kind == "fp16_dynamic":
            assert res["scale_after"] == 0.5 * res["scale_before"]
        else:
            assert res["same_as_without_bad_step"]
        assert res["clean_moved"] and not any(res["clean_skipped"])


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_resume_and_reshard(ws, stage):
    for r, res in enumerate(case(_results(ws), f"resume_{stage}")):
        for k, v in res.items():
            assert v, f"rank {r}: {k}"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["enospc", "truncate"])
def test_io_failure_leaves_state_unchanged(ws, stage, kind):
    for r, res in enumerate(case(_results(ws), f"{kind}_{stage}")):
        assert res["error"] is not None, f"rank {r}: the step must raise"
        name, msg = res["error"]
        if res["victim"]:
            assert name == "OSError" and "rolled back" in msg, msg
            if kind == "enospc":
                assert "No space left" in msg and ".bin" in msg, msg
            else:
                assert res["target"] in msg and "truncated" in msg, msg
        else:
            assert name == "RuntimeError" and "another rank" in msg, msg
        assert res["unchanged"], f"rank {r}: the failed step changed the state"
        assert res["retry_bitwise"], f"rank {r}: the retried step differs"


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_memory_device_host_disk_equal_the_estimate(ws, stage, prec):
    for r, res in enumerate(case(_results(ws), f"memory_{stage}_{prec}")):
        assert res["measured"] == res["est_bytes"], f"rank {r}: device"
        assert res["measured"]["master"] == res["measured"]["exp_avg"] == 0
        assert res["host"] == res["est_host"], f"rank {r}: host"
        assert res["pageable"] == res["est_pageable"] == sum(res["host"].values())
        assert res["pinned"] == res["est_pinned"] == 0
        assert res["disk"] == res["est_disk"], f"rank {r}: disk"
        assert res["files"] == res["disk_total"], "disk bytes are the files' sizes"
        assert 0 <= res["disk_total"] - res["disk_formula"] <= res["padding_bound"]


@pytest.mark.parametrize("ws", [2])
def test_files_removed_at_gc(ws):
    for res in case(_results(ws), "gc"):
        assert res["before"] == 6 and res["after"] == 0  # 2 param groups x master/m/v


@pytest.mark.slow  # [Note: the slow mark]: 10 s (a subprocess); removal at GC stays default
def test_files_removed_at_exit(tmp_path):
    # The process exits without close(); a forked child exiting first (sys.exit runs atexit)
    # must leave the parent's files alone.
    code = ("import sys; sys.path.insert(0, sys.argv[2]); from tests.support import models as M\n"
            "m = M.make_model(); o = M.zero_opt(m, 1, 'bf16', offload='nvme', "
            "offload_path=sys.argv[1])\nimport os; assert len(os.listdir(sys.argv[1])) == 6\n"
            "pid = os.fork()\nif pid == 0:\n    sys.exit(0)\nos.waitpid(pid, 0)\n"
            "assert len(os.listdir(sys.argv[1])) == 6, 'the child removed the files'\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code, str(tmp_path), root], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": root})
    assert os.listdir(tmp_path) == []


def _mount_tmpfs(path, opts):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def test_bad_offload_path_and_arguments(tmp_path):
    model = M.make_model()
    with pytest.raises(ValueError, match="needs offload_path"):
        M.zero_opt(model, 2, offload="nvme")
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        M.zero_opt(model, 2, offload="nvme", offload_path=missing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        M.zero_opt(model, 2, offload="nvme", offload_path=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="offload_path is for offload='nvme' only"):
        M.zero_opt(model, 2, offload="cpu", offload_path=str(tmp_path))
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        zk.ZeroAdamW(model, stage=0, offload="nvme", offload_path=str(tmp_path))
    with pytest.raises(ValueError, match="offload_params='nvme' needs stage=3"):  # (issue 13)
        zk.ZeroAdamW(model, stage=2, offload="nvme", offload_path=str(tmp_path),
                     offload_params="nvme")
    assert M.bitwise_equal(M.snapshot(model), M.snapshot(M.make_model()))
    assert os.listdir(tmp_path) == ["file"]


def test_read_only_and_full_tmpfs(tmp_path, monkeypatch):
    """A read-only mount fails at construction; so does a tmpfs too small for the files (they
    are preallocated, both halves). The buffered fallback (for file systems that refuse
    O_DIRECT; this kernel's tmpfs accepts it, so the probe is patched) trains bitwise alike."""
    ro, small = tmp_path / "ro", tmp_path / "small"
    ro.mkdir()
    small.mkdir()
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        with pytest.raises(ValueError, match=f"{ro}.*not writable"):
            M.zero_opt(M.make_model(), 2, offload="nvme", offload_path=str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    _mount_tmpfs(small, "size=64k")
    try:
        with pytest.raises(ValueError, match=f"{small}.*No space left"):
            M.zero_opt(M.make_model(), 2, offload="nvme", offload_path=str(small))
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
    big = tmp_path / "big"
    big.mkdir()
    _mount_tmpfs(big, "size=16m")
    monkeypatch.setattr("zerokern.state.aligned_io.direct_supported", lambda path: False)
    try:  # the buffered path, bitwise as the no-offload run
        runs = []
        for off in (None, "nvme"):
            model = M.make_model()
            opt = (_nvme_opt(model, 2, "bf16", str(big)) if off else
                   M.zero_opt(model, 2, "bf16"))
            assert off is None or not opt.offloader.direct
            runs.append(M.train_zero(model, opt, 0, 1, 3)["params"][-1])
            opt.close()  # (the model's hooks keep the optimizer alive: no GC to wait for)
        assert M.bitwise_equal(runs[0], runs[1])
    finally:
        gc.collect()
        subprocess.run(["umount", str(big)], check=True)


@pytest.mark.slow  # [Note: the slow mark]: 25 s (a CLI subprocess); estimate() itself is tested
def test_estimate_cli_offload_nvme():
    """`zerokern estimate --offload nvme`: disk rows (both halves) and the I/O pool on the host,
    device optimizer rows 0; the JSON equals the Python API."""
    import json

    r = subprocess.run([sys.executable, "-m", "zerokern", "estimate", "--params", "3000000",
                        "--world-size", "2", "--offload", "nvme", "--json"],
                       capture_output=True, text=True, check=True, timeout=120)
    res = json.loads(r.stdout)["results"]
    assert [x["stage"] for x in res] == [1, 2, 3]
    for x in res:
        est = E.estimate(E.spec_from_numel(3000000), 2, x["stage"], "bf16", offload="nvme")
        assert x["disk"] == est["disk"] and x["host"] == est["host"]
        assert x["bytes"]["master"] == x["bytes"]["exp_avg"] == 0
        # both halves of 3 files, each padded to N*128 elements and then to 4096 bytes
        assert 0 <= x["disk_total"] - x["formula"]["disk"] <= 3 * 2 * (4 * 2 * 128 + 4096)
        assert x["host_pinned"] == x["host_total"] > 0 and x["host_pageable"] == 0  # nccl
    table = subprocess.run([sys.executable, "-m", "zerokern", "estimate", "--params", "3000000",
                            "--offload", "nvme"], capture_output=True, text=True, check=True,
                           timeout=120).stdout
    assert "disk: master (fp32, 2 halves)" in table and "total on disk" in table


@pytest.mark.parametrize("stage", [1, 2])
def test_a_disk_too_small_is_refused_before_the_model_changes(tmp_path, stage):
    """Stages 1-2: a disk without room for the state files (both halves) is a ValueError naming
    the path, raised before any param is cast or moved and with no file left behind. (Before,
    the second param group's files failed after the first group had cast and re-viewed its
    params.)"""
    from ..stage3.test_param_offload import _mount_tmpfs

    small = tmp_path / "small"
    # The test model's first param group's files take 240 KiB, the second's 24 KiB: the first
    # fits, the second does not.
    _mount_tmpfs(small, "size=256k")
    try:
        model = M.make_model()
        with pytest.raises(ValueError, match=f"{small}.*No space left"):
            M.zero_opt(model, stage, "bf16", offload="nvme", offload_path=str(small))
        assert os.listdir(small) == []
        assert M.bitwise_equal(M.snapshot(model), M.snapshot(M.make_model()))
    finally:
        subprocess.run(["umount", str(small)], check=True)
