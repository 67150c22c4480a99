"""What models do that our own examples did not: tied weights, outputs of any type, buffers
updated in place, recurrent layers, masked ops, every attention kernel, CPU scalars next to
device tensors, tensors reached through closures. Each case is compared with eager."""
import collections
import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusec
from fusec.capture import calls
from conftest import TRITON_DEVICE
from fusec import frontend
from fusec.errors import DeviceError, GraphBreakError
from fusec.ir import TensorMeta, ValueMeta
from fusec.record import record_of

aten = torch.ops.aten


def close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves = fusec.outputs.leaves(got)
    want_leaves = fusec.outputs.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        else:
            assert g == w


# ---- tied and shared parameters -----------------------------------------------------------------

class TiedLM(nn.Module):
    """An embedding whose table is also the output head, and one block used twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = torch.tanh(self.block(self.embed(ids)))
        return self.head(torch.tanh(self.block(h)))


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_tied_weights_inference(backend):
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 20, (2, 5))
    compiled = fusec.compile(model, backend=backend)
    with torch.no_grad():
        close(compiled(ids), model(ids))
    assert compiled._compiled.last.captured.lifted_names == ["embed.weight", "block.weight",
                                                             "block.bias"]
    # an optimizer may replace nothing here, but it updates the tied tensor in place: seen
    with torch.no_grad():
        model.embed.weight.mul_(0.5)
        close(compiled(ids), model(ids))


def test_tied_weights_training_gradients_sum_both_uses():
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 20, (2, 5))
    ref = copy.deepcopy(model)
    assert ref.head.weight is ref.embed.weight
    compiled = fusec.compile(model, backend="cpp")
    (compiled(ids) ** 2).mean().backward()
    (ref(ids) ** 2).mean().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)


# ---- outputs of any type ---------------------------------------------------------------------

Pair = collections.namedtuple("Pair", "low high")


class Layer:
    """Like transformers' DynamicLayer: a plain object that pytree does not know."""

    def __init__(self, keys, values):
        self.keys, self.values, self.seen = keys, values, keys.shape[-1]


class Cache:
    def __init__(self):
        self.layers = []
        self.name = "cache"

    def update(self, k, v):
        self.layers.append(Layer(k, v))


@dataclasses.dataclass
class Report:  # a dataclass nobody registered, holding a tensor and a number
    value: torch.Tensor
    count: int


class Structured(nn.Module):
    def forward(self, x):
        cache = Cache()
        cache.update(x * 2, x + 1)
        cache.update(x.sin(), x.cos())
        return {"pair": Pair(x.amin(-1), x.amax(-1)), "cache": cache,
                "report": Report(x.sum(), 3), "none": None, "label": "ok", "n": 7}


def test_outputs_of_any_structure_come_back_as_eager_returns_them():
    model, x = Structured(), torch.randn(3, 4)
    compiled = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        got, want, again = compiled(x), model(x), compiled(x)
    assert type(got["pair"]) is Pair and type(got["cache"]) is Cache
    assert type(got["report"]) is Report and got["report"].count == 3
    assert [type(layer) for layer in got["cache"].layers] == [Layer, Layer]
    assert got["cache"].name == "cache" and got["cache"].layers[0].seen == 4
    assert (got["none"], got["label"], got["n"]) == (None, "ok", 7)
    close(got, want)
    # every call builds its own objects: nothing returned earlier changes
    assert again["cache"] is not got["cache"]
    assert again["cache"].layers[0] is not got["cache"].layers[0]
    assert again["cache"].layers[0].keys is not got["cache"].layers[0].keys


def test_an_argument_hiding_tensors_in_an_unknown_object_is_a_graph_break():
    """One graph cannot take a Cache's tensors as inputs (they would be baked in, and what the
    program does to the Cache would happen to the traced copy only). With fullgraph=True that is
    an error naming the argument; by default the program runs in regions through Dynamo, which
    opens the object and does to the caller's Cache what eager does."""
    def f(x, cache):
        cache.update(x * 2, x + 1)  # appends this step's keys and values to the caller's cache
        return x + cache.layers[0].keys.sum()

    def fresh():
        cache = Cache()
        cache.update(torch.ones(2), torch.ones(2))
        return cache

    with pytest.raises(GraphBreakError, match="argument 'cache' is a Cache holding tensors"):
        fusec.compile(f, backend="cpp", fullgraph=True)(torch.ones(2), fresh())
    x = torch.arange(2.0)
    want_cache, got_cache = fresh(), fresh()
    want = f(x, want_cache)
    with pytest.warns(UserWarning, match="cannot be one graph: argument .cache. is a Cache"):
        got = fusec.compile(f, backend="cpp")(x, got_cache)
    torch.testing.assert_close(got, want)
    assert len(got_cache.layers) == len(want_cache.layers) == 2
    for g, w in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(g.keys, w.keys)
        torch.testing.assert_close(g.values, w.values)


# ---- buffers updated in place ----------------------------------------------------------------

class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.total.add_(x.sum(0))
        self.calls += 1
        return self.lin(x) * self.calls


@pytest.mark.parametrize("make", [lambda: Counter(),
                                  lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))],
                         ids=["add_", "batchnorm"])
def test_buffers_updated_in_place_as_eager_does(make):
    torch.manual_seed(0)
    model = make().train()
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend="cpp")
    for step in range(3):
        x = torch.randn(6, 4)
        with torch.no_grad():
            close(compiled(x), ref(x))
        for (name, b), r in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6, msg=f"{name} after {step + 1}")


def test_buffers_updated_in_place_while_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU()).train()
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend="cpp")
    for _ in range(2):
        x = torch.randn(6, 4)
        compiled(x).sum().backward()
        ref(x).sum().backward()
    for b, r in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-5)


# ---- recurrent layers ------------------------------------------------------------------------

RNN_CASES = [(cls, layers, bidirectional, batch_first, h0)
             for cls in (nn.RNN, nn.LSTM, nn.GRU)
             for layers, bidirectional, batch_first, h0 in [(1, False, False, False),
                                                            (2, True, True, True)]]


@pytest.mark.parametrize("cls,layers,bidirectional,batch_first,h0", RNN_CASES,
                         ids=[f"{c.__name__}-{n}l-{'bi' if b else 'uni'}-{'bf' if f else 'sf'}"
                              f"{'-h0' if h else ''}" for c, n, b, f, h in RNN_CASES])
def test_recurrent_layers_run_as_one_extern(cls, layers, bidirectional, batch_first, h0):
    torch.manual_seed(0)
    rnn = cls(5, 8, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
    x = torch.randn(3, 7, 5)
    args = (x,)
    if h0:
        h = torch.randn(layers * (2 if bidirectional else 1), 7 if not batch_first else 3, 8)
        args = (x, (h, torch.randn_like(h)) if cls is nn.LSTM else h)

    def model(*args):  # the recurrent layer plus work around it to fuse
        out, state = rnn(*args)
        return torch.relu(out) * 2, state
    compiled = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        close(compiled(*args), model(*args))
    externs = [s.name for s in record_of(compiled.last.gm).schedule if s.kind == "extern"]
    assert f"fusec.{cls.__name__.lower().replace('rnn', 'rnn_tanh')}.default" in externs, externs
    assert compiled.kernels


def test_recurrent_layer_training_takes_torch_decomposition():
    torch.manual_seed(0)
    model = nn.GRU(4, 6, num_layers=2, batch_first=True)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 4)
    compiled = fusec.compile(model, backend="cpp")
    out, h = compiled(x)
    (out.sum() + h.sum()).backward()
    ref_out, ref_h = ref(x)
    (ref_out.sum() + ref_h.sum()).backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)


def test_cudnn_weight_flattening_is_not_traced():
    """`flatten_parameters` rewrites cuDNN weights into one buffer in place; while fusec traces,
    it does nothing (it picks a layout, not a value)."""
    from fusec.rnn import RecurrentAsExtern
    weights = [torch.randn(4, 4)]
    with RecurrentAsExtern():
        assert torch._cudnn_rnn_flatten_weight(weights, 2, 4, 0, 4, 0, 1, False, False) is None


def test_lstm_on_a_fake_cuda_device_is_one_op():
    """What capture meets on a GPU (faked here: no CUDA needed): one fusec.lstm node, not a loop
    of cells, with every node annotated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from fusec.rnn import RecurrentAsExtern
    lstm = nn.LSTM(5, 8, num_layers=2, batch_first=True)
    with FakeTensorMode():
        x = torch.empty(2, 6, 5, device="cuda")
        h, c = torch.empty(2, 2, 8, device="cuda"), torch.empty(2, 2, 8, device="cuda")
        weights = [torch.empty(p.shape, device="cuda") for p in lstm.parameters()]
    names = [n for n, _ in lstm.named_parameters()]

    def f(x, h, c, *ws):
        with RecurrentAsExtern(), torch.no_grad():
            return torch.func.functional_call(lstm, dict(zip(names, ws)), (x, (h, c)))[0]
    gm = frontend.annotate(make_fx(f)(x, h, c, *weights))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("fusec.lstm.default") == 1, targets
    lstm_node = next(n for n in gm.graph.nodes if str(n.target) == "fusec.lstm.default")
    assert [m.device for m in lstm_node.meta["fusec"]] == ["cuda:0"] * 3


# ---- masked reductions and prelu: PyTorch's own OpInfo samples ----------------------------------

def _opinfo_samples(limit: int = 6):
    from opinfo_samples import op_db, samples
    cases = []
    for op in op_db():
        if not (op.name.startswith("masked.") or op.name == "nn.functional.prelu"):
            continue
        for i, sample in enumerate(samples(op, "cpu", torch.float32, limit)):
            cases.append(pytest.param(op, sample, id=f"{op.name}-{i}"))
    return cases


@pytest.mark.parametrize("closure", [False, True], ids=["arguments", "closure"])
def test_masked_ops_and_prelu_match_eager_on_opinfo_samples(closure):
    """Every op's samples, passed as arguments and (as OpInfo-style harnesses do) closed over:
    then masks and weights are tensors the program reaches by itself, which become constants."""
    for param in _opinfo_samples():
        op, sample = param.values
        args, kwargs = sample.args, sample.kwargs
        if closure:
            compiled = fusec.compile(lambda x: op.op(x, *args, **kwargs), backend="cpp")
            got = compiled(sample.input)
        else:
            compiled = fusec.compile(op.op, backend="cpp")
            got = compiled(sample.input, *args, **kwargs)
        want = op.op(sample.input, *args, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=lambda m: f"{param.id}: {m}")


# ---- attention: every kernel torch may pick ----------------------------------------------------

CUDA_ATTENTION = {
    "cudnn": lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0,
                                                                      True, False),
    "flash": lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False),
    "efficient": lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None,
                                                                              False, 0.0, True),
}


@pytest.mark.parametrize("variant", list(CUDA_ATTENTION))
def test_cuda_attention_kernels_are_annotated_externs(variant):
    """The CUDA attention ops return tensors next to ints, None and seeds; traced on a fake CUDA
    device (their meta implementations), every node gets metadata, the passes accept the graph
    (each checks that no node lacks it), and the op is one extern step."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from fusec.passes import run_pipeline
    with FakeTensorMode():
        q, k, v = (torch.empty(2, 2, 8, 16, device="cuda", dtype=torch.float16) for _ in range(3))
    op = CUDA_ATTENTION[variant]
    gm = make_fx(lambda q, k, v: op(q, k, v)[0] * 2.0,
                 decomposition_table=frontend.decompositions())(q, k, v)
    frontend.annotate(gm)
    node = next(n for n in gm.graph.nodes if "attention" in str(n.target))
    metas = node.meta["fusec"]
    assert isinstance(metas, tuple) and isinstance(metas[0], TensorMeta)
    assert len(metas) == len(node.meta["val"])
    for meta, val in zip(metas, node.meta["val"]):
        assert isinstance(meta, TensorMeta if isinstance(val, torch.Tensor) else ValueMeta)
    out, _ = run_pipeline(gm)
    steps = [(s.kind, s.name) for s in record_of(out).schedule]
    assert steps == [("extern", str(node.target)), ("kernel", "fused_mul_0")], steps


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
@pytest.mark.parametrize("kernel", ["default", "math"])
def test_cpu_attention_matches_eager(backend, kernel):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))

    def f(q, k, v):
        if kernel == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1
    close(fusec.compile(f, backend=backend)(q, k, v), f(q, k, v))


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_cpu_flash_attention_gradients_match_eager(mask):
    """CPU flash attention's backward reads the logsumexp its forward saved. The forward runs as
    an extern (eager's kernel, fusec/decompositions.py "attention stays eager's"), which saves the
    real one; torch's decomposition would save the attention matrix there."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3))
    m = {None: None, "bool": torch.rand(8, 8) > 0.3, "float": torch.randn(8, 8)}[mask]
    if mask == "bool":
        m |= torch.eye(8, dtype=torch.bool)  # no row fully masked

    def f(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)
    compiled = fusec.compile(f, backend="cpp")
    got = torch.autograd.grad((compiled(q, k, v, m) ** 2).sum(), (q, k, v))
    want = torch.autograd.grad((f(q, k, v, m) ** 2).sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


# ---- a 0-dim CPU tensor next to tensors of another device ---------------------------------------

def test_program_device_ignores_cpu_scalars():
    scalar = torch.tensor(2.0)
    meta = torch.empty(3, device="meta")
    assert frontend.program_device([scalar, meta]) == torch.device("meta")
    assert frontend.program_device([scalar]) == torch.device("cpu")
    frontend.check_devices([scalar, meta], ["s", "x"], torch.device("meta"))  # eager accepts it
    # CPU indices next to device data: eager accepts `x[idx]`, and so does capture (it moves
    # them); CPU data in an op with device data is eager's error, and fusec's, while tracing
    frontend.check_devices([torch.ones(2), meta], ["a", "x"], torch.device("meta"))
    with pytest.raises(DeviceError, match="different devices meet in one op"):
        frontend.capture(lambda a, x: a + x, (torch.ones(2), torch.empty(2, device="meta")), {})
    gm = frontend.capture(lambda x, i: x[i] * 2, (torch.empty(5, 3, device="meta"),
                                                 torch.tensor([0, 2])), {}).gm
    assert all(n.meta["fusec"].device == "meta" for n in gm.graph.nodes
               if n.op == "call_function"), gm.code


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x, shift):
        return torch.minimum(x * self.scale + shift, torch.tensor(2.0)), shift * 2


def test_cpu_scalars_move_to_the_program_device():
    """Captured on the meta device (a stand-in for CUDA, which this test cannot assume): the
    CPU scalar buffer and argument are copied to the device at the start, the literal
    `torch.tensor(2.0)` is moved once, every computation runs on the device, and the output
    eager returns on the CPU (`shift * 2`) comes back on the CPU."""
    x, shift = torch.empty(4, 4, device="meta"), torch.tensor(0.5)
    captured = frontend.capture(Scaled(), (x, shift), {})
    gm = captured.gm
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not aten._to_copy.default:
            assert node.meta["fusec"].device == "meta", (node.name, node.meta["fusec"])
    copies = [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    # in: the buffer and the argument, each once; out: `shift * 2`, back to the CPU
    assert sorted(c.args[0].name for c in copies) == ["mul_1", "p_scale", "shift"], copies
    outputs = gm.graph.output_node().args[0]
    assert [o.meta["fusec"].device for o in outputs] == ["meta", "cpu"]
    constants = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    assert all(c.device.type == "meta" for c in constants)


def test_a_factory_that_names_no_device_moves_to_the_program_device():
    """`aten.scalar_tensor(1.0)` with no device (AOT Autograd's backward graphs have them) makes
    a CPU tensor; a kernel on the device cannot read it (Triton on CUDA refused the pointer)."""
    def f(x):
        one = aten.scalar_tensor.default(1.0, dtype=torch.float32)
        return torch.where(x > 0, one, x)
    gm = frontend.capture(f, (torch.empty(4, 4, device="meta"),), {}).gm
    scalar = next(n for n in gm.graph.nodes if n.target is aten.scalar_tensor.default)
    assert scalar.meta["fusec"].device == "meta"


def test_a_program_given_no_tensors_runs_where_its_factories_make_them():
    gm = frontend.capture(lambda: torch.ones(3, device="meta") * 2, (), {}).gm
    assert calls.graph_device(gm) == torch.device("meta")
    assert calls.graph_device(frontend.capture(lambda: torch.ones(3) * 2, (), {}).gm).type == "cpu"


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a GPU")
def test_factories_on_cuda_with_no_arguments_compile_for_cuda():
    f = lambda: torch.arange(6, device="cuda", dtype=torch.float32).sin() * 2  # noqa: E731
    close(fusec.compile(f, backend="triton")(), f())


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a GPU: CPU indices next to CUDA data")
def test_cpu_indices_next_to_cuda_data_on_triton():
    """Eager indexes CUDA data with CPU indices and masks; fusec copies them to the device."""
    x, idx = torch.randn(6, 4, device="cuda"), torch.tensor([0, 3, 5])
    mask = torch.tensor([True, False, True, True, False, True])
    for f in (lambda x, i: torch.sin(x[i]) * 2,
              lambda x, m: torch.ops.aten.index_put.default(x, [m], torch.ones(4, device="cuda")),
              lambda x, i: (x[i] + 1, i * 2)):  # `i * 2` stays on the CPU, as eager has it
        arg = mask if f.__code__.co_varnames[1] == "m" else idx
        got, want = fusec.compile(f, backend="triton")(x, arg), f(x, arg)
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            assert g.device == w.device
            close(g, w)


def test_cpu_scalars_in_a_cpu_program_are_ordinary_inputs():
    torch.manual_seed(0)
    model, x, shift = Scaled(), torch.randn(4, 4), torch.tensor(0.5)
    compiled = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        close(compiled(x, shift), model(x, shift))
        model.scale.fill_(-1.0)  # the buffer is read on every call
        close(compiled(x, shift), model(x, shift))


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="needs a GPU: a CPU scalar next to CUDA tensors")
def test_cpu_scalar_next_to_cuda_tensors_on_triton():
    torch.manual_seed(0)
    model, x, shift = Scaled().cuda(), torch.randn(4, 4, device="cuda"), torch.tensor(0.5)
    model.scale = torch.tensor(3.0)
    compiled = fusec.compile(model, backend="triton")
    with torch.no_grad():
        close(compiled(x, shift), model(x, shift))


# ---- tensors the program reaches by itself ------------------------------------------------------

def test_closure_tensors_are_constants_read_in_place():
    mask = torch.tensor([True, False, True, True])

    def f(x):
        return torch.where(mask, x.exp(), 0.0)
    compiled, x = fusec.compile(f, backend="cpp"), torch.randn(3, 4)
    close(compiled(x), f(x))
    mask[1] = True  # changed in place between calls: the program sees it, as eager does
    close(compiled(x), f(x))


def test_assigning_tensor_attributes_in_forward_is_a_graph_break():
    """A captured graph cannot replay `self.hidden = ...`: with fullgraph=True that is an error
    naming the attribute (and the trace's fake value is taken back off the module); by default
    the program runs through graph breaks, and the state evolves as eager's does."""
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = torch.zeros(4)

        def forward(self, x):
            self.hidden = torch.tanh(x + self.hidden)
            return self.hidden * 2
    model = Stateful()
    before = model.hidden
    with pytest.raises(fusec.GraphBreakError, match="Stateful.hidden"):
        fusec.compile(model, backend="cpp", fullgraph=True)(torch.randn(4))
    assert model.hidden is before
    ref = Stateful()
    compiled = fusec.compile(model, backend="cpp")
    for _ in range(3):
        x = torch.randn(4)
        with pytest.warns(fusec.GraphBreakWarning) if _ == 0 else contextlib.nullcontext():
            close(compiled(x), ref(x))
        close(model.hidden, ref.hidden)
