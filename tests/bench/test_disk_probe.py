"""zerokern.bench.disk_probe replays the offload="nvme" step's own I/O, and says when it does not.

The reference is the engine itself: a ZeroAdamW(offload="nvme") step on a two-buffer model with
a small chunk (several requests per buffer, a short last one), its requests recorded at
aligned_io.read_chunk / write_chunk (the functions both the step and the probe call). The probe
built from the buffers' state sizes alone (`pattern_for`) must give the engine's file sizes
(`nvme_state.file_bytes` and the files on disk), the same reads and writes in the same order
(buffer, file, offset, bytes), and the step's bytes moved. Negative control: a probe with a
different request size is refused by `check_same` and its trace differs from the step's.
Borrowing the step's files between steps leaves the training bit-identical to a twin optimizer
that was never probed.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

import zerokern as zk
from zerokern.bench import disk_probe as dp
from zerokern.state import aligned_io as aio
from zerokern.state import nvme_state

CHUNK, DEPTH = 1024, 2


def _model_opt(path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 40))
    groups = [{"params": list(m[0].parameters())},
              {"params": list(m[2].parameters()), "weight_decay": 0.0}]
    opt = zk.ZeroAdamW(groups, lr=1e-2, stage=2, precision="fp32", offload="nvme",
                       offload_path=str(path))
    opt.offloader.configure(chunk_numel=CHUNK, queue_depth=DEPTH)
    return m, opt


def _step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, m[0].in_features, generator=g)
    opt.backward(m(x).square().mean())
    opt.step()
    opt.zero_grad()


@pytest.fixture
def trace(monkeypatch):
    """Every read_chunk / write_chunk call: (buffer, file name, offset, bytes) per kind."""
    log = {"read": [], "write": []}
    lock = threading.Lock()
    read0, write0 = aio.read_chunk, aio.write_chunk

    def read(fd, buf, off, path, direct):
        with lock:
            log["read"].append((*dp.request_key(path), off, len(buf)))
        return read0(fd, buf, off, path, direct)

    def write(fd, buf, off, path, direct, fault):
        with lock:
            log["write"].append((*dp.request_key(path), off, len(buf)))
        return write0(fd, buf, off, path, direct, fault)

    monkeypatch.setattr(aio, "read_chunk", read)
    monkeypatch.setattr(aio, "write_chunk", write)
    return log


def _replay_issues(folder, pat, trace, step_trace):
    """A replay of `pat` on fresh probe files issues exactly the step's requests."""
    files = dp.ProbeFiles.create(str(folder), pat)
    try:
        _take(trace)  # (create's zero fill)
        dp.replay(files, pat)
        assert _take(trace) == step_trace
    finally:
        files.close()


def _take(log):
    out = {k: list(v) for k, v in log.items()}
    for v in log.values():
        v.clear()
    return out


def test_probe_replays_the_step_and_a_different_request_size_is_flagged(tmp_path, trace):
    (tmp_path / "state").mkdir()
    (tmp_path / "probe").mkdir()
    m, opt = _model_opt(tmp_path / "state")
    off = opt.offloader
    numels = [f.n for f in off.files]
    assert len(numels) == 2 and all(n % CHUNK for n in numels)  # a short last request each
    _take(trace)
    b0 = off.bytes_moved
    _step(m, opt, 1)
    step_trace, step_bytes = _take(trace), off.bytes_moved - b0

    pat = dp.pattern_for(numels, chunk_numel=CHUNK, queue_depth=DEPTH, direct=off.direct)
    dp.check_same(pat, dp.pattern_of(off))
    for gi, f in enumerate(off.files):  # the engine's own size function and its files
        assert pat.file_bytes()[gi] == tuple(nvme_state.file_bytes(f.n, dt, b)
                                             for _, dt, b in f.specs)
        assert tuple(os.stat(p).st_size for p in f.paths) == pat.file_bytes()[gi]
    assert pat.requests(0) == step_trace  # same requests, same order per kind
    assert pat.bytes_per_step == step_bytes

    files = dp.ProbeFiles.create(str(tmp_path / "probe"), pat)
    try:
        assert tuple(tuple(os.stat(p).st_size for p in ps) for ps in files.paths) == \
            pat.file_bytes()
        _take(trace)
        res = dp.replay(files, pat)
        assert _take(trace) == step_trace
        assert res["bytes"] == step_bytes and res["GBps"] > 0
        assert res["requests"] == sum(len(v) for v in step_trace.values())

        # negative control: twice the request size
        other = dp.pattern_for(numels, chunk_numel=CHUNK * 2, queue_depth=DEPTH,
                               direct=off.direct)
        with pytest.raises(ValueError, match="elements per request: probe 2048, step 1024"):
            dp.check_same(other, dp.pattern_of(off))
        dp.replay(files, other)
        other_trace = _take(trace)
        assert other_trace != step_trace
        assert {n for *_, n in other_trace["read"]} != {n for *_, n in step_trace["read"]}
        with pytest.raises(ValueError, match="buffer sets in flight"):
            dp.check_same(dp.pattern_for(numels, chunk_numel=CHUNK, queue_depth=DEPTH + 1,
                                         direct=off.direct), dp.pattern_of(off))
    finally:
        files.close()
    assert os.listdir(tmp_path / "probe") == []
    opt.close()


def test_borrowing_the_step_files_leaves_training_unchanged(tmp_path, trace):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ma, oa = _model_opt(tmp_path / "a")
    mb, ob = _model_opt(tmp_path / "b")
    for seed in (1, 2):  # both halves written: the probe borrows only after that
        _step(ma, oa, seed)
        _step(mb, ob, seed)
    files = dp.ProbeFiles.borrow(oa.offloader)  # once, then probe and step interleaved
    pat = dp.pattern_of(oa.offloader)
    sets, io = files.pool(pat)  # the step's own buffer sets and threads
    assert sets is oa.offloader.pool and io is oa.offloader.io
    for seed in (3, 4, 5):
        _take(trace)
        res = dp.replay(files, pat)
        assert _take(trace) == pat.requests(oa.offloader.cur)  # reads the current half
        assert res["bytes"] == pat.bytes_per_step
        _step(ma, oa, seed)
        _step(mb, ob, seed)
    files.close()  # borrowed: nothing is removed
    assert all(os.path.exists(p) for f in oa.offloader.files for p in f.paths)
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
    for fa, fb in zip(oa.offloader.files, ob.offloader.files):
        assert torch.equal(fa.master, fb.master)
        for k in fa.states:
            assert torch.equal(fa.states[k], fb.states[k])
    # negative control of the comparison: one more step on A only
    _step(ma, oa, 6)
    assert not all(torch.equal(pa, pb) for pa, pb in zip(ma.parameters(), mb.parameters()))
    oa.close()
    ob.close()
    with pytest.raises(ValueError, match="inside a step or closed"):
        dp.replay(files, pat)  # its files are gone: refused, not an OSError mid-way


def test_probe_replays_an_8bit_state_step(tmp_path, trace):
    """8-bit AdamW over NVMe: five files per buffer in three dtypes and blocks (fp32 master,
    uint8 codes, an fp32 absmax per 128 elements), each with its own half size and offsets."""
    (tmp_path / "state").mkdir()
    (tmp_path / "probe").mkdir()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 40))
    opt = zk.ZeroAdamW(m, lr=1e-2, stage=2, precision="fp32", offload="nvme", state_bits=8,
                       offload_path=str(tmp_path / "state"))
    off = opt.offloader
    off.configure(chunk_numel=1 << 17, queue_depth=DEPTH)  # the rule's granule: 3 chunks
    _take(trace)
    _step(m, opt, 1)
    step_trace = _take(trace)
    pat = dp.pattern_for([f.n for f in off.files], rule=off.files[0].rule,
                         chunk_numel=1 << 17, queue_depth=DEPTH, direct=off.direct)
    dp.check_same(pat, dp.pattern_of(off))
    assert len(pat.specs[0]) == 5 and len(pat.plan()) == 3
    assert tuple(os.stat(p).st_size for p in off.files[0].paths) == pat.file_bytes()[0]
    assert pat.requests(0) == step_trace
    _replay_issues(tmp_path / "probe", pat, trace, step_trace)
    with pytest.raises(ValueError, match="files per buffer"):  # AdamW's files instead
        dp.check_same(dp.pattern_for([f.n for f in off.files], chunk_numel=1 << 17,
                                     queue_depth=DEPTH, direct=off.direct), pat)
    opt.close()


def test_probe_replays_an_adafactor_step_whose_first_pass_only_reads(tmp_path, trace):
    """Adafactor over NVMe: two passes over the master file, the first a read pass
    (offload_nvme.py [Note: a read pass writes nothing]): the step and the probe's replay issue
    the same requests, the writes half the reads; a pattern whose passes both write is another
    pattern."""
    (tmp_path / "state").mkdir()
    (tmp_path / "probe").mkdir()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 40))
    opt = zk.ZeroAdafactor(m, lr=1e-2, stage=2, precision="fp32", offload="nvme",
                           offload_path=str(tmp_path / "state"))
    off = opt.offloader
    off.configure(chunk_numel=CHUNK, queue_depth=DEPTH)
    _take(trace)
    _step(m, opt, 1)
    step_trace = _take(trace)
    rule = off.files[0].rule
    pat = dp.pattern_for([f.n for f in off.files], rule=rule, chunk_numel=CHUNK,
                         queue_depth=DEPTH, direct=off.direct)
    dp.check_same(pat, dp.pattern_of(off))
    assert pat.passes[0] == ((0,), (0,)) and pat.writes[0] == (False, True)
    assert pat.requests(0) == step_trace
    assert len(step_trace["read"]) == 2 * len(step_trace["write"]) > 0
    assert pat.bytes_per_step == 3 * sum(n for *_, n in step_trace["write"])
    _replay_issues(tmp_path / "probe", pat, trace, step_trace)
    both = dataclasses.replace(pat, writes=tuple((True, True) for _ in pat.writes))
    with pytest.raises(ValueError, match="passes written back"):
        dp.check_same(both, pat)
    opt.close()


def test_fraction_explains_a_step_above_the_probe():
    ok = dp.fraction([2.0, 2.2], [2.5, 2.6, 2.4], direct=True)
    assert 76 < ok["median_pct"] < 90 and ok["note"] is None
    assert dp.paired([2.0, 2.2], [2.5, 2.6, 2.4]) == pytest.approx([400 / 5.1, 440 / 5.0])
    assert ok["paired"]["n"] == 2 and ok["paired"]["max"] == pytest.approx(88.0)
    drift = dp.fraction([1.2, 2.3], [1.3, 1.7, 3.1], direct=True)  # paired 80%, 96%: no note
    assert drift["paired"]["max"] < 100 < drift["max_pct"] and drift["note"] is None
    edge = dp.fraction([1.0, 1.2], [1.3, 1.2, 1.1], direct=True)  # paired 80%, 104%
    assert edge["note"].startswith("the range reaches 104%")
    with pytest.raises(ValueError, match="one probe more than steps"):
        dp.paired([1.0, 1.0], [1.0, 1.0])
    above = dp.fraction([3.0], [2.0, 2.2], direct=True)
    assert above["median_pct"] > 100 and "changed between samples" in above["note"]
    cached = dp.fraction([3.0], [2.0], direct=False)
    assert "page cache" in cached["note"]
    assert dp.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
