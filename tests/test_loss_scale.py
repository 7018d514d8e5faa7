"""Device-side loss scaler: GradScaler / DeepSpeed equivalence, no-sync, checkpoints, validation."""

import math
import random

import pytest
import torch

from zerokern.core.loss_scale import DynamicLossScaler, LossScaler, make_loss_scaler

BITS = torch.int32  # compare fp32 scales bitwise through an int32 view


def _bits(t):
    return t.detach().reshape(1).view(BITS).clone() if t.dtype == torch.float32 else t.clone()


def _overflow_stream(seed, scale_of, target=16.0):
    """Seeded random overflows whose rate rises with the current scale, so long runs keep
    exercising growth and back-off instead of drifting to 0 or inf. The offset to the target
    changes every 250 steps (quiet and stormy phases)."""
    rng = random.Random(seed)
    step, offset = 0, 0.0
    while True:
        if step % 250 == 0:
            offset = rng.uniform(-6.0, 6.0)
        x = math.log2(max(scale_of(), 1e-30)) - target + offset
        yield rng.random() < 1 / (1 + math.exp(-x))
        step += 1


# ---------------------------------------------------------------- references (plain Python)

class DeepSpeedRef:
    """Plain-Python transcription of DeepSpeed DynamicLossScaler.update_scale
    (deepspeed/runtime/fp16/loss_scaler.py, microsoft/DeepSpeed @ 0336518), with
    consecutive_hysteresis=False and raise_error_at_min_scale=False. DeepSpeed uses one
    scale_factor for both directions (x2 / /2)."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, scale_factor=2.0):
        self.cur_scale, self.scale_window, self.min_scale = init_scale, scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.scale_factor, self.cur_iter, self.last_overflow_iter = scale_factor, 0, -1

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class DeepSpeedRefResetOnBackoff(DeepSpeedRef):
    """WRONG on purpose: refills hysteresis after every back-off."""

    def update_scale(self, overflow):
        backs_off = overflow and self.cur_hysteresis <= 1
        super().update_scale(overflow)
        if backs_off:
            self.cur_hysteresis = self.delayed_shift


class DeepSpeedRefLateGrowth(DeepSpeedRef):
    """WRONG on purpose (relative to GradScaler): newer DeepSpeed's `stable_interval` form,
    which grows after scale_window + 1 clean steps."""

    def update_scale(self, overflow):
        if overflow:
            return super().update_scale(overflow)
        stable = self.cur_iter - self.last_overflow_iter - 1
        if stable > 0 and stable % self.scale_window == 0:
            self.cur_hysteresis, self.cur_scale = self.delayed_shift, self.cur_scale * 2
        self.cur_iter += 1


def first_mismatch_vs_deepspeed(ref_cls, hysteresis, steps, seed, min_scale=2.0**10, window=4):
    """Index of the first step where the scaler and `ref_cls` disagree, or None."""
    ours = DynamicLossScaler("cpu", init_scale=2.0**16, growth_interval=window,
                             min_scale=min_scale, hysteresis=hysteresis)
    ref = ref_cls(2.0**16, window, min_scale, hysteresis)
    stats = {"grow": 0, "back": 0, "absorbed": 0, "clamped": 0}
    for i, f in zip(range(steps), _overflow_stream(seed, lambda: ref.cur_scale)):
        before, hyst_before = ref.cur_scale, ref.cur_hysteresis
        ref.update_scale(f)
        ours.update_(torch.tensor(f))
        stats["grow"] += ref.cur_scale > before
        stats["back"] += f and ref.cur_scale < before
        stats["absorbed"] += f and ref.cur_hysteresis < hyst_before
        stats["clamped"] += f and before == min_scale
        if ours.scale.item() != ref.cur_scale or ours.hysteresis_left.item() != ref.cur_hysteresis:
            return i, stats
    return None, stats


# ---------------------------------------------------------------- GradScaler equivalence

@pytest.mark.parametrize("interval,growth,backoff,seed", [
    (3, 2.0, 0.5, 0), (5, 2.0, 0.5, 1), (7, 2.0, 0.5, 2), (4, 3.0, 0.3, 3), (6, 1.7, 0.77, 4)])
def test_matches_amp_update_scale(interval, growth, backoff, seed):
    ours = DynamicLossScaler("cpu", init_scale=2.0**16, growth_factor=growth,
                             backoff_factor=backoff, growth_interval=interval,
                             min_scale=2.0**-100)
    ref_scale = torch.full((), 2.0**16)
    ref_tracker = torch.zeros((), dtype=torch.int32)
    n_found, n_grow, seen = 0, 0, set()
    for i, f in zip(range(5000), _overflow_stream(seed, ref_scale.item)):
        n_found, before = n_found + f, ref_scale.item()
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(float(f)), growth,
                                 backoff, interval)
        ours.update_(torch.tensor(f))
        # fp32 == is bitwise here: scales are positive, never NaN or -0.
        now = ref_scale.item()
        assert ours.scale.item() == now and ours.growth_tracker.item() == ref_tracker.item(), i
        seen.add(now)
        n_grow += now > before
    assert n_found > 200 and n_grow > 200 and len(seen) > 10  # non-trivial pattern
    assert min(seen) > 2.0**-100  # min_scale never bound, so GradScaler (no floor) applies


def test_matches_real_gradscaler():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    ours = DynamicLossScaler("cpu", init_scale=2.0**16, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    for i, f in zip(range(200), _overflow_stream(7, scaler.get_scale)):
        scaler.scale(torch.ones(()))  # lazily creates GradScaler's device state
        p.grad = torch.full((4,), float("inf") if f else 1.0)
        scaler.step(opt)
        scaler.update()
        ours.update_(torch.tensor(f))
        assert ours.scale.item() == scaler.get_scale(), i


# ---------------------------------------------------------------- DeepSpeed hysteresis

@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_matches_deepspeed_hysteresis(hysteresis):
    idx, stats = first_mismatch_vs_deepspeed(DeepSpeedRef, hysteresis, 3000, seed=10 + hysteresis)
    assert idx is None, f"diverged at step {idx}"
    assert stats["grow"] > 50 and stats["back"] > 50 and stats["clamped"] > 5
    assert (stats["absorbed"] > 50) == (hysteresis > 1)


@pytest.mark.parametrize("wrong", [DeepSpeedRefResetOnBackoff, DeepSpeedRefLateGrowth])
def test_negative_control_wrong_transcription_is_detected(wrong):
    idx, _ = first_mismatch_vs_deepspeed(wrong, 2, 3000, seed=12)
    assert idx is not None


def test_negative_control_wrong_gradscaler_factor_is_detected():
    # A backoff of 0.25 instead of 0.5 must show up in the same harness as the equivalence test.
    ours = DynamicLossScaler("cpu", growth_interval=3, min_scale=2.0**-100)
    ref_scale, ref_tracker = torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32)
    diverged = False
    for _, f in zip(range(200), _overflow_stream(3, ref_scale.item)):
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor(float(f)), 2.0, 0.25, 3)
        ours.update_(torch.tensor(f))
        diverged |= not torch.equal(_bits(ours.scale), _bits(ref_scale))
    assert diverged


# ---------------------------------------------------------------- edge rules

def test_min_scale_clamp_and_hit_min_scale():
    s = DynamicLossScaler("cpu", init_scale=8.0, min_scale=3.0, growth_interval=100)
    seq = []
    for _ in range(4):
        s.update_(torch.tensor(True))
        seq.append((s.scale.item(), s.hit_min_scale()))
    # 8 -> 4 -> 3 (clamped, not 2); the overflow *at* the floor is the one that is reported.
    assert seq == [(4.0, False), (3.0, False), (3.0, True), (3.0, True)]
    s.update_(torch.tensor(False))
    assert not s.hit_min_scale()  # not sticky


def test_growth_inf_guard():
    top = torch.finfo(torch.float32).max
    for init in (2.0**127, top / 1.5):
        s = DynamicLossScaler("cpu", init_scale=init, growth_interval=2)
        before = _bits(s.scale)
        s.update_(torch.tensor(False))
        s.update_(torch.tensor(False))
        assert torch.equal(_bits(s.scale), before) and s.growth_tracker.item() == 0
        ref, tr = torch.full((), init), torch.zeros((), dtype=torch.int32)
        for _ in range(2):
            torch._amp_update_scale_(ref, tr, torch.zeros(()), 2.0, 0.5, 2)
        assert torch.equal(_bits(ref), before)


def test_found_inf_float_and_bad_found_inf():
    s = DynamicLossScaler("cpu", init_scale=8.0)
    s.update_(torch.ones(1))  # GradScaler-style float, one element
    assert s.scale.item() == 4.0
    with pytest.raises(ValueError, match="found_inf"):
        s.update_(torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="found_inf"):
        s.update_(torch.zeros((), dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="found_inf"):
        s.update_(True)


def test_static_scaler():
    s = LossScaler(128.0, "cpu")
    ref = s.scale
    s.update_(torch.tensor(True))
    assert s.scale is ref and s.scale.item() == 128.0 and s.scale.dtype == torch.float32
    assert not s.hit_min_scale() and not s.dynamic
    t = LossScaler(1.0, "cpu")
    t.load_state_dict(s.state_dict())
    assert t.scale.item() == 128.0


# ---------------------------------------------------------------- no host sync

def test_update_does_not_sync(monkeypatch):
    s = DynamicLossScaler("cpu", growth_interval=3, hysteresis=2)
    found = [torch.tensor(bool(b)) for b in torch.randint(0, 2, (60,),
                                                          generator=torch.Generator().manual_seed(5))]
    ptrs = [t.data_ptr() for t in (s.scale, s.growth_tracker, s.hysteresis_left)]

    def boom(*a, **k):
        raise AssertionError("host sync / host->device copy in update_")

    with monkeypatch.context() as m:
        for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__",
                     "__index__"):
            m.setattr(torch.Tensor, name, boom)
        m.setattr(torch, "tensor", boom)
        m.setattr(torch.cuda, "synchronize", boom)
        for f in found:
            s.update_(f)
    # restored: the patched methods work again, and the state tensors were never replaced
    assert s.scale.item() > 0 and bool(torch.tensor(True))
    assert ptrs == [t.data_ptr() for t in (s.scale, s.growth_tracker, s.hysteresis_left)]


# ---------------------------------------------------------------- checkpoints

def test_state_dict_round_trip_and_continuation():
    kw = dict(init_scale=2.0**16, growth_factor=3.0, backoff_factor=0.3, growth_interval=5,
              hysteresis=3, min_scale=1.0)
    a = DynamicLossScaler("cpu", **kw)
    stream = _overflow_stream(21, a.scale.item)
    for _, f in zip(range(137), stream):
        a.update_(torch.tensor(f))
    sd = a.state_dict()
    assert {k: v.device.type for k, v in sd.items() if k != "kind"} == dict.fromkeys(
        ("scale", "growth_tracker", "hysteresis_left"), "cpu")
    assert sd["scale"].data_ptr() != a.scale.data_ptr()  # a snapshot, not a view
    b = DynamicLossScaler("cpu", **kw)
    b_ptr = b.scale.data_ptr()
    b.load_state_dict(sd)
    assert b.scale.data_ptr() == b_ptr  # copied in place
    for name in ("scale", "growth_tracker", "hysteresis_left"):
        assert torch.equal(_bits(getattr(a, name)), _bits(getattr(b, name)))
    for i, f in zip(range(500), stream):
        a.update_(torch.tensor(f))
        b.update_(torch.tensor(f))
        for name in ("scale", "growth_tracker", "hysteresis_left"):
            assert torch.equal(_bits(getattr(a, name)), _bits(getattr(b, name))), (i, name)
    sd["scale"].fill_(5.0)  # mutating the snapshot does not touch the scaler
    assert a.scale.item() != 5.0 or a.state_dict()["scale"].item() == a.scale.item()


def test_load_state_dict_rejects_bad_input_before_changing_state():
    a = DynamicLossScaler("cpu", init_scale=64.0)
    with pytest.raises(ValueError, match="state_dict"):
        a.load_state_dict(LossScaler(2.0, "cpu").state_dict())
    sd = DynamicLossScaler("cpu", init_scale=2.0).state_dict()
    sd["hysteresis_left"] = sd["hysteresis_left"].float()
    with pytest.raises(ValueError, match="hysteresis_left"):
        a.load_state_dict(sd)
    assert a.scale.item() == 64.0  # scale (checked first, valid) was not copied


# ---------------------------------------------------------------- make_loss_scaler

def test_make_loss_scaler_choices():
    d = make_loss_scaler("dynamic", "fp16", "cpu")
    assert type(d) is DynamicLossScaler and d.scale.item() == 2.0**16
    assert d.growth_interval == 2000 and d.min_scale == 1.0 and d.hysteresis == 1
    assert type(make_loss_scaler(None, "fp16", "cpu")) is DynamicLossScaler
    s = make_loss_scaler(1024, "fp16", "cpu")
    assert type(s) is LossScaler and s.scale.item() == 1024.0
    for prec in ("bf16", "fp32"):
        for default in ("dynamic", None):
            one = make_loss_scaler(default, prec, "cpu")
            assert type(one) is LossScaler and one.scale.item() == 1.0
        assert make_loss_scaler(8.0, prec, "cpu").scale.item() == 8.0
    k = make_loss_scaler({"init_scale": 1024, "hysteresis": 2}, "fp16", "cpu")
    assert k.scale.item() == 1024.0 and k.hysteresis_left.item() == 2


@pytest.mark.parametrize("loss_scale,precision,exc,words", [
    (0.0, "fp16", ValueError, ["loss_scale", "positive"]),
    (-4, "fp16", ValueError, ["loss_scale", "positive"]),
    (float("inf"), "fp16", ValueError, ["loss_scale", "finite"]),
    (float("nan"), "bf16", ValueError, ["loss_scale", "finite"]),
    (1e39, "fp16", ValueError, ["loss_scale", "float32"]),
    (1e-50, "fp16", ValueError, ["loss_scale", "float32"]),
    (True, "fp16", TypeError, ["loss_scale", "real number"]),
    ([2.0], "fp16", TypeError, ["loss_scale"]),
    ("static", "fp16", ValueError, ["loss_scale", "'dynamic'"]),
    ("Dynamic", "bf16", ValueError, ["loss_scale", "'dynamic'"]),
    ({"init_scale": 8}, "bf16", ValueError, ["loss_scale", "fp16"]),
    ({"scale_window": 8}, "fp16", ValueError, ["loss_scale", "scale_window", "growth_interval"]),
    ({"growth_factor": 1.0}, "fp16", ValueError, ["loss_scale", "growth_factor", "> 1"]),
    ({"growth_factor": 0.5}, "fp16", ValueError, ["growth_factor", "> 1"]),
    ({"backoff_factor": 1.0}, "fp16", ValueError, ["loss_scale", "backoff_factor", "(0, 1)"]),
    ({"backoff_factor": 0.0}, "fp16", ValueError, ["backoff_factor", "(0, 1)"]),
    ({"growth_interval": 0}, "fp16", ValueError, ["loss_scale", "growth_interval", ">= 1"]),
    ({"growth_interval": 2.5}, "fp16", TypeError, ["growth_interval", "int"]),
    ({"hysteresis": 0}, "fp16", ValueError, ["loss_scale", "hysteresis", ">= 1"]),
    ({"min_scale": 0.0}, "fp16", ValueError, ["loss_scale", "min_scale", "positive"]),
    ({"min_scale": 2.0**17}, "fp16", ValueError, ["min_scale", "init_scale"]),
    ({"init_scale": -1.0}, "fp16", ValueError, ["loss_scale", "init_scale", "positive"]),
    ("dynamic", "fp8", ValueError, ["precision", "fp16", "bf16", "fp32"]),
    ("dynamic", None, ValueError, ["precision"]),
])
def test_make_loss_scaler_rejects(loss_scale, precision, exc, words):
    with pytest.raises(exc) as info:
        make_loss_scaler(loss_scale, precision, "cpu")
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_dynamic_constructor_names_kwarg():
    with pytest.raises(ValueError, match="^growth_interval"):
        DynamicLossScaler("cpu", growth_interval=0)
    with pytest.raises(ValueError, match="^scale"):
        LossScaler(0.0, "cpu")


# ---------------------------------------------------------------- CUDA (skipped without a GPU)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_amp_update_scale_and_pinned_diagnostic():
    dev = torch.device("cuda")
    ours = DynamicLossScaler(dev, init_scale=2.0**16, growth_factor=3.0, backoff_factor=0.3,
                             growth_interval=4, min_scale=2.0**-100)
    assert ours._hit_host.is_pinned() and ours.scale.device.type == "cuda"
    ref_scale = torch.full((), 2.0**16, device=dev)
    ref_tracker = torch.zeros((), dtype=torch.int32, device=dev)
    found = torch.rand(1000, generator=torch.Generator().manual_seed(9)) < 0.3
    found_dev = found.to(dev)
    for i in range(1000):
        torch._amp_update_scale_(ref_scale, ref_tracker, found_dev[i].float(), 3.0, 0.3, 4)
        ours.update_(found_dev[i])
    assert torch.equal(_bits(ours.scale), _bits(ref_scale))
    assert torch.equal(ours.growth_tracker, ref_tracker)
    floor = DynamicLossScaler(dev, init_scale=2.0, min_scale=2.0)
    floor.update_(torch.ones((), dtype=torch.bool, device=dev))
    torch.cuda.synchronize()  # the diagnostic may lag until the queued copy lands
    assert floor.hit_min_scale() and floor.scale.item() == 2.0
