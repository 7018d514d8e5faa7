"""zerokern.checkpointing in one process (no process group): DeepSpeed's API, the RNG tracker,
Pa+cpu at tp = 1, contiguous buffers, bad input, the config section.

Parity: the model of common.py (dropout on both RNG streams) trains to bitwise the same losses
and params with zerokern.checkpointing.checkpoint as without checkpointing (torch AdamW, CPU,
fp32), plain and with cpu_checkpointing and contiguous buffers. Negative controls: a block whose
dropout draws from a private generator (not replayed) and a checkpoint that does not replay
the tracker both miss the reference.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import zerokern.checkpointing as ck
from tests.checkpointing.common import BATCH, N_LAYERS, RNG_SEED, SEQ, Block, D, Model, data, train
from zerokern.checkpointing import api

STEPS = 3
IN_BYTES = BATCH * SEQ * D * 4  # one checkpointed input (fp32)


@pytest.fixture(autouse=True)
def _restore_state():
    saved = api._STATE
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    api._STATE = saved
    torch.set_num_threads(n)


def _run(ckpt, model=None, observe=None):
    model = model or Model(ck.get_cuda_rng_tracker(), ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(loss):
        if observe is not None:
            observe()
        opt.zero_grad()
        loss.backward()
        opt.step()

    losses = train(model, step, STEPS, seed_fn=lambda: ck.model_parallel_cuda_manual_seed(
        RNG_SEED))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.fixture(scope="module")
def reference():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests (module fixtures run before the autouse one)
    try:
        return _run(None)
    finally:
        torch.set_num_threads(n)


def test_checkpoint_matches_no_checkpointing_bitwise(reference):
    ck.configure(None)
    assert ck.is_configured()
    got = _run(ck.checkpoint)
    assert _same(got, reference), (got[0], reference[0])


def test_a_dropout_not_replayed_is_caught(reference):
    """Negative controls: the same parity check catches (a) a block whose dropout draws from
    a private generator, which nobody replays, (b) a checkpoint that does not replay the
    tracker."""
    class PrivateDropout(Block):
        gen = torch.Generator().manual_seed(5)

        def forward(self, x):
            keep = (torch.rand(x.shape, generator=self.gen) > 0.2).float()
            return super().forward(x) * keep / 0.8

    def private_model(ckpt):
        m = Model(ck.get_cuda_rng_tracker(), ckpt)
        for b in m.blocks:
            b.__class__ = PrivateDropout
        return m

    ck.configure(None)
    PrivateDropout.gen.manual_seed(5)
    ref = _run(None, private_model(None))
    PrivateDropout.gen.manual_seed(5)
    got = _run(ck.checkpoint, private_model(ck.checkpoint))
    assert ref[0][0] == got[0][0]            # the first forward is the same ...
    assert ref[0][1:] != got[0][1:]          # ... the recompute's mask is not: caught

    orig = api.rng.replay
    api.rng.replay = lambda snapshot: contextlib.nullcontext()
    try:
        broken = _run(ck.checkpoint)
    finally:
        api.rng.replay = orig
    assert broken[0][0] == reference[0][0] and broken[0][1:] != reference[0][1:]


def test_cpu_checkpointing_at_tp1_parity_pool_and_bytes(reference):
    """Pa+cpu without model parallelism: every checkpoint in the host pool (no device bytes),
    copied out and back once per layer and step, and the pool allocates in step 1 only."""
    with pytest.warns(UserWarning, match="cpu_checkpointing"):  # no CUDA: host is the device
        ck.configure(None, checkpoint_in_cpu=True)
    seen = []
    got = _run(ck.checkpoint, observe=lambda: seen.append(ck.stats()))
    assert _same(got, reference)
    for s in seen:  # after each forward: N_LAYERS inputs, all in host memory
        assert s["checkpoints"] == N_LAYERS
        assert s["host_bytes"] == N_LAYERS * IN_BYTES and s["device_bytes"] == 0
    allocs = [s["pool_allocations"] for s in seen]
    assert allocs == [N_LAYERS] * STEPS, allocs  # bounded: nothing new after step 1
    end = ck.stats()
    assert end["copies_to_host"] == end["copies_from_host"] == N_LAYERS * STEPS
    assert end["checkpoints"] == 0 and end["host_bytes"] == 0
    assert end["pool_bytes"] == N_LAYERS * IN_BYTES


def test_contiguous_buffers_given_and_derived(reference):
    ck.configure(None, contiguous_checkpointing=True, num_checkpoints=N_LAYERS)
    seen = []  # (given: the buffers from the first forward on)
    got = _run(ck.checkpoint, observe=lambda: seen.append(ck.stats()))
    assert _same(got, reference)
    assert all(s["contiguous_bytes"] == N_LAYERS * IN_BYTES for s in seen)
    # num_checkpoints absent: derived from the first forward (DeepSpeed: IndexError)
    with pytest.warns(UserWarning, match="cpu_checkpointing"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {
            "contiguous_memory_optimization": True, "cpu_checkpointing": True}})
    seen = []
    got = _run(ck.checkpoint, observe=lambda: seen.append(ck.stats()))
    assert _same(got, reference)
    assert [s["contiguous_bytes"] for s in seen] == [0] + [N_LAYERS * IN_BYTES] * (STEPS - 1)
    assert all(s["host_bytes"] == N_LAYERS * IN_BYTES for s in seen)


def test_too_few_num_checkpoints_raises_before_anything_changes():
    ck.configure(None, contiguous_checkpointing=True, num_checkpoints=N_LAYERS - 1)
    model = Model(ck.get_cuda_rng_tracker(), ck.checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.model_parallel_cuda_manual_seed(RNG_SEED)
    x, _ = data(0)
    with pytest.raises(ValueError, match="number_checkpoints"):
        model(x)
    assert isinstance(ck.TooManyCheckpoints("x"), ValueError)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state
    # the forward's kept inputs are freed with its graph: a right configuration runs next
    ck.configure(None, contiguous_checkpointing=True, num_checkpoints=N_LAYERS)
    model(x).sum().backward()


def test_bad_input_warns_or_raises_before_any_change():
    ck.configure(None, checkpoint_in_cpu=False)
    state = api._STATE
    with pytest.warns(UserWarning, match="partition_activations"):
        ck.configure(None, partition_activations=True)  # no group: a documented no-op
    assert not api._STATE.store.split
    api._STATE = state
    for bad in ({"activation_checkpointing": {"partition_activation": True}},
                {"activation_checkpointing": {"number_checkpoints": 0}},
                {"activation_checkpointing": {"profile": "yes"}},
                {"activation_checkpointing": []}):
        with pytest.raises(ValueError, match="activation_checkpointing"):
            ck.configure(None, deepspeed_config=bad)
        assert api._STATE is state  # nothing changed
    with pytest.raises(ValueError, match="activation_checkpointing.partition_activation"):
        ck.configure(None, deepspeed_config={"activation_checkpointing": {
            "partition_activation": True}})
    with pytest.raises(ValueError, match="num_checkpoints"):
        ck.configure(None, num_checkpoints=0)
    with pytest.raises(TypeError, match="mpu_"):
        ck.configure(object())
    with pytest.raises(ValueError, match="not initialized"):
        ck.configure(_FakeMpu())  # an mpu, but no process group
    assert api._STATE is state


class _FakeMpu:
    def get_model_parallel_group(self):
        return None


def test_rng_tracker_semantics():
    ck.configure(None)
    tr = ck.get_cuda_rng_tracker()
    ck.model_parallel_cuda_manual_seed(11)
    default_after_seed = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(default_after_seed, torch.rand(3))  # the default stream: seed
    ck.model_parallel_cuda_manual_seed(11)
    torch.manual_seed(11 + 2718)
    want = torch.rand(3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tr.fork():
        assert torch.equal(torch.rand(3), want)  # the model-parallel stream: seed + 2718
    assert torch.equal(torch.get_rng_state(), before)  # the default stream untouched
    with tr.fork():
        assert not torch.equal(torch.rand(3), want)  # the state advanced
    with pytest.raises(ValueError, match="seed"):
        tr.add("other", 11 + 2718)
    with pytest.raises(KeyError, match="nope"):
        with tr.fork("nope"):
            pass
    states = tr.get_states()
    tr.set_states({})
    assert tr.get_states() == {}
    tr.set_states(states)


def test_non_reentrant_semantics():
    """As torch's use_reentrant=False: inputs without grad still give param grads,
    torch.autograd.grad works, keyword args and nested structures pass through."""
    ck.configure(None, checkpoint_in_cpu=False)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # requires no grad
    out = ck.checkpoint(lambda a, scale=1.0: {"y": lin(a) * scale}, x, scale=2.0)["y"]
    (g,) = torch.autograd.grad(out.sum(), [lin.weight])
    ref = torch.autograd.grad((lin(x) * 2.0).sum(), [lin.weight])[0]
    assert torch.equal(g, ref)
    with torch.no_grad():
        assert torch.equal(ck.checkpoint(lin, x), lin(x))
    assert ck.stats()["checkpoints"] == 0


def test_engine_config_section_is_parsed():
    from zerokern.engine import ConfigError, parse_config

    base = {"train_batch_size": 4}
    cfg = parse_config({**base, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True,
        "contiguous_memory_optimization": True, "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": False, "profile": True}}, 1)
    assert cfg.activation_checkpointing == {
        "partition_activations": True, "checkpoint_in_cpu": True,
        "contiguous_checkpointing": True, "num_checkpoints": 4, "synchronize": False,
        "profile": True}
    assert parse_config(base, 1).activation_checkpointing is None
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_offload"):
        parse_config({**base, "activation_checkpointing": {"cpu_offload": True}}, 1)


def test_initialize_configures_checkpointing():
    """A DeepSpeed config with activation_checkpointing runs unchanged: initialize
    configures zerokern.checkpointing with it; an unknown key raises before the model is
    touched."""
    import zerokern

    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 0},
           "activation_checkpointing": {"cpu_checkpointing": True,
                                        "contiguous_memory_optimization": True,
                                        "number_checkpoints": N_LAYERS}}
    model = Model(ck.get_cuda_rng_tracker(), ck.checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = copy.deepcopy(cfg)
    bad["activation_checkpointing"]["partition"] = True
    with pytest.raises(ValueError, match="activation_checkpointing.partition"):
        zerokern.initialize(model=model, config=bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine, *_ = zerokern.initialize(model=model, config=cfg)
    s = api._STATE.settings
    assert s.checkpoint_in_cpu and s.contiguous_checkpointing and s.num_checkpoints == N_LAYERS
    ck.model_parallel_cuda_manual_seed(RNG_SEED)
    for step in range(2):
        x, y = data(step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        assert ck.stats()["host_bytes"] == N_LAYERS * IN_BYTES
        engine.backward(loss)
        engine.step()
    assert ck.stats()["contiguous_bytes"] == N_LAYERS * IN_BYTES
