"""offload="nvme" for 8-bit AdamW and Muon, and master="compact" for Muon (issue 23 remainders).

The NVMe file set holds any StateSpec (uint8 codes, per-block fp32 absmax: state/nvme_state.py
[Note: any StateSpec in a file, aligned]) and streams a phased rule's passes (offload_nvme.py
[Note: a phased rule over NVMe]). The reference is the same optimizer on the device (and, for
Muon, with offload="cpu"), whose own parity with torch / bitsandbytes is tested in
tests/rules/test_muon.py and test_adamw8bit.py: the same kernels on the same bytes, so the
comparison is bit for bit. Per world size (2; 1 and 3 slow), stages 1-3, bf16, with clipping on
every step and an inf injected on rank 0 at step 1 (every rank skips), and fp32 at stage 2:
- params after every step, the skipped flags, and at the end every rank's master and rule
  states (the 8-bit codes and absmax, Muon's momentum, the AdamW moments), all bitwise;
- negative control: the device run with lr x 1.01 differs from the NVMe run;
- checkpoints: saved from the NVMe optimizers at N=2, loaded at N=1 (default) and N=3 (slow)
  into an NVMe optimizer and into a device one: the loaded params and the next 2 steps are
  bitwise equal (and the lr x 1.01 control differs);
- memory_report() device, host and disk bytes equal `estimate(optimizer=...)` at N=2;
- a failed write (ENOSPC on one rank, in Muon's second pass / on an 8-bit absmax file) rolls
  the step back on every rank, bit for bit, and the retried run equals the device run;
- buffers of many chunks (chunk = the states' aligned granule), pieces straddling chunks.
master="compact" with Muon: tests/state/test_compact_master_training.py's schedule for ZeroMuon.
Each of these raised a ValueError before this change (offload='nvme' / master='compact' were
refused for these rules).
"""

from __future__ import annotations

import errno
import os
import tempfile

import pytest
import torch

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

STEPS = 4
STAGES = [1, 2, 3]
MAX_NORM = 0.05  # below the model's grad norms (~0.1-1): the clip is active
MUON_LR = 0.02
KINDS = ("8bit", "muon")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.dtype == torch.uint8:
        return t.clone()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _opt(kind, model, stage, offload=None, path=None, lr_scale=1.0, precision="bf16", **kw):
    common = dict(stage=stage, precision=precision, bucket_mb=M.BUCKET_MB, backend="cpu",
                  max_grad_norm=MAX_NORM, offload=offload,
                  offload_path=path if offload == "nvme" else None, **kw)
    if kind == "8bit":
        return zk.ZeroAdamW(model, lr=M.LR * lr_scale, betas=M.BETAS, eps=M.EPS,
                            weight_decay=M.WD, state_bits=8, **common)
    return zk.ZeroMuon(model, lr=MUON_LR * lr_scale, adamw_lr=M.LR * lr_scale, **common)


def _train(model, opt, rank, ws, steps, start=0, inf_at=1):
    rec = {"params": [], "skipped": []}
    inf_param = dict(model.named_parameters())["blocks.0.fc1.weight"]
    for s in range(start, start + steps):
        opt.zero_grad()
        hook = None
        if s == inf_at and rank == 0:
            hook = inf_param.register_hook(lambda g: g * float("inf"))
        opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws)))
        if hook is not None:
            hook.remove()
        opt.step()
        rec["params"].append(M.full_snapshot(model, opt))
        rec["skipped"].append(bool(opt.step_skipped))
    return rec


def _local_state(opt, master: bool = True) -> list:
    """This rank's master and rule states per buffer, as bits (read through the placement's
    views: the NVMe files' current half). master=False: without it (fp32 on the device has
    none: the params, compared apart, are the master)."""
    out = []
    for g in opt.flat_groups:
        d = {k: _bits(t) for k, t in g.rule_states.items()}
        if master and g.master is not None:
            d["master"] = _bits(g.master)
        d["steps"] = g.steps.cpu().clone()
        out.append(d)
    return out


def _eq(x, y) -> bool:
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_eq(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_eq(u, v) for u, v in zip(x, y))
    if isinstance(x, torch.Tensor):
        return x.dtype == y.dtype and torch.equal(x, y)
    return x == y


def _parity(rank, ws, kind, stage, precision="bf16"):
    """The NVMe run against the device run (and Muon's offload="cpu" run), bitwise."""
    runs = {}
    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        for name, off, scale in (("device", None, 1.0), ("cpu", "cpu", 1.0),
                                 ("nvme", "nvme", 1.0), ("control", None, 1.01)):
            if name == "cpu" and kind != "muon":
                continue
            model = M.make_model()
            opt = _opt(kind, model, stage, off, d, lr_scale=scale, precision=precision)
            rec = _train(model, opt, rank, ws, STEPS, inf_at=1 if precision == "bf16" else -1)
            rec["state"] = _local_state(opt, master=precision != "fp32")
            if off == "nvme":
                rec["files"] = len(os.listdir(d))
                opt.close()
            runs[name] = rec
    dev, nv = runs["device"], runs["nvme"]
    out = {"params": _eq(dev["params"], nv["params"]), "state": _eq(dev["state"], nv["state"]),
           "skipped": nv["skipped"], "dev_skipped": dev["skipped"], "files": nv["files"],
           "moved": not M.bitwise_equal(nv["params"][0], nv["params"][-1]),
           "control_differs": not M.bitwise_equal(runs["control"]["params"][-1],
                                                  nv["params"][-1]),
           "state_names": sorted({k for s in nv["state"] for k in s})}
    if "cpu" in runs:
        out["cpu"] = _eq(runs["cpu"]["params"], nv["params"]) and \
            _eq(runs["cpu"]["state"], nv["state"])
    return out


def _save(rank, ws, root, kind):
    """N=2: train with offload="nvme", save a checkpoint (read through the files' views)."""
    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        model = M.make_model()
        opt = _opt(kind, model, 2, "nvme", d)
        _train(model, opt, rank, ws, STEPS)
        zk.checkpoint.save(os.path.join(root, kind), model, opt)
        opt.close()
        return {"ok": True}


def _load(rank, ws, root, kind, stage):
    """Load the N=2 checkpoint at this world size into an NVMe optimizer and a device one
    (and a device one with lr x 1.01): loaded params and 2 more steps, bitwise."""
    recs = {}
    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        for name, off, scale in (("device", None, 1.0), ("nvme", "nvme", 1.0),
                                 ("control", None, 1.01)):
            model = M.make_model(seed=1)  # other values: the load must overwrite them
            opt = _opt(kind, model, stage, off, d)
            zk.checkpoint.load(os.path.join(root, kind), model, opt)
            for g in opt.param_groups:  # the checkpoint restored the groups' lr
                g["lr"] *= scale
            loaded = M.full_snapshot(model, opt)
            rec = _train(model, opt, rank, ws, 2, start=STEPS, inf_at=-1)
            recs[name] = {"loaded": loaded, "params": rec["params"],
                          "state": _local_state(opt)}
            if off == "nvme":
                opt.close()
    dev, nv = recs["device"], recs["nvme"]
    return {"loaded": _eq(dev["loaded"], nv["loaded"]), "params": _eq(dev["params"],
                                                                      nv["params"]),
            "state": _eq(dev["state"], nv["state"]),
            "moved": not M.bitwise_equal(nv["loaded"], nv["params"][-1]),
            "control_differs": not M.bitwise_equal(recs["control"]["params"][-1],
                                                   nv["params"][-1])}


def _memory(rank, ws, kind, stage):
    """memory_report() with offload="nvme" against estimate(optimizer=...), bf16."""
    from zerokern.accounting import estimate as E

    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        model = M.make_model()
        opt = _opt(kind, model, stage, "nvme", d)
        _train(model, opt, rank, ws, 2, inf_at=-1)
        rep = opt.memory_report()
        with torch.device("meta"):
            spec = E.spec_from_model(M.make_model(), "tinylm")
        est = E.estimate(spec, ws, stage, "bf16", M.BUCKET_MB, "nvme", rank=rank, comm="gloo",
                         optimizer="adamw8bit" if kind == "8bit" else "muon")
        files = sum(os.path.getsize(p) for p in opt.offloader.paths())
        out = {"measured": rep["measured"], "est": est["bytes"],
               "host": rep["host_measured"], "est_host": est["host"],
               "disk": rep["disk_measured"], "est_disk": est["disk"], "files": files,
               "disk_total": rep["disk_measured_total"]}
        opt.close()
        return out


def _fault(rank, ws, kind):
    """ENOSPC injected into the last rank's first write of one file (Muon: the master, written
    in the second pass, after the momentum pass wrote its file; 8-bit: the second absmax):
    every rank raises, nothing changes (params, master, states, steps); the retried step and
    the rest equal the device run."""
    suffix = "-master.bin" if kind == "muon" else "-exp_avg_sq_absmax.bin"
    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        model0 = M.make_model()
        ref = _train(model0, _opt(kind, model0, 2), rank, ws, STEPS, inf_at=-1)
        model = M.make_model()
        opt = _opt(kind, model, 2, "nvme", d)
        _train(model, opt, rank, ws, 2, inf_at=-1)
        before = (M.full_snapshot(model, opt), _local_state(opt))
        off = opt.offloader
        victim = rank == ws - 1
        hits = []

        def fault(path, offset):
            if path.endswith(suffix) and not hits:
                hits.append(path)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        if victim:
            off.fault_hook = fault
        opt.zero_grad()
        opt.backward(M.loss_fn(model, M.rank_tokens(2, rank, ws)))
        error = None
        try:
            opt.step()
        except (OSError, RuntimeError) as e:
            error = type(e).__name__
        off.fault_hook = None
        after = (M.full_snapshot(model, opt), _local_state(opt))
        opt.step()  # the same grads: the step that failed, now completing
        rec = _train(model, opt, rank, ws, STEPS - 3, start=3, inf_at=-1)
        opt.close()
        return {"error": error, "victim": victim, "hit": bool(hits),
                "unchanged": _eq(before, after),
                "retry": M.bitwise_equal(rec["params"][-1], ref["params"][-1])}


def _chunks(rank, ws, kind):
    """A buffer of many chunks (the 1.9M GPT in one 0.05 MB-bucketed buffer, chunks of the
    smallest granule: 131072 elements with 8-bit states, 1024 else, 2 sets), pieces straddling
    chunks: NVMe equals the device bitwise after 3 steps."""
    from zerokern.tools.gpt import build_gpt

    out = {}
    with tempfile.TemporaryDirectory(prefix="zk_nvme_rules_") as d:
        for off in (None, "nvme"):
            torch.manual_seed(0)
            m = build_gpt("small")
            kw = dict(stage=2, precision="bf16", bucket_mb=0.05, backend="cpu", offload=off,
                      offload_path=d if off else None)
            opt = zk.ZeroAdamW(m, state_bits=8, **kw) if kind == "8bit" else \
                zk.ZeroMuon(m, lr=0.02, **kw)
            if off:
                opt.placement.configure(131072 if kind == "8bit" else 1024, 2)
                out["chunks"] = max(f.n for f in opt.placement.files) // opt.placement.chunk
            g = torch.Generator().manual_seed(rank)
            for _ in range(3):
                idx = torch.randint(0, 512, (2, 65), generator=g)
                opt.zero_grad()
                opt.backward(m.loss(idx[:, :-1], idx[:, 1:]))
                opt.step()
            out[off] = {n: _bits(p) for n, p in m.named_parameters()}
            out[f"state-{off}"] = _local_state(opt)
            opt.close()
    return {"params": _eq(out[None], out["nvme"]), "state": _eq(out["state-None"],
                                                               out["state-nvme"]),
            "chunks": out["chunks"]}


def _worker(rank, ws, root):
    cases = {}
    for kind in KINDS:
        for stage in STAGES:
            cases[f"{kind}-{stage}"] = lambda k=kind, s=stage: _parity(rank, ws, k, s)
        cases[f"{kind}-fp32"] = lambda k=kind: _parity(rank, ws, k, 2, "fp32")
        if ws == 2:
            cases[f"save-{kind}"] = lambda k=kind: _save(rank, ws, root, k)
            cases[f"memory-{kind}"] = lambda k=kind: _memory(rank, ws, k, 2)
            cases[f"fault-{kind}"] = lambda k=kind: _fault(rank, ws, k)
            cases[f"chunks-{kind}"] = lambda k=kind: _chunks(rank, ws, k)
    return run_cases(cases)


LOAD_STAGE = {"8bit": 1, "muon": 3}  # another stage than the save's 2, and another world


def _load_worker(rank, ws, root):
    return run_cases({f"load-{k}": lambda k=k: _load(rank, ws, root, k, LOAD_STAGE[k])
                      for k in KINDS})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme_rules"))


def _check_parity(ws, root, kind, stage, precision="bf16"):
    name = f"{kind}-{stage}" if precision == "bf16" else f"{kind}-fp32"
    res = case(cached(_worker, ws, root), name)
    for rank, r in enumerate(res):
        where = f"{kind} N={ws} stage {stage} rank {rank}"
        assert r["params"], f"{where}: params differ from the device run"
        assert r["state"], f"{where}: master/states differ from the device run"
        assert r.get("cpu", True), f"{where}: differs from offload='cpu'"
        want = [s == 1 and precision == "bf16" for s in range(STEPS)]  # fp32: no inf step
        assert r["skipped"] == r["dev_skipped"] == want, where
        assert r["moved"] and r["control_differs"], where
        assert r["files"] > 0, where
    names = set(res[0]["state_names"])
    if kind == "8bit":
        assert {"exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"} <= names
    else:
        assert {"momentum_buffer", "exp_avg", "exp_avg_sq"} <= names


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", KINDS)
# [Note: the slow mark]: N=2 (shards) in the default suite, N=1 in CI's -m slow pass
@pytest.mark.parametrize("ws", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_nvme_equals_device_bitwise(ws, kind, stage, root):
    _check_parity(ws, root, kind, stage)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ws", ws_params(1, 2))
def test_nvme_equals_device_bitwise_fp32(ws, kind, root):
    """fp32 params (the master is the param on the device, a file here), stage 2."""
    _check_parity(ws, root, kind, 2, "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", KINDS)
def test_nvme_equals_device_bitwise_n3(kind, stage, root):
    _check_parity(3, root, kind, stage)


@pytest.mark.parametrize("kind", KINDS)
def test_memory_report_equals_estimate(kind, root):
    for rank, r in enumerate(case(cached(_worker, 2, root), f"memory-{kind}")):
        assert r["measured"] == r["est"], f"rank {rank}: device"
        assert r["host"] == r["est_host"], f"rank {rank}: host"
        assert r["disk"] == r["est_disk"], f"rank {rank}: disk"
        assert r["files"] == r["disk_total"], "disk bytes are the files' sizes"


def _check_load(ws, root, kind):
    assert all(x["ok"] for x in case(cached(_worker, 2, root), f"save-{kind}"))
    for rank, r in enumerate(case(cached(_load_worker, ws, root), f"load-{kind}")):
        where = f"{kind} N=2 -> N={ws} rank {rank}"
        assert r["loaded"] and r["params"] and r["state"], f"{where}: {r}"
        assert r["moved"] and r["control_differs"], where


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_from_nvme_reshards_n2_to_n1(kind, root):
    _check_load(1, root, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_from_nvme_reshards_n2_to_n3(kind, root):
    _check_load(3, root, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_failed_write_rolls_back_and_retries(kind, root):
    res = case(cached(_worker, 2, root), f"fault-{kind}")
    for rank, r in enumerate(res):
        where = f"{kind} rank {rank}"
        assert r["error"] == ("OSError" if r["victim"] else "RuntimeError"), f"{where}: {r}"
        assert r["hit"] == r["victim"], where
        assert r["unchanged"], f"{where}: the failed step changed state"
        assert r["retry"], f"{where}: the retried run differs from the device run"


@pytest.mark.parametrize("kind", KINDS)
def test_many_chunks_per_buffer(kind, root):
    for rank, r in enumerate(case(cached(_worker, 2, root), f"chunks-{kind}")):
        assert r["chunks"] >= 4, r
        assert r["params"] and r["state"], f"{kind} rank {rank}: {r}"
