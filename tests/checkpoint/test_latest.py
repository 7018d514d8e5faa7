"""zerokern.checkpoint.latest(dir): the newest complete checkpoint under dir, in process.

Five checkpoints at steps 1-5 under one directory, then damage: step 5's rank file truncated
(incomplete), step 4's metadata with a flipped byte (its crc line), an interrupted save's
`.tmp-` directory, a directory that is no checkpoint; latest() returns step 3 and warns naming
each skipped one. A flipped byte inside step 3's rank file (size intact) is found by the block
checksums and step 2 is returned. Nothing complete: None. And client_state round-trips through
save/load (the train job's and the engine's state ride in it).
"""

from __future__ import annotations

import os
import warnings

import pytest

import zerokern.checkpoint as ck

from ..support import models as M
from ..support.harness import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _flip(fn: str, offset: int) -> None:
    with open(fn, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("latest"))
    model = M.make_model()
    opt = M.zero_opt(model, 1, "fp32", backend="reference")
    for s in range(1, 6):
        M.train_zero(model, opt, 0, 1, 1, start=s - 1)
        ck.save(os.path.join(root, f"step{s}"), model, opt, client_state={"step": s})
    return root


def _latest(root):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = ck.latest(root)
    return got, " | ".join(str(x.message) for x in w)


def test_latest_skips_incomplete_and_corrupt_checkpoints_naming_them(five):
    got, said = _latest(five)
    assert got == os.path.join(five, "step5") and said == ""
    rank = os.path.join(five, "step5", "rank00000.bin")
    os.truncate(rank, os.path.getsize(rank) - 8)
    _flip(os.path.join(five, "step4", "meta.json"), 40)
    os.makedirs(os.path.join(five, "step6.tmp-0123456789ab"))
    os.makedirs(os.path.join(five, "notes"))
    got, said = _latest(five)
    assert got == os.path.join(five, "step3"), said
    for name in ("step5", "step4", "step6.tmp-0123456789ab", "notes"):
        assert name in said, said
    _flip(os.path.join(five, "step3", "rank00000.bin"), 100)  # size intact: the crc finds it
    got, said = _latest(five)
    assert got == os.path.join(five, "step2") and "step3" in said and "checksum" in said
    model = M.make_model(M.MODEL_SEED + 1)
    opt = M.zero_opt(model, 2, "fp32", backend="reference")
    assert ck.load(got, model, opt)["client_state"] == {"step": 2}


def test_latest_of_an_empty_or_missing_directory_is_none(tmp_path):
    assert ck.latest(str(tmp_path)) is None
    assert ck.latest(str(tmp_path / "missing")) is None


def test_load_without_client_state_returns_none(tmp_path):
    model = M.make_model()
    opt = M.zero_opt(model, 1, "fp32", backend="reference")
    ck.save(str(tmp_path / "c"), model, opt)
    assert ck.load(str(tmp_path / "c"), model, opt)["client_state"] is None
