"""The kernels as torch custom ops (torch.ops.zerokern.*, kernels/custom_ops.py; issue 34 item 1).

Under FakeTensorMode on fake `cuda` tensors (a CPU-only machine) every public kernel entry point
runs its op's fake impl: no Triton launch and no native op (both trapped), the buffers keep their
shapes, dtypes and devices, the ops that make tensors return the right ones. Negative controls:
the trap catches a real launch; a tensor on another device raises, through the entry points and
through the ops themselves (their fake impls). torch.library.opcheck on each op with CPU tensors
(reference and cpu backends; the compact step under the interpreter), and torch.compile
(fullgraph) of adam_step_ / grad_stats_ on CPU tensors: the op is in the graph, the results
are bitwise the eager ones. No autograd on fake cuda tensors here (a CPU-only build has no CUDA
device guard for it).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from zerokern import kernels as zk
from zerokern.kernels import adamw8bit as A
from zerokern.kernels import blockquant as B
from zerokern.kernels import build, dispatch, native
from zerokern.kernels import lion as L
from zerokern.kernels.quant8 import BLOCK

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LION_HP = dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
OPS = ["adam_step_", "grad_stats_", "adamw8bit_step_", "lion_step_", "compact_adam_step_",
       "blockquant_quantize", "blockquant_dequantize"]
FAKE_BACKENDS = ["auto", "triton", "cuda", "reference"]


class Launched(AssertionError):
    pass


@pytest.fixture
def no_launch(monkeypatch):
    """Any Triton launch (compiled or interpreted) or native op load raises `Launched`."""
    import triton.runtime.jit as J

    def trap(*a, **k):
        raise Launched("a kernel was launched")

    monkeypatch.setattr(J.JITFunction, "run", trap)
    try:
        from triton.runtime.interpreter import InterpretedFunction
        monkeypatch.setattr(InterpretedFunction, "run", trap)
    except ImportError:
        pass
    monkeypatch.setattr(build, "load_op", trap)
    monkeypatch.setattr(native, "load_op", trap)
    monkeypatch.setattr(zk, "load_op", trap)


def _scalars(dev, step_dtype=torch.int64):
    return dict(step=torch.zeros((), dtype=step_dtype, device=dev),
                grad_scale=torch.ones((), device=dev),
                found_inf=torch.zeros((), dtype=torch.bool, device=dev))


def _meta(t):
    return (tuple(t.shape), t.dtype, t.device)


def _all_fake_on(ts, dev):
    for t in ts:
        assert isinstance(t, FakeTensor)
        assert t.device == (torch.device(dev, 0) if dev == "cuda" else torch.device(dev))


def _fake_cuda_slicing_works() -> bool:
    """`t[a:b]` on a fake cuda tensor needs a CUDA device guard, which a CPU-only build lacks
    ("PyTorch is not linked with support for cuda devices"); view/reshape/narrow do not."""
    try:
        with FakeTensorMode():
            torch.zeros(4, device="cuda")[1:3]
        return True
    except RuntimeError:
        return False


def _slicing_device(dev: str) -> str:
    if dev == "cuda" and not _fake_cuda_slicing_works():
        pytest.skip("slicing fake cuda tensors needs a CUDA device guard (CPU-only torch build)")
    return dev


# ------------------------------------------------------------------ registration -----------

def test_every_op_is_registered_with_its_mutations():
    mutated = {
        "adam_step_": {"master", "exp_avg", "exp_avg_sq", "param_out", "step"},
        "grad_stats_": {"found_inf", "sumsq"},
        "adamw8bit_step_": {"master", "m_q", "m_absmax", "v_q", "v_absmax", "param_out",
                            "step"},
        "lion_step_": {"master", "exp_avg", "param_out", "step"},
        "compact_adam_step_": {"low", "ties", "param", "exp_avg", "exp_avg_sq", "nan", "step"},
        "blockquant_quantize": set(),
        "blockquant_dequantize": set(),
    }
    for name in OPS:
        schema = getattr(torch.ops.zerokern, name).default._schema
        got = {a.name for a in schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
        assert got == mutated[name], name


def test_trap_catches_a_real_launch(no_launch):
    """Negative control for `no_launch`: real CPU tensors do reach the kernels."""
    n = 64
    bufs = [torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n)]
    for backend in ("cpu", "triton"):
        if backend == "triton" and not dispatch._interpreting():
            continue
        with pytest.raises(Launched):
            zk.adam_step_(*bufs, **HP, **_scalars("cpu"), backend=backend)


# ------------------------------------------------------------------ fake cuda tensors -------

@pytest.mark.parametrize("backend", FAKE_BACKENDS)
@pytest.mark.parametrize("odt", [None, torch.bfloat16, torch.float16], ids=["none", "bf16", "f16"])
@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
def test_adam_step_on_fake_cuda(no_launch, backend, odt, tensor_lr):
    with FakeTensorMode():
        n, d = 1000, "cuda"
        m, a, v = (torch.zeros(n, device=d) for _ in range(3))
        g = torch.zeros(n, device=d, dtype=torch.bfloat16)
        out = None if odt is None else torch.empty(n, device=d, dtype=odt)
        hp = dict(HP, lr=torch.tensor(1e-3, device=d)) if tensor_lr else HP
        sc = _scalars(d)
        before = [_meta(t) for t in (m, a, v, g)]
        zk.adam_step_(m, a, v, g, out, **hp, **sc, backend=backend)
        assert [_meta(t) for t in (m, a, v, g)] == before
        _all_fake_on([m, a, v, g, *sc.values()] + ([out] if out is not None else []), d)


@pytest.mark.parametrize("backend", FAKE_BACKENDS)
def test_grad_stats_on_fake_cuda(no_launch, backend):
    with FakeTensorMode():
        g = torch.zeros(3, 333, device="cuda", dtype=torch.float16)
        found = torch.zeros((), dtype=torch.bool, device="cuda")
        sumsq = torch.zeros((), dtype=torch.float64, device="cuda")
        zk.grad_stats_(g, found, sumsq, backend=backend)
        assert _meta(found) == ((), torch.bool, torch.device("cuda:0"))
        assert _meta(sumsq) == ((), torch.float64, torch.device("cuda:0"))


@pytest.mark.parametrize("backend", FAKE_BACKENDS)
@pytest.mark.parametrize("odt", [None, torch.bfloat16], ids=["none", "bf16"])
def test_adamw8bit_step_on_fake_cuda(no_launch, backend, odt):
    with FakeTensorMode():
        n, d = BLOCK * 5, "cuda"
        m = torch.zeros(n, device=d)
        mq, vq = (torch.zeros(n, dtype=torch.uint8, device=d) for _ in range(2))
        ma, va = (torch.zeros(n // BLOCK, device=d) for _ in range(2))
        g = torch.zeros(n, device=d)
        out = None if odt is None else torch.empty(n, device=d, dtype=odt)
        A.adamw8bit_step_(m, mq, ma, vq, va, g, out, **HP, **_scalars(d), backend=backend)
        assert [_meta(t) for t in (m, mq, ma)] == [
            ((n,), torch.float32, torch.device("cuda:0")),
            ((n,), torch.uint8, torch.device("cuda:0")),
            ((n // BLOCK,), torch.float32, torch.device("cuda:0"))]


@pytest.mark.parametrize("backend", FAKE_BACKENDS)
@pytest.mark.parametrize("odt", [None, torch.float16], ids=["none", "f16"])
def test_lion_step_on_fake_cuda(no_launch, backend, odt):
    with FakeTensorMode():
        n, d = 777, "cuda"
        m, e, g = (torch.zeros(n, device=d) for _ in range(3))
        out = None if odt is None else torch.empty(n, device=d, dtype=odt)
        L.lion_step_(m, e, g, out, **LION_HP, **_scalars(d), backend=backend)
        _all_fake_on([m, e, g], d)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockquant_codec_on_fake_cuda(no_launch, bits, dtype):
    codec = B.codec_for(torch.device("cuda"), "auto")
    assert isinstance(codec, B.OpCodec)
    with FakeTensorMode():
        n, block = 128 * 6, 64
        x = torch.zeros(n, device="cuda", dtype=dtype)
        codes, scale = codec.quantize(x, block, bits)
        assert _meta(codes) == ((n if bits == 8 else n // 2,),
                                torch.int8 if bits == 8 else torch.uint8, torch.device("cuda:0"))
        assert _meta(scale) == ((n // block,), torch.float32, torch.device("cuda:0"))
        y = codec.dequantize(codes, scale, block, bits, dtype)
        assert _meta(y) == ((n,), dtype, torch.device("cuda:0"))
        with pytest.raises(ValueError, match="multiple of block"):
            codec.quantize(torch.zeros(100, device="cuda"), block, bits)


class _Group:
    """The three methods of a flat group CompactState.update_piece reads (one bucket)."""

    def __init__(self, param):
        self.param = param

    def state_slice(self, k):
        return slice(0, self.param.numel())

    def state_range(self, k):
        return 0, self.param.numel()

    def param_values(self, a, b):
        return self.param[a:b]


@pytest.mark.parametrize("dev", ["cuda", "cpu"])
def test_compact_step_call_site_on_fake_tensors(no_launch, dev):
    """CompactState.update_piece's fused path takes the op. It slices its buffers, which fake
    cuda tensors allow only with a device guard: else fake CPU tensors with backend="triton"
    (the interpreter resolves it) stand in, the same call site."""
    from zerokern.rules.adamw import ADAMW
    from zerokern.state.compact_master import CompactState

    _slicing_device(dev)
    if dev == "cpu" and not dispatch._interpreting():
        pytest.skip("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
    with FakeTensorMode():
        n = 1024
        st = CompactState.__new__(CompactState)
        st.rule = ADAMW
        st.low = torch.zeros(n, dtype=torch.int16, device=dev)
        st.ties = torch.zeros(n // 8, dtype=torch.uint8, device=dev)
        st.states = {"exp_avg": torch.zeros(n, device=dev),
                     "exp_avg_sq": torch.zeros(n, device=dev)}
        st.index_states(ADAMW)
        st.steps = torch.zeros(1, dtype=torch.int64, device=dev)
        st._nan = None
        st.compact_pieces = 0
        g = _Group(torch.zeros(n, dtype=torch.bfloat16, device=dev))
        sc = _scalars(dev)
        hyper = ADAMW.hyper(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                 adamw=True))
        st.update_piece(g, 0, torch.zeros(n, dtype=torch.bfloat16, device=dev), hyper,
                        "triton", sc["grad_scale"], sc["found_inf"], None)
        assert st.compact_pieces == 1  # the fused (op) path, not the chunked one
        _all_fake_on([st.low, st.ties, st._nan, g.param], dev)


def test_fake_cpu_tensors_never_reach_the_native_ops(no_launch):
    """backend="cpu" on fake CPU tensors: the fake impl, never the C++ op (a null data_ptr)."""
    with FakeTensorMode():
        n = 256
        bufs = [torch.zeros(n) for _ in range(4)]
        zk.adam_step_(*bufs, **HP, **_scalars("cpu"), backend="cpu")
        zk.grad_stats_(bufs[3], torch.zeros((), dtype=torch.bool), torch.zeros(()),
                       backend="cpu")
        codec = B.NativeCodec(op=None)  # codec_for("cpu") would load the (trapped) op
        codes, scale = codec.quantize(bufs[0], 128, 8)
        assert _meta(codes) == ((n,), torch.int8, torch.device("cpu"))
        assert _meta(codec.dequantize(codes, scale, 128, 8, torch.float16)) == (
            (n,), torch.float16, torch.device("cpu"))


@pytest.mark.parametrize("dev", ["cuda", "cpu"])
def test_muon_pieces_on_fake_tensors(no_launch, dev):
    """Muon's phases are plain torch ops: they run on fake tensors as they are, no op needed.
    momentum_ runs on fake cuda tensors always; apply_ and the orthogonalizer slice, so on
    fake cuda they need a CUDA device guard (see _fake_cuda_slicing_works)."""
    from zerokern.geometry.partition import ALIGN, make_layout
    from zerokern.rules.muon_orthogonalize import ShardedOrthogonalizer
    from zerokern.rules.muon_pieces import apply_, momentum_

    shapes = [(40, 24), (96, 33)]
    layout = make_layout(shapes, 1, 2 * ALIGN)
    segs = [(s.offset, s.offset + s.numel, (s.shape[0], s.numel // s.shape[0]))
            for s in layout.slots]
    with FakeTensorMode():
        master = torch.zeros(layout.padded_numel, device=dev)
        buf, g = torch.zeros_like(master), torch.zeros_like(master)
        found = torch.zeros((), dtype=torch.bool, device=dev)
        upd = momentum_(buf, g, momentum=0.95, nesterov=True, found_inf=found,
                        grad_scale=torch.ones((), device=dev))
        _all_fake_on([buf, upd], dev)
        _slicing_device(dev)
        orth = ShardedOrthogonalizer(layout, 0, 1, False, range(len(shapes)), None,
                                     (3.4445, -4.7750, 2.0315), 5, 1e-7)
        orth.orthogonalize_(upd)
        apply_(master, upd, segs, lr=0.02, weight_decay=0.1, adjust_lr_fn=None, found_inf=found)
        _all_fake_on([master, buf, upd], dev)


# ------------------------------------------------------------------ wrong devices -----------

def test_wrong_device_raises_through_the_entry_points(no_launch):
    with FakeTensorMode():
        n, d = 256, "cuda"
        m, a, v = (torch.zeros(n, device=d) for _ in range(3))
        sc = _scalars(d)
        with pytest.raises(ValueError, match="grad is on"):
            zk.adam_step_(m, a, v, torch.zeros(n, device="cuda:1"), **HP, **sc)
        with pytest.raises(ValueError, match="found_inf is on"):
            zk.adam_step_(m, a, v, torch.zeros(n, device=d), **HP,
                          **dict(sc, found_inf=torch.zeros((), dtype=torch.bool)))


def test_overlap_check_on_fake_tensors(no_launch):
    """FakeTensors have no data pointers (all 0): distinct fake buffers pass the overlap check,
    overlapping views of one fake buffer are still caught (storage and offsets)."""
    with FakeTensorMode():
        n, d = 256, "cuda"
        flat = torch.zeros(3 * n, device=d)
        m, a, v = (flat.narrow(0, i * n, n) for i in range(3))  # adjacent, disjoint
        zk.adam_step_(m, a, v, torch.zeros(n, device=d), **HP, **_scalars(d))
        with pytest.raises(ValueError, match="exp_avg overlaps master"):
            zk.adam_step_(m, flat.narrow(0, n - 1, n), v, torch.zeros(n, device=d), **HP,
                          **_scalars(d))


def _op_cases(d):
    """name -> (args of torch.ops.zerokern.<name> on device d, names of its tensor args)."""
    n = BLOCK * 2
    f32 = dict(device=d)
    sc = _scalars(d)
    s = (sc["step"], sc["grad_scale"], sc["found_inf"])
    hyper5, hyper4 = [1e-3, 0.9, 0.999, 1e-8, 0.0], [1e-4, 0.9, 0.99, 0.0]
    z = lambda dt=torch.float32, k=n: torch.zeros(k, dtype=dt, device=d)  # noqa: E731
    return {
        "adam_step_": [z(), z(), z(), z(torch.bfloat16), z(torch.bfloat16), hyper5,
                       [torch.tensor(1e-3, **f32)] + [None] * 4, True, *s, "triton"],
        "grad_stats_": [z(), sc["found_inf"], torch.zeros((), **f32), "triton"],
        "adamw8bit_step_": [z(), z(torch.uint8), z(k=n // BLOCK), z(torch.uint8),
                            z(k=n // BLOCK), z(), z(torch.bfloat16), hyper5, [None] * 5, *s,
                            "triton"],
        "lion_step_": [z(), z(), z(), None, hyper4, [None] * 4, *s, "cuda"],
        "compact_adam_step_": [z(torch.int16), z(torch.uint8, n // 8), z(torch.bfloat16), z(),
                               z(), z(), torch.zeros((), dtype=torch.bool, device=d), hyper5,
                               [None] * 5, True, *s],
        "blockquant_quantize": [z(), 128, 8, "triton"],
        "blockquant_dequantize": [z(torch.int8), z(k=n // 128), 128, 8, torch.bfloat16,
                                  "triton"],
    }


@pytest.mark.parametrize("name", OPS)
def test_each_op_runs_its_fake_impl_on_fake_cuda(no_launch, name):
    with FakeTensorMode():
        getattr(torch.ops.zerokern, name)(*_op_cases("cuda")[name])


@pytest.mark.parametrize("where", ["cuda:1", "cpu"])
@pytest.mark.parametrize("name", OPS)
def test_each_fake_impl_catches_a_wrong_device(no_launch, name, where):
    """Every tensor argument in turn moved to another device: the op raises (the fake impl's
    check, with no entry point's validation in front of it). A 0-d CPU tensor is allowed only
    as a hyperparameter (the backends read it on the host), so hyper_t is left alone."""
    with FakeTensorMode():
        args = _op_cases("cuda")[name]
        if sum(isinstance(x, torch.Tensor) for x in args) < 2:
            pytest.skip(f"{name} has one tensor argument: nothing to disagree with")
        hits = 0
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                continue
            bad = list(args)
            bad[i] = x.to(where)
            with pytest.raises((ValueError, RuntimeError), match="on " + where.split(":")[0]):
                getattr(torch.ops.zerokern, name)(*bad)
            hits += 1
        assert hits >= 2
        if name == "adam_step_":  # a hyperparameter tensor on another GPU
            bad = list(args)
            bad[6] = [torch.tensor(1e-3, device="cuda:1")] + [None] * 4
            with pytest.raises(ValueError, match="lr is on cuda:1"):
                torch.ops.zerokern.adam_step_(*bad)


# ------------------------------------------------------------------ opcheck -----------------

def _cpu_cases(backend):
    n = BLOCK * 3
    out = {}
    sc = lambda: (torch.tensor(4), torch.tensor(0.5), torch.tensor(False))  # noqa: E731
    hyper5 = [1e-3, 0.9, 0.999, 1e-8, 0.01]
    from zerokern.kernels.quant8 import quantize

    mq, ma = quantize(torch.randn(n) * 1e-2, True)
    vq, va = quantize(torch.rand(n) * 1e-4, False)
    out["adam_step_"] = [torch.randn(n), torch.randn(n) * 1e-2, torch.rand(n) * 1e-4,
                         torch.randn(n).bfloat16(), torch.zeros(n, dtype=torch.bfloat16),
                         hyper5, [torch.tensor(2e-3)] + [None] * 4, True, *sc(), backend]
    out["grad_stats_"] = [torch.randn(n), torch.tensor(False), torch.zeros((),
                          dtype=torch.float64), backend]
    out["adamw8bit_step_"] = [torch.randn(n), mq, ma, vq, va, torch.randn(n),
                              torch.zeros(n, dtype=torch.float16), hyper5, [None] * 5, *sc(),
                              backend]
    out["lion_step_"] = [torch.randn(n), torch.randn(n) * 1e-2, torch.randn(n), None,
                         [1e-4, 0.9, 0.99, 0.1], [None] * 4, *sc(), backend]
    out["blockquant_quantize"] = [torch.randn(n), 64, 4, backend]
    codes, scale = B.quantize(torch.randn(n), 128, 8)
    out["blockquant_dequantize"] = [codes, scale, 128, 8, torch.bfloat16, backend]
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"], indirect=True)
@pytest.mark.parametrize("name", [o for o in OPS if o != "compact_adam_step_"])
def test_opcheck(backend, name):
    args = _cpu_cases(backend)[name]
    torch.library.opcheck(getattr(torch.ops.zerokern, name).default, tuple(args))


def test_opcheck_compact_step_under_the_interpreter():
    if not dispatch._interpreting():
        pytest.skip("the compact step is Triton only; needs TRITON_INTERPRET=1 on CPU tensors")
    n = 64
    low = torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16)
    param = torch.randn(n).bfloat16()
    args = (low, torch.zeros(n // 8, dtype=torch.uint8), param, torch.randn(n) * 1e-2,
            torch.rand(n) * 1e-4, torch.randn(n), torch.tensor(False),
            [1e-3, 0.9, 0.999, 1e-8, 0.01], [None] * 5, True, torch.tensor(0), torch.tensor(1.0),
            torch.tensor(False))
    torch.library.opcheck(torch.ops.zerokern.compact_adam_step_.default, args)


# ------------------------------------------------------------------ torch.compile -----------

@pytest.mark.parametrize("backend", ["cpu", "reference"], indirect=True)
def test_compile_fullgraph_traces_the_ops(backend):
    """torch.compile(fullgraph=True) of two Adam steps and a grad_stats_ through the public
    entry points: the graph holds the ops (recorded by the compile backend), and running it
    gives bitwise the eager results. aot_eager: functionalization of the mutating ops too."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def steps(m, a, v, g, out, step, gs, fi, found, sumsq):
        zk.grad_stats_(g, found, sumsq, backend=backend)
        for _ in range(2):
            zk.adam_step_(m, a, v, g, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.01, step=step, grad_scale=gs, found_inf=fi,
                          backend=backend)
        return m.sum()

    n = 300
    init = [torch.randn(n), torch.randn(n) * 1e-2, torch.rand(n) * 1e-4,
            torch.randn(n).bfloat16(), torch.zeros(n, dtype=torch.bfloat16), torch.tensor(3),
            torch.tensor(0.5), torch.tensor(False), torch.tensor(False),
            torch.zeros((), dtype=torch.float64)]
    want = [t.clone() for t in init]
    got = [t.clone() for t in init]
    torch._dynamo.reset()
    steps(*want)
    torch.compile(steps, fullgraph=True, backend=record)(*got)
    for w, g in zip(want, got):
        assert torch.equal(w.view(-1).view(torch.uint8) if w.dim() else w,
                           g.view(-1).view(torch.uint8) if g.dim() else g)
    assert int(got[5]) == 5
    text = "\n".join(str(gm.graph) for gm in graphs)
    assert text.count("zerokern.adam_step_") == 2 and "zerokern.grad_stats_" in text
