"""Stage 2's grads read where they lie (comm/pieces.py, [Note: grads read where they lie]).

- `Pieces` against a staging buffer built by hand (in process): pieces put out of order, gaps,
  bf16 pieces of a float32 reduction, a -0.0 against a gap; every slice reads, copies and adds
  with the staging buffer's bits. Pieces outside the range or overlapping raise.
- A reduce-scatter of Pieces through shared memory (small slots: many rounds, pieces split
  across them) and through the TCP ring (materialized) equals the same elements' reduce-scatter
  from one buffer, bit for bit, at N = 2 and 3.
- ZeroAdamW stages 2 and 3 through shared memory read their grads by reference from the first
  backward on and train to the same bits as with staging buffers (forced), at fp32 and bf16
  (reduced in bf16, and in fp32: bf16 pieces read converted), with
  two backward passes per step (the second accumulates; or the first under no_sync(), whose
  accumulator the synced one adds into in place and the exchange reads), a param that gets no
  grad on one rank, and (stage 2) params that straddle buckets. No staging buffer is
  allocated. The negative control: one wrong piece changes the params.
- A grad changed in place after zerokern took it (a user's hooks) raises at the backward's end;
  the same change on a clone, or before zerokern's hook, trains to the staging bits.
- torch.compile(model) (slow): read in place with the staging bits, no false alarm.
"""

import contextlib

import pytest
import torch
import torch.nn as nn

from zerokern.comm import GroupComm, shm
from zerokern.comm.pieces import Pieces

from ..support.harness import CaseError, cached, case, run_cases

N = 1000


def _buffer_and_pieces(dtype=torch.float32, piece_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    staged = torch.zeros(N, dtype=dtype)
    p = Pieces(N, dtype, torch.device("cpu"))
    spans = [(700, 810), (0, 3), (3, 250), (400, 699), (990, 1000)]  # out of order, gaps
    for lo, hi in spans:
        t = torch.randn(hi - lo, generator=g).to(piece_dtype)
        t[0] = -0.0
        p.put(lo, t)
        staged[lo:hi] = t.to(dtype)
    return staged, p


@pytest.mark.parametrize("piece_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pieces_read_copy_and_add_as_a_staging_buffer(piece_dtype):
    staged, p = _buffer_and_pieces(piece_dtype=piece_dtype)
    assert torch.equal(p.materialize(), staged)
    g = torch.Generator().manual_seed(1)
    theirs = torch.randn(N, generator=g)
    theirs[260] = -0.0  # inside a gap: 0.0 + -0.0 is +0.0 from a buffer
    for a, b in [(0, N), (0, 1), (2, 5), (249, 251), (250, 400), (500, 995), (999, N)]:
        dst = torch.full((b - a,), float("nan"))
        p.copy_to(dst, a)
        assert torch.equal(dst, staged[a:b]), (a, b)
        out = torch.full((b - a,), float("nan"))
        p.add_to(theirs[a:b], out, a)
        want = torch.add(staged[a:b], theirs[a:b])
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (a, b)  # signs too
    # the negative control: the same add with a piece missing differs
    bad = Pieces(N, torch.float32, torch.device("cpu"))
    bad.put(0, staged[:250])
    out = torch.empty(N)
    bad.add_to(theirs, out, 0)
    assert not torch.equal(out, staged + theirs)


def test_pieces_refuse_what_a_buffer_could_not_hold():
    p = Pieces(10, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside"):
        p.put(8, torch.zeros(3))
    with pytest.raises(ValueError, match="outside"):
        p.put(-1, torch.zeros(1))
    p.put(0, torch.zeros(5))
    p.put(4, torch.zeros(2))
    with pytest.raises(ValueError, match="overlap"):
        p.materialize()


def _reduce_scatters(rank, ws):
    shm.SLOT_BYTES = 4096  # 512-byte regions at N = 3: pieces cut across many rounds
    out = {}
    for mode in ("shm", "tcp"):
        comm = GroupComm()
        if mode == "tcp":
            comm.ring._shm = False
        for dt, pdt in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            n = ws * N
            staged = torch.zeros(n, dtype=dt)
            p = Pieces(n, dt, torch.device("cpu"))
            g = torch.Generator().manual_seed(10 + rank)
            lo = 5 * rank  # the ranks' pieces and gaps differ
            while lo < n - 7:
                hi = min(n, lo + int(torch.randint(1, 400, (1,), generator=g)))
                t = torch.randn(hi - lo, generator=g).to(pdt)
                p.put(lo, t)
                staged[lo:hi] = t.to(dt)
                lo = hi + int(torch.randint(0, 30, (1,), generator=g))
            a = torch.full((N,), float("nan"), dtype=dt)
            comm.reduce_scatter_(a, p)
            b = torch.full((N,), float("nan"), dtype=dt)
            comm.reduce_scatter_(b, staged)
            out[(mode, str(pdt))] = (a, b)
        out[(mode, "uses_shm")] = comm.ring.uses_shm
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_a_reduce_scatter_of_pieces_has_the_bits_of_one_buffer(ws):
    res = cached(_reduce_scatters, ws)
    for r in range(ws):
        assert res[r][("shm", "uses_shm")] and not res[r][("tcp", "uses_shm")]
        for key, got in res[r].items():
            if key[1] == "uses_shm":
                continue
            a, b = got
            assert not a.isnan().any()
            assert torch.equal(a, b), (r, key)


class _Net(nn.Module):
    """Linear layers of several sizes (small buckets: params straddle them) and one used only
    on rank 0 (a gap on the others)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in
                                    [(32, 48), (48, 40), (40, 64), (64, 32)])
        self.only_rank0 = nn.Linear(32, 32)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x, rank):
        h = x
        for m in self.layers:
            h = torch.tanh(m(h))
        return h.pow(2).mean() + (self.only_rank0(x).pow(2).mean() if rank == 0 else 0)


def _user_hooks(model, hook, before_optimizer):
    """A user's post-accumulate-grad hooks. On the last layer's weight (its grad arrives first),
    registered before the optimizer: "inplace" keeps p.grad, "clone" keeps a clone, "before"
    adds 0.5 to p.grad in place; they run before zerokern's hook takes the grad (so do hooks
    registered after it: [Note: the user's post-accumulate hooks run first], grad_sync.py).
    Registered after, on the first layer's weight (its grad arrives last, after zerokern took
    the last layer's): "inplace" and "clone" add 0.5 to what was kept, in place."""
    p, late = model.layers[3].weight, model.layers[0].weight
    kept = model.__dict__.setdefault("_kept", [])

    def shift(q):  # (an add, not a scale: Adam's step is nearly blind to a per-param scale)
        q.grad.add_(0.5)

    def keep(q):
        kept.append(q.grad if hook == "inplace" else q.grad.clone())

    def shift_kept(q):
        kept.pop().add_(0.5)

    if before_optimizer:
        p.register_post_accumulate_grad_hook(shift if hook == "before" else keep)
    elif hook in ("inplace", "clone"):
        late.register_post_accumulate_grad_hook(shift_kept)


@contextlib.contextmanager
def checked_at_the_end():
    """Every reduce-scatter of a backward left in flight until its end, where each held grad's
    version counter is checked. With the default two in flight the oldest is waited for (and
    checked) during the backward, so whether a change made later in it (_user_hooks' late hook)
    is found before the piece was read depends on the bucket order, rank by rank; a change
    after that is harmless (the piece was read before it) and not an error."""
    from zerokern.grads import sharded_grads
    from zerokern.stage3 import runtime
    saved = sharded_grads.MAX_IN_FLIGHT, runtime.MAX_IN_FLIGHT
    sharded_grads.MAX_IN_FLIGHT = runtime.MAX_IN_FLIGHT = 10**6
    try:
        yield
    finally:
        sharded_grads.MAX_IN_FLIGHT, runtime.MAX_IN_FLIGHT = saved


def _train(rank, ws, precision, by_ref, corrupt=False, stage=2, no_sync=False,
           reduce_dtype=None, hook=None, compiled=False, micro=2):
    import zerokern as zk
    from zerokern.comm import Comm
    from zerokern.grads import sharded_grads
    from zerokern.stage3 import runtime

    made = []

    class Counted(Pieces):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(1)

        def put(self, start, t, *args, **kwargs):  # (watch=: this change's; old code none)
            if corrupt and rank == 0 and len(made) == 3 and start == 0:
                t = t * 1.0001
            super().put(start, t, *args, **kwargs)

    sharded_grads.Pieces, saved = Counted, sharded_grads.Pieces
    runtime.Pieces = Counted
    reads = Comm.reads_pieces
    if not by_ref:
        Comm.reads_pieces = property(lambda self: False)
    stack = contextlib.ExitStack()
    if hook in ("inplace", "clone"):
        stack.enter_context(checked_at_the_end())
    try:
        model = _Net()
        if precision == "bf16":
            model.to(torch.bfloat16)
        if hook:
            _user_hooks(model, hook, before_optimizer=True)
        opt = zk.ZeroAdamW(model if stage == 3 else model.parameters(), lr=1e-2,
                           stage=stage, precision=precision, bucket_mb=0.004,
                           max_grad_norm=0.5, reduce_dtype=reduce_dtype)
        if hook:
            _user_hooks(model, hook, before_optimizer=False)
        forward = torch.compile(model) if compiled else model
        pooled = []
        for s in range(3):
            opt.zero_grad()
            for m in range(micro):  # two backward passes: the second accumulates
                g = torch.Generator().manual_seed(100 * s + 10 * m + rank)
                x = torch.randn(8, 32, generator=g).to(next(model.parameters()).dtype)
                if no_sync and m == 0:  # the synced one then adds into its accumulator
                    with opt.no_sync():
                        opt.backward(forward(x, rank))
                else:
                    opt.backward(forward(x, rank))
            opt.step()
            pool = opt.grad_sync._pool
            pooled.append(len(pool) if stage == 2 else sum(map(len, pool.values())))
        with opt.gathered_params():  # (stage 3: the params are empty outside it)
            params = [p.detach().clone() for p in model.parameters()]
        assert all(p.numel() > 0 for p in params)
        return {"params": params,
                "norm": float(opt.grad_norm), "pieces": len(made), "pooled": pooled,
                "buckets": opt.flat_groups[0].layout.n_buckets if stage == 2
                else len(opt.flat_groups)}
    finally:
        sharded_grads.Pieces = runtime.Pieces = saved
        Comm.reads_pieces = reads
        stack.close()


def _stages(rank, ws):
    cases = {}
    for stage in (2, 3):
        for precision in ("fp32", "bf16"):
            for by_ref in (True, False):
                cases[f"{stage}-{precision}-{by_ref}"] = (
                    lambda s=stage, p=precision, b=by_ref: _train(rank, ws, p, b, stage=s))
        for by_ref in (True, False):
            cases[f"{stage}-nosync-{by_ref}"] = (
                lambda s=stage, b=by_ref: _train(rank, ws, "fp32", b, stage=s, no_sync=True))
            # bf16 grads reduced in fp32: the pieces are read converted (exactly)
            cases[f"{stage}-bf16r32-{by_ref}"] = (
                lambda s=stage, b=by_ref: _train(rank, ws, "bf16", b, stage=s,
                                                 reduce_dtype=torch.float32))
    cases["corrupt"] = lambda: _train(rank, ws, "fp32", True, corrupt=True)
    for stage in (2, 3):  # a user's hooks (_user_hooks); "inplace" by reference raises.
        # One backward per step: at stages 2-3 accumulation under a post-accumulate hook is
        # refused ([Note: the user's post-accumulate hooks run first]).
        cases[f"{stage}-fp32-1b-False"] = (
            lambda s=stage: _train(rank, ws, "fp32", False, stage=s, micro=1))
        for hook in ("before", "clone", "inplace"):
            for by_ref in (True, False):
                cases[f"{stage}-hook-{hook}-{by_ref}"] = (
                    lambda s=stage, h=hook, b=by_ref: _train(rank, ws, "fp32", b, stage=s,
                                                             hook=h, micro=1))
    return run_cases(cases)


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_grads_read_by_reference_with_the_bits_of_staging(ws, stage):
    res = cached(_stages, ws)
    for mode in ("fp32", "bf16", "nosync", "bf16r32"):
        ref = case(res, f"{stage}-{mode}-True")
        staged = case(res, f"{stage}-{mode}-False")
        for r in range(ws):
            assert ref[r]["buckets"] > 4
            # every bucket of every synced backward (the exchange is set up at construction)
            synced = 3 if mode == "nosync" else 6
            assert ref[r]["pieces"] == synced * ref[r]["buckets"], ref[r]
            assert ref[r]["pooled"] == [0, 0, 0]  # no staging buffer, ever
            assert staged[r]["pooled"][-1] > 0  # (the control: staging buffers pooled)
            assert staged[r]["pieces"] == 0
            for a, b in zip(ref[r]["params"], staged[r]["params"]):
                assert torch.equal(a, b), mode
            assert ref[r]["norm"] == staged[r]["norm"]
    bad = case(res, "corrupt")
    assert any(not torch.equal(a, b) for a, b in zip(bad[0]["params"],
                                                     case(res, "2-fp32-True")[0]["params"]))


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_grad_changed_in_place_after_it_was_taken_raises(ws, stage):
    """[Note: grads read where they lie]: a user's hook keeps p.grad before zerokern's hook takes
    it and a later hook changes it in place. Staging copied the grad when it arrived (the change
    never reached the sum, as under DDP); read by reference the change would be in the sum or
    not by timing, so the backward raises, naming the change, before any step. Controls: the
    same change on a clone, and an in-place change before zerokern's hook took the grad, train
    to the staging run's bits (and the latter changes the params: the hook acts)."""
    res = cached(_stages, ws)
    for r in range(ws):
        err = res[r][f"{stage}-hook-inplace-True"]
        assert isinstance(err, CaseError), err
        assert "was changed in place after zerokern took it" in err.tb, err.tb
    staged_inplace = case(res, f"{stage}-hook-inplace-False")
    for hook in ("before", "clone"):
        ref = case(res, f"{stage}-hook-{hook}-True")
        staged = case(res, f"{stage}-hook-{hook}-False")
        for r in range(ws):
            assert ref[r]["pieces"] > 0 and staged[r]["pieces"] == 0
            for a, b in zip(ref[r]["params"], staged[r]["params"]):
                assert torch.equal(a, b), hook
    plain = case(res, f"{stage}-fp32-1b-False")
    for r in range(ws):  # the clone's change and the kept grad's change never reach the sum
        for a, b, c in zip(case(res, f"{stage}-hook-clone-False")[r]["params"],
                           staged_inplace[r]["params"], plain[r]["params"]):
            assert torch.equal(a, c) and torch.equal(b, c)
        assert any(not torch.equal(a, c) for a, c in  # the in-place change before: it acts
                   zip(case(res, f"{stage}-hook-before-True")[r]["params"], plain[r]["params"]))


def _compiled(rank, ws):
    return run_cases({f"{stage}-{by_ref}": (lambda s=stage, b=by_ref: _train(
        rank, ws, "fp32", b, stage=s, compiled=True)) for stage in (2, 3) for by_ref in (True, False)})


@pytest.mark.slow  # torch.compile: ~20 s for the group here (the default run's budget)
def test_compiled_model_grads_read_by_reference_with_the_bits_of_staging():
    """torch.compile(model) (its backward compiled too): the grads AccumulateGrad hands over are
    read where they lie, with the staging run's bits and no in-place alarm (nothing changes
    them)."""
    res = cached(_compiled, 2)
    for stage in (2, 3):
        ref, staged = case(res, f"{stage}-True"), case(res, f"{stage}-False")
        for r in range(2):
            assert ref[r]["pieces"] > 0 and staged[r]["pieces"] == 0
            for a, b in zip(ref[r]["params"], staged[r]["params"]):
                assert torch.equal(a, b), stage
