"""Graph breaks (fusec/breaks.py): a program that cannot be one graph runs in compiled regions,
with the Python between them run eagerly, and matches eager on every call.

Each case is compared with eager over several calls whose data takes different paths; each
checks that `fullgraph=True` raises the clear GraphBreakError at the user's line instead, that
the kernels of every region are visible on the one compiled object, and that explain names
every break with its reason and the user's line. torch.compile(backend="fusec") exposes the same
through `fusec.regions` / `fusec.explain` / `fusec.profile`.
"""
import copy
import inspect
import json
import os
import warnings

import numpy as np
import pytest
import torch

import fusec
from fusec.fastpath import MISS

THIS_FILE = os.path.basename(__file__)


def line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def where(fn, text: str) -> str:
    return f"{THIS_FILE}:{line_of(fn, text)}"


def compiled(fn, backend, **options):
    """fusec.compile(fn) with the graph-break warning expected (and checked) on its first call."""
    return fusec.compile(fn, backend=backend, **options)


def first_call(cf, *args, reason: str, fn, text: str):
    """The first call warns once, naming the reason and the user's line."""
    with pytest.warns(fusec.GraphBreakWarning) as record, torch.no_grad():
        out = cf(*args)
    messages = [str(w.message) for w in record if issubclass(w.category, fusec.GraphBreakWarning)]
    assert len(messages) == 1, messages
    assert reason in messages[0] and where(fn, text) in messages[0], messages[0]
    return out


def calls_match_eager(cf, fn, inputs: list):
    """Every call matches eager, and no call after the first warns again."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusec.GraphBreakWarning)
        for args in inputs:
            with torch.no_grad():
                got, want = cf(*args), fn(*args)
            torch.testing.assert_close(got, want)


def explain_names_the_break(e, fn, text: str, *reasons: str):
    text_out = str(e)
    assert where(fn, text) in text_out and text in text_out, text_out
    for reason in reasons:
        assert reason in text_out, text_out
    assert "ran eagerly" in text_out
    json.dumps(e.to_dict())  # plain data
    return text_out


# ---- the cases --------------------------------------------------------------------------------

def scale_by_item(x):
    y = torch.sin(x) * 2
    s = y.abs().max().item()
    return torch.cos(y) / s


def branch(x):
    y = torch.sin(x) * 2
    if y.sum() > 0:
        return torch.cos(y) + 1
    return torch.tanh(y) - 1


def positive_part(x):
    y = torch.sin(x) * 2
    z = y[y > 0]
    return torch.exp(z) * 3


def where_nonzero(x):
    idx = torch.nonzero(x > 0)
    return idx * 2 + 1


def prints(x):
    y = torch.sin(x) * 2
    print("fusec-test: between the regions")
    return torch.cos(y) + 1


def through_numpy(x):
    y = torch.sin(x) * 2
    z = torch.from_numpy(np.tanh(y.numpy()))
    return torch.cos(z) + 1


def inputs_both_ways(device, n=4):
    """Data that makes the branches go both ways, alternating."""
    return [(torch.randn(64, device=device).abs() * (1 if i % 2 else -1),) for i in range(n)]


def test_item_control_flow(target):
    backend, device = target
    fn = scale_by_item
    with pytest.raises(fusec.GraphBreakError) as info:
        fusec.compile(fn, backend=backend, fullgraph=True)(torch.randn(64, device=device))
    assert where(fn, ".item()") in str(info.value) and "fullgraph=True" in str(info.value)

    cf = compiled(fn, backend)
    x = torch.randn(64, device=device)
    out = first_call(cf, x, reason="depends on tensor data", fn=fn, text=".item()")
    torch.testing.assert_close(out, fn(x))
    calls_match_eager(cf, fn, inputs_both_ways(device))
    assert cf.breaks is not None and len(cf.breaks.regions.last_call) == 2
    assert len(cf.kernels) >= 2 and {k.backend for k in cf.kernels} == {backend}
    e = fusec.explain(cf, x)
    explain_names_the_break(e, fn, ".item()", "`.item()`", "Tensor.item()")


def test_branch_on_tensor_both_ways(target):
    backend, device = target
    fn = branch
    cf = compiled(fn, backend)
    pos, neg = torch.ones(64, device=device), -torch.ones(64, device=device)
    first_call(cf, pos, reason="depends on tensor data", fn=fn, text="if y.sum() > 0:")
    seen = set()
    for args in inputs_both_ways(device, 6):
        with torch.no_grad():
            torch.testing.assert_close(cf(*args), fn(*args))
        # the kernels are the last call's: the region before the branch, then the branch taken
        names = [k.name for k in cf.kernels]
        taken = "cos" if fn(*args).min() >= 0 else "tanh"
        assert any(taken in n for n in names[1:]), names
        seen.add(taken)
    assert seen == {"cos", "tanh"}
    assert len(cf.breaks.regions.regions) == 3  # before the branch, and each branch once
    cf(torch.ones(16, device=device))  # a new shape compiles its own regions (static shapes)
    assert len(cf.breaks.regions.regions) == 5 and len(cf.breaks.regions.last_call) == 2
    for x in (pos, neg):
        explain_names_the_break(fusec.explain(cf, x), fn, "if y.sum() > 0:",
                                "Python branches on a tensor value", "generic_jump")
    # the whole program: every region's kernels, schedule, and the break between them
    cf(neg)
    source, schedule = cf.source(), cf.schedule
    for k in cf.kernels:
        assert f"===== kernel {k.name} =====" in source and k.name in schedule
    assert "if y.sum() > 0:" in source and "if y.sum() > 0:" in schedule


@pytest.mark.parametrize("fn, text", [(positive_part, "y[y > 0]"),
                                      (where_nonzero, "torch.nonzero(x > 0)")],
                         ids=["mask", "nonzero"])
def test_data_dependent_shapes(target, fn, text):
    backend, device = target
    with pytest.raises(fusec.GraphBreakError, match="depends on the data"):
        fusec.compile(fn, backend=backend, fullgraph=True)(torch.randn(64, device=device))
    cf = compiled(fn, backend)
    x = torch.randn(64, device=device)
    out = first_call(cf, x, reason="output shape depends on the data", fn=fn, text=text)
    torch.testing.assert_close(out, fn(x))
    # a different number of positive values each call: a different shape after the break
    calls_match_eager(cf, fn, [(torch.randn(64, device=device),) for _ in range(3)])
    assert cf.kernels, "no kernel in any region"
    explain_names_the_break(fusec.explain(cf, x), fn, text,
                            "an op whose output shape depends on the data", "nonzero")


def test_print_runs_on_every_call(capfd):
    fn = prints
    with pytest.raises(fusec.GraphBreakError, match="print") as info:
        fusec.compile(fn, backend="cpp", fullgraph=True)(torch.randn(8))
    assert where(fn, "print(") in str(info.value)
    capfd.readouterr()
    cf = compiled(fn, "cpp")
    x = torch.randn(8)
    torch.testing.assert_close(first_call(cf, x, reason="print", fn=fn, text="print("), fn(x))
    calls_match_eager(cf, fn, [(torch.randn(8),) for _ in range(2)])
    # once per call, like eager: 1 + 2 compiled calls, 1 + 2 eager calls
    assert capfd.readouterr().out.count("fusec-test: between the regions") == 6
    assert [k.name for k in cf.kernels] == ["fused_sin_mul_0", "fused_cos_add_0"]
    explain_names_the_break(fusec.explain(cf, x), fn, "print(", "print() runs Python",
                            "builtin operator")


def test_numpy_inside_the_program():
    """make_fx would read a traced tensor's (absent) data into numpy and bake it in as a
    constant; fusec refuses that at capture, and TorchDynamo traces numpy as torch ops."""
    fn = through_numpy
    with pytest.raises(fusec.GraphBreakError, match=r"\.numpy\(\)") as info:
        fusec.compile(fn, backend="cpp", fullgraph=True)(torch.randn(8))
    assert where(fn, ".numpy()") in str(info.value)
    cf = compiled(fn, "cpp")
    x = torch.randn(8)
    torch.testing.assert_close(first_call(cf, x, reason=".numpy()", fn=fn, text=".numpy()"), fn(x))
    calls_match_eager(cf, fn, [(torch.randn(8),) for _ in range(3)])
    assert any("tanh" in k.name for k in cf.kernels), [k.name for k in cf.kernels]


def helper_with_a_branch(y):
    if y.sum() > 0:
        return y + 1
    return y - 1


def calls_a_helper(x):
    y = torch.sin(x)
    z = helper_with_a_branch(y)
    return z * 2


def test_break_inside_a_called_function():
    fn = calls_a_helper
    cf = compiled(fn, "cpp")
    x = torch.randn(16)
    first_call(cf, x, reason="depends on tensor data", fn=helper_with_a_branch,
               text="if y.sum() > 0:")
    calls_match_eager(cf, fn, inputs_both_ways("cpu"))
    text = str(fusec.explain(cf, x))
    assert where(fn, "helper_with_a_branch(y)") in text  # the call ran eagerly ...
    assert where(helper_with_a_branch, "if y.sum() > 0:") in text  # ... the break is inside it


# ---- one compiled object ------------------------------------------------------------------------

class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, scale=1.0):
        h = torch.nn.functional.gelu(self.a(x)) * scale
        if h.mean() > 0:
            h = torch.tanh(h) + 1
        else:
            h = torch.sigmoid(h) - 1
        return self.b(h)


def test_module_with_keyword_arguments():
    torch.manual_seed(0)
    model = Gated()
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(5, 8)
    with pytest.warns(fusec.GraphBreakWarning):
        with torch.no_grad():
            torch.testing.assert_close(cm(x), model(x))
    for scale in (2.0, -1.0):
        with torch.no_grad():
            torch.testing.assert_close(cm(x, scale=scale), model(x, scale=scale))
    assert cm.kernels and cm.source() and cm.schedule
    assert fusec.regions(cm) is cm._compiled.breaks.regions


class StatefulCell(torch.nn.Module):
    """A hand-written recurrent cell that keeps its hidden state in a plain attribute (neither a
    parameter nor a buffer): updated in place when the caller passes one, replaced every call."""

    def __init__(self, n=6):
        super().__init__()
        self.hidden = torch.randn(3, n)
        self.step = torch.nn.Linear(2 * n, n)

    def forward(self, x, initial=None):
        if initial is not None:
            self.hidden.copy_(initial)
        self.hidden = torch.tanh(self.step(torch.cat((x, self.hidden), dim=1)))
        return self.hidden * 2


@pytest.mark.parametrize("initial", [False, True], ids=["own-state", "given-state"])
def test_module_state_in_plain_attributes(initial):
    """Assigning a new tensor to `self.hidden`, or updating a plain attribute in place, is a side
    effect one captured graph cannot replay: a graph break, and every call matches eager, state
    included."""
    torch.manual_seed(0)
    model = StatefulCell()
    ref = copy.deepcopy(model)
    cm = fusec.compile(model, backend="cpp")
    with pytest.raises(fusec.GraphBreakError, match="in-place update|module attributes"):
        with torch.no_grad():
            fusec.compile(copy.deepcopy(model), backend="cpp", fullgraph=True)(
                torch.randn(3, 6), *([torch.randn(3, 6)] if initial else []))
    for i in range(3):
        args = (torch.randn(3, 6),) + ((torch.randn(3, 6),) if initial else ())
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", fusec.GraphBreakWarning)
            got, want = cm(*args), ref(*args)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(model.hidden, ref.hidden)
    assert cm.kernels


def test_training_step_through_regions():
    """Forward and backward both run through the regions (each region is an AOT Autograd
    forward/backward pair compiled by fusec); gradients and updates match eager's."""
    torch.manual_seed(0)
    model = Gated()
    ref = copy.deepcopy(model)
    cm = fusec.compile(model, backend="cpp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fusec.GraphBreakWarning)
        for step in range(4):
            x = torch.randn(5, 8) + (0.5 if step % 2 else -0.5)  # both branches
            loss = cm(x).pow(2).mean()
            loss_ref = ref(x).pow(2).mean()
            loss.backward()
            loss_ref.backward()
            torch.testing.assert_close(loss, loss_ref)
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    regions = cm._compiled.breaks.regions.last_call
    assert all(len(r.parts) == 2 for r in regions)  # a forward and a backward program each
    backward = [k for r in regions for k in r.parts[1].kernels]
    assert backward and {k.name for k in backward} <= {k.name for k in cm.kernels}


def test_training_a_function_with_item():
    def fn(x, w):
        s = (x * w).sum().item()
        return torch.sin(x * w) * s
    x = torch.randn(6)
    w = torch.randn(6, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    cf = fusec.compile(fn, backend="cpp")
    with pytest.warns(fusec.GraphBreakWarning, match="depends on tensor data"):
        out = cf(x, w)
    out.sum().backward()
    fn(x, w_ref).sum().backward()
    torch.testing.assert_close(out, fn(x, w_ref))
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert cf.kernels


def test_check_mode_through_regions():
    cf = fusec.compile(branch, backend="cpp", check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fusec.GraphBreakWarning)
        for (x,) in inputs_both_ways("cpu"):
            torch.testing.assert_close(cf(x), branch(x))


def test_explain_respects_fullgraph():
    cf = fusec.compile(branch, backend="cpp", fullgraph=True)
    with pytest.raises(fusec.GraphBreakError):
        fusec.explain(cf, torch.randn(8))


def test_profile_covers_every_region():
    x = torch.ones(256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fusec.GraphBreakWarning)
        report = fusec.profile(branch, x, backend="cpp", iters=2, warmup=1, time_budget_s=0.02,
                               copy_bytes=1 << 20)
    assert [r.index for r, _ in report.regions] == [1, 2]
    names = [k.name for k in report.kernels]
    assert any("sum" in n for n in names) and any("cos" in n for n in names), names
    for _, region_report in report.regions:
        assert region_report.numerics.startswith("ok"), region_report.numerics
    assert report.eager_ms > 0 and report.fused_ms > 0
    text = str(report)
    assert where(branch, "if y.sum() > 0:") in text
    json.dumps(report.to_dict())


# ---- the whole-graph path is untouched ----------------------------------------------------------

def test_a_whole_graph_program_takes_no_break_machinery(monkeypatch):
    cf = fusec.compile(lambda x: torch.sin(x) * 2, backend="cpp")
    x = torch.randn(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusec.GraphBreakWarning)
        torch.testing.assert_close(cf(x), torch.sin(x) * 2)
    assert cf.breaks is None
    assert "def fast(args)" in cf._fast.source and cf._fast((x,)) is not MISS
    with pytest.raises(fusec.FusecError, match="one graph"):
        fusec.regions(cf)


# ---- torch.compile(backend="fusec") -------------------------------------------------------------

def test_torch_compile_exposes_regions():
    opt = torch.compile(branch, backend="fusec", options={"backend": "cpp"})
    for (x,) in inputs_both_ways("cpu"):
        with torch.no_grad():
            torch.testing.assert_close(opt(x), branch(x))
    regions = fusec.regions(opt)
    assert len(regions.regions) == 3 and regions.kernels
    assert {k.backend for k in regions.kernels} == {"cpp"}
    assert "fused_sin_mul_sum_gt_0" in regions.source()
    text = explain_names_the_break(fusec.explain(opt), branch, "if y.sum() > 0:",
                                   "generic_jump")
    assert "region 3" in text
    fresh = fusec.explain(opt, torch.ones(8))  # compiled afresh for these inputs
    assert len(fresh.regions.last_call) == 2
    assert "branch" in str(regions)
    report = fusec.profile(opt, -torch.ones(64), iters=2, warmup=1, time_budget_s=0.02,
                           copy_bytes=1 << 20)
    assert [r.index for r, _ in report.regions] == [1, 2]
    assert any("tanh" in k.name for k in report.kernels)
    assert all(r.numerics.startswith("ok") for _, r in report.regions)


def test_torch_compile_module_training_and_regions():
    torch.manual_seed(0)
    model = Gated()
    ref = copy.deepcopy(model)
    opt = torch.compile(model, backend="fusec", options={"backend": "cpp"})
    x = torch.randn(5, 8)
    opt(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    regions = fusec.regions(opt)
    assert regions.label == "Gated" and len(regions.regions) == 2
    assert all(len(r.parts) == 2 for r in regions.regions)  # forward and backward, each region
    assert regions.kernels and "if h.mean() > 0:" in str(regions)


def test_regions_of_something_else():
    with pytest.raises(fusec.FusecError, match="not compiled by fusec"):
        fusec.regions(torch.compile(branch, backend="eager"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="jiterator kernels need a GPU")
def test_jiterator_cuda_kernels_run_eagerly_not_while_tracing():
    """A jiterator kernel launches its own CUDA code on its arguments, fake ones included: while
    tracing it read address 0 and broke the CUDA context (OpInfo's jiterator_unary on an H200).
    It is a graph break: the kernel runs on real tensors, every call."""
    fn = torch.cuda.jiterator._create_jit_fn(
        "template <typename T> T neg_mul(T x, T y) { return -x * y; }")
    f = lambda a, b: fn(a * 2, b) + 1  # noqa: E731
    a, b = torch.randn(20, device="cuda"), torch.randn(20, device="cuda")
    with pytest.warns(fusec.GraphBreakWarning, match="cannot be one graph"):
        got = fusec.compile(f, backend="triton")(a, b)
    torch.testing.assert_close(got, f(a, b))


def test_a_whole_training_step_in_one_compiled_function():
    """`zero_grad; loss.backward(); opt.step()` in the compiled function, as people write a train
    step for torch.compile: `.backward()` is a graph break (a traced graph cannot run autograd;
    torch's tracing errors said "Cannot backprop through mirrored meta"), the forward and the
    step are compiled in regions, and the losses and parameters stay eager's."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(model)

    def step_of(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def train_step(x, y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            return loss
        return train_step

    compiled, eager = fusec.compile(step_of(model), backend="cpp"), step_of(ref)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with pytest.warns(fusec.GraphBreakWarning, match=r"\.backward\(\)"):
        first = compiled(x, y)
    torch.testing.assert_close(first, eager(x, y))
    for _ in range(2):
        torch.testing.assert_close(compiled(x, y), eager(x, y))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    strict = fusec.compile(lambda x: x.sin().sum().backward(), backend="cpp", fullgraph=True)
    with pytest.raises(fusec.GraphBreakError, match=r"\.backward\(\)"):
        strict(torch.randn(3, requires_grad=True))
