"""DeepSpeed's stage-3 schedule keys (stage3_max_reuse_distance, stage3_max_live_parameters,
stage3_prefetch_bucket_size, stage3_param_persistence_threshold) through zerokern.initialize:
the same config keeps and re-gathers what DeepSpeed does ([Note: DeepSpeed's stage-3 keys] in
zerokern/stage3/ds_schedule.py).

The count: elements all-gathered per optimizer step, each engine by its own counter: zerokern's
`optimizer.comm_stats()` (all-gather bytes per rank, (N-1)/N of the full buffers), DeepSpeed's
all-gathers counted at its communication backend (`deepspeed.comm.comm.cdb`, which every ZeRO-3
param gather goes through: the forward/backward fetches and prefetches of its coordinator and the
persistent params' gather after each step), in its steady state (its trace is recorded in the
first two steps, which release everything). The model is a stack of bias-free Linear layers in
a ModuleList, so that DeepSpeed's modules and zerokern's units are the same (the note explains
where unit granularity differs). 2 gloo ranks, one spawned group, DeepSpeed on the CPU."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from tests.support.harness import cached, case, run_cases  # noqa: E402

from . import common as C  # noqa: E402

SIZES = [(32, 64), (64, 64), (64, 64), (64, 32), (32, 8)]  # numel 2048, 4096, 4096, 2048, 256
TOTAL = sum(a * b for a, b in SIZES)  # 12544
STEPS = 5  # DeepSpeed's trace is complete from step 3; steps 4 and 5 are compared


class Stack(torch.nn.Module):
    """Linear layers (no bias) with tanh between: one param per module, one module per unit."""

    def __init__(self, seed: int = 7) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False) for a, b in SIZES)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, SIZES[0][0], generator=g), torch.randn(4, SIZES[-1][1], generator=g)


def _config(**keys):
    cfg = C.base_config(3, "fp32", gas=1)
    cfg["zero_optimization"].update(keys)
    return cfg


# name -> the config's stage-3 keys, and the elements each step gathers in DeepSpeed's
# semantics, worked out by hand from its coordinator (partitioned_param_coordinator.py):
CASES = {
    # DeepSpeed's defaults: every param is under 1e5 elements, so persistent: gathered once a
    # step (zerokern: at its forward, kept to the backward)
    "defaults": ({}, TOTAL),
    # nothing persistent, reuse distance 0, no prefetch: everything re-gathered for backward
    "regather-all": ({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                      "stage3_prefetch_bucket_size": 0}, 2 * TOTAL),
    # reuse distance 5000: the last three layers are used again within 5000 elements
    # (256 + 256 + 2048 + 2048 = 4608 before the third's backward); the first two are not
    "reuse-5000": ({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 5000,
                    "stage3_prefetch_bucket_size": 0}, TOTAL + 2048 + 4096),
    # persistence at 3000 elements: layers 0, 3, 4 persistent, 1 and 2 re-gathered
    "persist-3000": ({"stage3_param_persistence_threshold": 3000,
                      "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
                     TOTAL + 2 * 4096),
    # reuse distance 0 but DeepSpeed's default prefetch bucket: its first fetch scans the whole
    # (small) trace and marks every param as needed again, so nothing is released
    "prefetch-keeps": ({"stage3_param_persistence_threshold": 0,
                        "stage3_max_reuse_distance": 0}, TOTAL),
}


def _count_deepspeed(rank: int, cfg):
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    C.launcher_env(rank)
    model = Stack()
    with C.restore_linear():
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(cfg))[0]
        backend = ds_comm.cdb
        real = backend.all_gather_into_tensor
        gathered = [0]

        def counted(output_tensor, input_tensor, *args, **kwargs):
            gathered[0] += output_tensor.numel()
            return real(output_tensor, input_tensor, *args, **kwargs)

        backend.all_gather_into_tensor = counted
        try:
            per_step, losses = [], []
            for s in range(STEPS):
                gathered[0] = 0
                x, y = _data(s, rank)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                per_step.append(gathered[0])
                losses.append(float(loss))
        finally:
            backend.all_gather_into_tensor = real
        engine.destroy()
    return per_step, losses


def _count_zerokern(rank: int, cfg):
    import zerokern

    C.launcher_env(rank)
    model = Stack()
    engine, opt, _, _ = zerokern.initialize(model=model, model_parameters=model.parameters(),
                                            config=copy.deepcopy(cfg))
    per_step, losses = [], []
    n = opt.comm.shard.world_size
    for s in range(STEPS):
        opt.reset_comm_stats()
        x, y = _data(s, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        sent = opt.comm_stats()["all_gather"]  # bytes sent: (N-1)/N of each full buffer
        per_step.append(round(sent * n / (n - 1) / 4))
        losses.append(float(loss))
    peak_ok = opt.grad_sync.peak_live_bytes <= opt.grad_sync.live_bound()
    return per_step, losses, peak_ok


def _cases(rank, ws):
    cases = {}
    for name, (keys, _) in CASES.items():
        cases[name] = lambda keys=keys: (_count_zerokern(rank, _config(**keys)),
                                         _count_deepspeed(rank, _config(**keys)))

    def gpt2_losses():
        """The parity test's stage-3 fp32 run (tests/engine/test_deepspeed_parity.py), with
        the keys that re-gather everything: the losses do not move."""
        keys = CASES["regather-all"][0]
        cfg = C.base_config(3, "fp32", reduce_bucket_size=3000, **keys)
        return (C.train("zerokern", rank, cfg), C.train("deepspeed", rank, cfg),
                C.train("zerokern", rank, C.base_config(3, "fp32", reduce_bucket_size=3000)))

    cases["gpt2-losses"] = gpt2_losses
    return run_cases(cases)


def _worker(rank, ws):
    return _cases(rank, ws)


def _results():
    return cached(_worker, 2)


@pytest.mark.slow  # one spawned group of 2 ranks, both engines per case: 100-200 s here
@pytest.mark.parametrize("name", list(CASES))
def test_gathered_elements_match_deepspeed(name):
    """Per step, zerokern gathers what DeepSpeed gathers (padding aside: DeepSpeed pads each
    param to a multiple of the world size, zerokern each unit; none here), and both what the
    coordinator's rules give by hand; the losses agree as in the parity test."""
    want = CASES[name][1]
    for (zk, zk_losses, peak_ok), (ds, ds_losses) in case(_results(), name):
        assert ds[3:] == [want, want], (name, ds)  # DeepSpeed's own count, steady state
        assert zk[1:] == [want] * (STEPS - 1), (name, zk)  # zerokern's, from its first step
        assert C.rel(zk_losses, ds_losses) <= 1e-5, (zk_losses, ds_losses)
        assert peak_ok


@pytest.mark.slow
def test_keys_move_both_counts_the_same_way():
    """Negative control for the mapping: the keys do change the count (a zerokern that ignored
    them, keeping the root and the last unit as before, would gather 2 * TOTAL - 256 in every
    case), and in the same direction in both engines."""
    counts = {n: case(_results(), n)[0] for n in CASES}
    zk = {n: c[0][0][-1] for n, c in counts.items()}
    ds = {n: c[1][0][-1] for n, c in counts.items()}
    assert len(set(zk.values())) == 4, zk
    for a in CASES:
        for b in CASES:
            assert (zk[a] < zk[b]) == (ds[a] < ds[b]), (a, b, zk, ds)


@pytest.mark.slow
def test_gpt2_losses_unchanged():
    """The keys change where params are gathered, never the numbers: the parity model's losses
    with everything re-gathered equal DeepSpeed's on the same config (fp32 bound, as the parity
    test) and zerokern's with DeepSpeed's defaults bit for bit."""
    for z, d, z_default in case(_results(), "gpt2-losses"):
        assert C.rel(z, d) <= 1e-5, (z, d)
        assert z == z_default, (z, z_default)


# Without DeepSpeed's count, in the default suite: the unit-level run of its coordinator
# (deepspeed_keep) keeps, per case, the layers the counts above imply.
KEPT = {"defaults": [0, 1, 2, 3, 4, 5], "regather-all": [0], "reuse-5000": [0, 3, 4, 5],
        "persist-3000": [0, 1, 4, 5], "prefetch-keeps": [0, 1, 2, 3, 4, 5]}


@pytest.mark.parametrize("name", list(CASES))
def test_kept_units_by_hand(name):
    """Units 1-5 are the layers, 0 the root (no params of its own: numel 0, so persistent at
    any threshold: kept, gathering nothing)."""
    from zerokern.engine.config import parse_config
    from zerokern.stage3.ds_schedule import deepspeed_keep

    numel = [0] + [a * b for a, b in SIZES]
    keys = parse_config(_config(**CASES[name][0]), 1).stage3_keys
    kept = deepspeed_keep([1, 2, 3, 4, 5], 0, numel.__getitem__,
                          lambda u: numel[u] <= keys.param_persistence_threshold, keys)
    assert sorted(kept) == KEPT[name], kept
    regathered = sum(numel[u] for u in range(6) if u not in kept)
    assert TOTAL + regathered == CASES[name][1]


@pytest.mark.parametrize("key", ["stage3_max_reuse_distance", "stage3_max_live_parameters",
                                 "stage3_prefetch_bucket_size",
                                 "stage3_param_persistence_threshold"])
@pytest.mark.parametrize("bad", [-1, 1.5, "1e9", True])
def test_bad_values_name_the_key(key, bad):
    from zerokern.engine.config import parse_config

    cfg = _config(**{key: bad})
    with pytest.raises(ValueError, match=f"zero_optimization.{key}"):
        parse_config(cfg, 1)


def test_keys_no_longer_logged_as_no_effect():
    from zerokern.engine.config import parse_config

    keys = {k: 10**6 for k in ("stage3_max_reuse_distance", "stage3_max_live_parameters",
                               "stage3_prefetch_bucket_size",
                               "stage3_param_persistence_threshold")}
    cfg = parse_config(_config(**keys), 1)
    assert cfg.no_effect == []
    assert cfg.stage3_keys.max_reuse_distance == 10**6
    below = copy.deepcopy(_config(**keys))
    below["zero_optimization"]["stage"] = 2  # DeepSpeed reads them at stage 3 only
    assert [k for k, _ in parse_config(below, 1).no_effect] == \
        [f"zero_optimization.{k}" for k in keys]
