"""The public API (docs/features.md and the README): fusec.compile in its three spellings, on functions and
modules, the Kernel records, .source(), recompilation per input signature, check=True and explain.

Every result is compared with eager PyTorch.
"""
import dataclasses
import json
import re

import pytest
import torch
from torch.utils import _pytree as pytree

import fusec
from fusec import cache, ops
from conftest import TRITON_DEVICE, assert_matches


def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))


def assert_same_as_eager(got, want):
    """Same nesting (dicts, tuples, lists), then every leaf close to eager's, with eager's layout."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"output structure {got_spec} differs from eager's {want_spec}"
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


# ---- the three spellings -----------------------------------------------------------------------

def test_bare_decorator():
    @fusec.compile
    def f(x):
        """doc of f"""
        return torch.sin(torch.sin(x)) * 2

    assert isinstance(f, fusec.CompiledFunction)
    assert f.__name__ == "f" and f.__doc__ == "doc of f"  # functools.wraps-style metadata
    assert f.kernels == []
    with pytest.raises(fusec.FusecError, match="nothing compiled yet"):
        f.source()
    x = torch.randn(257)
    torch.testing.assert_close(f(x), torch.sin(torch.sin(x)) * 2)
    assert [k.name for k in f.kernels] == ["fused_sin_sin_mul_0"]


def test_decorator_with_arguments(target):
    backend, device = target

    @fusec.compile(backend=backend)
    def f(x, y):
        return torch.sin(x) * y + x

    assert isinstance(f, fusec.CompiledFunction) and f.__name__ == "f"
    assert f.backend == backend
    x, y = torch.randn(33, 7, device=device), torch.randn(7, device=device)
    torch.testing.assert_close(f(x, y), torch.sin(x) * y + x)
    assert len(f.kernels) == 1 and f.kernels[0].backend == backend


def test_function_call_form(target):
    backend, device = target
    cf = fusec.compile(sin4, backend=backend)
    assert isinstance(cf, fusec.CompiledFunction)
    assert cf.__wrapped__ is sin4 and cf.fn is sin4
    x = torch.randn(1000, device=device)
    torch.testing.assert_close(cf(x), sin4(x))


def test_auto_picks_cpp_on_cpu():
    cf = fusec.compile(sin4)
    assert cf.backend == "auto"
    cf(torch.randn(100))
    assert [k.backend for k in cf.kernels] == ["cpp"]
    assert 'extern "C"' in cf.kernels[0].source


# ---- nn.Module ---------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """A parameter, a buffer, and outputs nested in a dict of tuples."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x):
        h = torch.sin(x) * self.weight + self.shift
        return {"h": h, "parts": (torch.cos(h), (x + 1, torch.relu(h)))}


def test_module(target):
    backend, device = target
    torch.manual_seed(0)
    model = Net().to(device)
    cm = fusec.compile(model, backend=backend)
    assert isinstance(cm, fusec.CompiledModule) and isinstance(cm, torch.nn.Module)
    x = torch.randn(5, 8, device=device)
    with torch.no_grad():
        got = cm(x)
        want = model(x)
    assert type(got) is dict and type(got["parts"]) is tuple and type(got["parts"][1]) is tuple
    assert_same_as_eager(got, want)
    assert cm.kernels and all(k.backend == backend for k in cm.kernels)
    assert all(k.name in cm.source() for k in cm.kernels)

    # Parameters and buffers are read at call time, not baked into the kernels.
    with torch.no_grad():
        model.weight.mul_(-2.0)
        model.shift.add_(3.0)
        n_programs = len(cm._compiled.compiled)
        assert_same_as_eager(cm(x), model(x))
    assert len(cm._compiled.compiled) == n_programs


def test_a_compiled_module_stands_for_its_module():
    """As torch.compile's wrapper does: `cm.fc` is the module's child, `cm.scale = 3.0` writes the
    module's attribute (and the next call sees it), `.train()`/`.eval()` and `len` are the module's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    cm = fusec.compile(model, backend="cpp")
    assert len(cm) == 3 and "append" in dir(cm) and cm.training and model.training
    cm.eval()
    assert not cm.training and not model.training and not model[1].training
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), model(x))
        cm.extra = 1  # an attribute written through the wrapper lands on the module
        assert model.extra == 1 and "extra" not in vars(cm)
        del cm.extra
        assert not hasattr(model, "extra")

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.scale = torch.nn.Linear(8, 2), 2.0

        def forward(self, x):
            return self.fc(x) * self.scale

    scaled = Scaled()
    cs = fusec.compile(scaled, backend="cpp")
    assert cs.fc is scaled.fc and cs.scale == 2.0
    with torch.no_grad():
        torch.testing.assert_close(cs(x), scaled(x))
        cs.scale = 3.0
        cs.fc = torch.nn.Linear(8, 2)  # a new child: the guards see it at the next call
        assert scaled.scale == 3.0 and scaled.fc is cs.fc
        torch.testing.assert_close(cs(x), scaled.fc(x) * 3.0)


def test_module_with_grad_compiles_forward_and_backward():
    model = Net()
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(5, 8)
    got = cm(x)
    assert_same_as_eager(got, model(x))
    assert cm.kernels, "training compiles kernels too (forward and backward)"


# ---- Kernel records and .source() --------------------------------------------------------------

def test_kernel_records(target):
    backend, device = target
    cf = fusec.compile(sin4, backend=backend)
    cf(torch.randn(1000, device=device))
    assert len(cf.kernels) == 1
    k = cf.kernels[0]
    assert isinstance(k, fusec.Kernel)
    assert k.name == "fused_sin_sin_sin_sin_0"
    assert k.backend == backend
    assert k.ops == ["aten.sin.default"] * 4
    assert isinstance(k.source, str) and k.name in k.source
    assert str(k) == k.source
    if backend == "cpp":
        assert f'extern "C" void {k.name}(' in k.source
    elif backend == "llvm":
        assert f"define void @{k.name}(" in k.source
    else:
        assert "@triton.jit" in k.source and f"def {k.name}(" in k.source


def test_source_has_every_kernel_and_the_schedule(target):
    backend, device = target

    def f(x, w):
        return torch.sin(x) @ w + 1  # kernel, extern mm, kernel

    cf = fusec.compile(f, backend=backend)
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 16, device=device)
    torch.testing.assert_close(cf(x, w), f(x, w))
    assert [k.name for k in cf.kernels] == ["fused_sin_0", "fused_add_1"]
    assert [k.ops for k in cf.kernels] == [["aten.sin.default"], ["aten.add.Tensor"]]
    src = cf.source()
    for k in cf.kernels:
        assert k.source in src
    # the schedule: both launches and the extern call between them, one step a line, in order
    assert re.search(r"^#.*\bschedule\b", src, re.M)
    assert re.search(r"kernel\s+fused_sin_0\b.*\n.*extern\s+aten\.mm\.default\b.*\n"
                     r".*kernel\s+fused_add_1\b", src), src


# ---- recompilation -----------------------------------------------------------------------------

def test_recompiles_per_signature(target):
    backend, device = target

    def f(x, scale):
        return torch.sin(x) * scale + 1

    cf = fusec.compile(f, backend=backend, dynamic=False)  # (shape families: test_dynamic.py)
    x = torch.randn(8, 16, device=device)
    signatures = [
        (x, 2.0),                                          # first
        (torch.randn(4, 16, device=device), 2.0),          # new shape
        (x.double(), 2.0),                                 # new dtype
        (torch.randn(16, 8, device=device).t(), 2.0),      # new strides (transposed)
        (x, 3.0),                                          # new Python scalar
    ]
    for n, args in enumerate(signatures, start=1):
        assert_same_as_eager(cf(*args), f(*args))
        assert len(cf.compiled) == n, f"signature {n} did not compile a new program"
    assert "(4, 16)" not in cf.kernels[0].source  # .kernels follows the last call

    # Every known signature is reused: no new program, and the on-disk cache is not even asked.
    misses, hits = cache.STATS["misses"], cache.STATS["hits"]
    for args in signatures:
        fresh = [a.clone() if isinstance(a, torch.Tensor) and a.is_contiguous() else a for a in args]
        assert_same_as_eager(cf(*fresh), f(*fresh))
    cf(torch.randn(4, 16, device=device), 2.0)
    assert "(4, 16)" in cf.kernels[0].source
    assert len(cf.compiled) == len(signatures)
    assert cache.STATS["misses"] == misses and cache.STATS["hits"] == hits


def test_keyword_scalar_change_recompiles():
    def f(x, *, alpha=1.0):
        return x * alpha - 1

    cf = fusec.compile(f, backend="cpp")
    x = torch.randn(64)
    for alpha in (1.0, 2.5, 1.0, -4.0):
        torch.testing.assert_close(cf(x, alpha=alpha), f(x, alpha=alpha))
    assert len(cf.compiled) == 3


# ---- check=True --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_passes_on_correct_programs(target, dtype):
    backend, device = target

    def f(x, y):
        return torch.sigmoid(x) * y + torch.exp(-x * x)

    x, y = torch.randn(40, 9, device=device, dtype=dtype), torch.randn(9, device=device, dtype=dtype)
    assert_matches(f, x, y, backend=backend, kernels=1, check=True)

    model = Net().to(device)
    cm = fusec.compile(model, backend=backend, check=True)
    x = torch.randn(3, 8, device=device)
    with torch.no_grad():
        assert_same_as_eager(cm(x), model(x))


def test_check_raises_on_a_wrong_kernel(target, monkeypatch, tmp_path):
    backend, device = target
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))  # keep the bad kernel out of the cache
    sin, cos = ops.OPS["sin"], ops.OPS["cos"]
    monkeypatch.setitem(ops.OPS, "sin",
                        dataclasses.replace(sin, **{backend: cos.spelling(backend)}))
    x = torch.randn(1000, device=device)

    unchecked = fusec.compile(sin4, backend=backend)
    assert not torch.allclose(unchecked(x), sin4(x)), "the monkeypatched row was not used"

    checked = fusec.compile(sin4, backend=backend, check=True)
    with pytest.raises(fusec.MismatchError) as info:
        checked(x)
    message = str(info.value)
    assert "fused_sin_sin_sin_sin_0" in message
    assert "aten.sin.default" in message
    assert "eager" in message


# ---- explain -----------------------------------------------------------------------------------

def _with_extern(x, w):
    return torch.sin(x) @ w + 1


def test_explain(target):
    backend, device = target
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 16, device=device)
    e = fusec.explain(_with_extern, x, w, backend=backend)
    text = str(e)
    assert f"({backend} backend)" in text
    assert "graph after capture" in text and "torch.ops.aten.sin.default(x)" in text
    assert "fused_sin_0" in text and "fused_add_1" in text
    assert "fusion refused:" in text and "extern op (aten.mm.default)" in text
    assert "schedule" in text
    d = e.to_dict()
    for k in d["kernels"]:
        assert k["source"] in text

    assert {"backend", "stages", "refusals", "kernels", "schedule", "externs"} <= set(d)
    assert d["backend"] == backend
    assert [s["after"] for s in d["stages"]] == ["capture", "inline_sizes", "picks", "fold_constants",
                                                "constant_gathers", "check_gathers", "check_divisors", "dce", "cse",
                                                "canonicalize", "simplify", "filled_slices", "computed_pieces", "reinplace", "unfuse_bias", "sibling_gemvs",
                                                "small_matmul", "pad_matmul", "pooling", "layout",
                                                "move_permutes", "split_reductions", "fuse_pointwise",
                                                "fuse_reductions", "schedule"]
    assert "aten.mm.default" in d["stages"][0]["graph"]
    assert [k["name"] for k in d["kernels"]] == ["fused_sin_0", "fused_add_1"]
    assert d["kernels"][0]["ops"] == ["aten.sin.default"]
    assert all(k["name"] in k["source"] for k in d["kernels"])
    assert d["refusals"] == [{"producer": "mm", "consumer": "add",
                              "reason": "producer is an extern op (aten.mm.default) that runs "
                                        "as an ATen call"}]
    assert d["externs"] == ["aten.mm.default"]
    json.dumps(d)  # plain data, ready for tools


def test_explain_auto_backend_and_nothing_refused():
    e = fusec.explain(sin4, torch.randn(1000))
    d = e.to_dict()
    assert d["backend"] == "cpp" and d["refusals"] == [] and d["externs"] == []
    assert [k["name"] for k in d["kernels"]] == ["fused_sin_sin_sin_sin_0"]
    assert "fusion refused: nothing" in str(e)


def test_explain_accepts_a_compiled_function():
    cf = fusec.compile(sin4)
    x = torch.randn(1000)
    d = fusec.explain(cf, x).to_dict()
    assert [k["name"] for k in d["kernels"]] == ["fused_sin_sin_sin_sin_0"]
    assert len(cf.compiled) == 0  # explaining compiles a separate copy, runs nothing
    triton = fusec.compile(sin4, backend="triton")
    assert fusec.explain(triton, x.to(TRITON_DEVICE)).to_dict()["backend"] == "triton"  # keeps the wrapper's backend
    model = Net()
    d = fusec.explain(fusec.compile(model), torch.randn(2, 8)).to_dict()
    assert d["stages"][0]["graph"].count("p_weight") >= 1  # the module's parameter, lifted


# ---- broadcasting a one-element tensor over the whole iteration space ---------------------------

@pytest.mark.parametrize("shape", [(), (1,)], ids=["0d", "1el"])
def test_one_element_tensor_broadcast(target, shape):
    backend, device = target
    a, b = torch.randn(5, device=device), torch.randn(shape, device=device)
    assert_matches(lambda a, b: a * b + 1, a, b, backend=backend)


def test_public_objects_say_what_they_are():
    """Readable reprs: a compiled function before and after its first call, a kernel, a
    program, an explanation; each says where to look next."""
    cf = fusec.compile(lambda x: x.sin() * 2, backend="cpp")
    assert repr(cf) == "<fusec.compile(<lambda>, backend='cpp'): not called yet (it compiles at the first call)>"
    cf(torch.randn(4))
    assert repr(cf) == ("<fusec.compile(<lambda>, backend='cpp'): 1 program(s); the last has 1 "
                        "kernel(s): fused_sin_mul_0>")
    assert repr(cf.kernels[0]) == ("Kernel('fused_sin_mul_0', backend='cpp', ops=[sin, mul]; "
                                   "print() it for its source)")
    assert repr(cf.last).startswith("<CompiledGraph (cpp): 1 kernel(s) [fused_sin_mul_0]")
    e = fusec.explain(lambda x: x.sin(), torch.randn(4), backend="cpp")
    assert repr(e).startswith("<fusec.explain (cpp): 1 kernel(s); print() it")


class _Decorated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    @fusec.compile(backend="cpp")
    def forward(self, x):
        return torch.relu(self.lin(x)) * 2


def test_a_decorated_method_is_each_instances_own_compiled_method():
    """`@fusec.compile` on `forward` in a class body, as people write it for torch.compile: each
    instance runs its own weights, read at each call, and trains."""
    torch.manual_seed(0)
    a, b = _Decorated(), _Decorated()
    x = torch.randn(4, 8)
    for m in (a, b, a):
        with torch.no_grad():
            torch.testing.assert_close(m(x), torch.relu(m.lin(x)) * 2)
    assert a.forward is a.forward and a.forward is not b.forward
    assert isinstance(_Decorated.forward, fusec.CompiledFunction)
    with torch.no_grad():
        a.lin.weight = torch.nn.Parameter(torch.randn(8, 8))  # a new parameter: read, not baked
        torch.testing.assert_close(a(x), torch.relu(a.lin(x)) * 2)
    a(x).sum().backward()
    want = torch.autograd.grad((torch.relu(a.lin(x)) * 2).sum(), a.lin.weight)[0]
    torch.testing.assert_close(a.lin.weight.grad, want)


def test_a_module_passed_as_an_argument_is_not_baked_in():
    """`def step(model, x)`: the module's parameters are inputs of the program, not constants
    of one traced graph (a new parameter was unseen, and no gradient reached them): TorchDynamo
    takes the module's state as inputs, and fusec compiles its regions."""
    torch.manual_seed(0)
    step = fusec.compile(lambda m, x: torch.relu(m(x)) * 2, backend="cpp")
    lin, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    with pytest.warns(fusec.GraphBreakWarning, match="argument 'm' is a Linear module"):
        out = step(lin, x)
    torch.testing.assert_close(out, torch.relu(lin(x)) * 2)
    out.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
    with torch.no_grad():
        lin.weight = torch.nn.Parameter(torch.randn(8, 8))
        torch.testing.assert_close(step(lin, x), torch.relu(lin(x)) * 2)
    strict = fusec.compile(lambda m, x: m(x), backend="cpp", fullgraph=True)
    with pytest.raises(fusec.FusecError, match="argument 'm' is a Linear module"):
        strict(lin, x)


def test_torch_compile_keywords_work_as_written():
    """A call written for torch.compile works: `mode` maps to CUDA graphs, `disable=True` gives
    the function back, Inductor's `options` and an unknown mode are refused by name."""
    x = torch.randn(3)
    for mode in ("default", "max-autotune", "reduce-overhead", "max-autotune-no-cudagraphs"):
        f = fusec.compile(lambda x: x.sin() * 2, mode=mode, backend="cpp")
        torch.testing.assert_close(f(x), x.sin() * 2)
    assert fusec.compile(lambda x: x, mode="reduce-overhead").cuda_graphs is True
    assert fusec.compile(lambda x: x, mode="max-autotune-no-cudagraphs").cuda_graphs is False
    assert fusec.compile(torch.sin, disable=True) is torch.sin
    assert fusec.compile(disable=True)(torch.cos) is torch.cos
    with pytest.raises(fusec.FusecError, match="unknown mode 'fast'"):
        fusec.compile(torch.sin, mode="fast")
    with pytest.raises(fusec.FusecError, match="Inductor's settings"):
        fusec.compile(torch.sin, options={"triton.cudagraphs": True})
