"""fold_constants: values that depend on no input are computed once, while compiling, with eager's
ops; random values, parameters, outputs and large values are not (passes/fold_constants.py)."""
import importlib

import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.capture.frontend import capture
from fusec.passes import run_pipeline
from fusec.record import record_of

fc = importlib.import_module("fusec.passes.fold_constants")  # the module, not the pass function


def shifted_window_mask(attn):
    """torchvision Swin's attention mask: zeros, then a count per window by slice assignment."""
    mask = attn.new_zeros(8, 8)
    count = 0
    for h in (slice(0, 4), slice(4, 6), slice(6, None)):
        for w in (slice(0, 5), slice(5, None)):
            mask[h, w] = count
            count += 1
    windows = mask.view(2, 4, 2, 4).permute(0, 2, 1, 3).reshape(4, 16)
    diff = windows.unsqueeze(1) - windows.unsqueeze(2)
    mask = diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)
    return F.softmax(attn + mask, dim=-1)


def folded(fn, *inputs):
    gm, _ = run_pipeline(capture(fn, inputs).gm)
    return record_of(gm).fold_constants, gm


def test_the_window_mask_is_computed_once(target):
    backend, device = target
    attn = torch.randn(3, 4, 16, 16, device=device)
    compiled = assert_matches(shifted_window_mask, attn, backend=backend)
    done, gm = folded(shifted_window_mask, attn)
    assert len(done) == 1 and done[0].shape == (4, 16, 16)
    externs = {s.name for s in record_of(gm).schedule if s.kind == "extern"}
    assert not externs, externs  # no slice_scatter, copy or full left to run per call
    assert len(compiled.kernels) == 1  # the softmax, reading the folded mask
    text = str(fusec.explain(shifted_window_mask, attn, backend=backend))
    assert "computed 1 constant value(s) once" in text


def test_random_values_are_not_constants():
    def f(x):
        return x + torch.rand(4)

    done, _ = folded(f, torch.zeros(4))
    assert done == []
    compiled = fusec.compile(f, backend="cpp")
    assert not torch.equal(compiled(torch.zeros(4)), compiled(torch.zeros(4)))


def test_parameters_are_inputs_not_constants():
    lin = torch.nn.Linear(4, 4)

    def f(x):
        return x + lin.weight.sum(0) * torch.arange(4.0)

    compiled = fusec.compile(lin, backend="cpp")  # through a module: its weight is lifted
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), lin(x))
        lin.weight.mul_(-3)
        torch.testing.assert_close(compiled(x), lin(x))  # the new weight, not a folded copy
    done, _ = folded(f, x)
    assert [d.shape for d in done] == [(4,)]  # only arange(4.0): the weight was a closure's


def test_a_returned_constant_is_a_new_tensor_each_call():
    def f(x):
        return x * 2, torch.arange(6).view(2, 3) + 1

    compiled = fusec.compile(f, backend="cpp")
    first = compiled(torch.ones(2))[1]
    first.zero_()  # the caller owns what it was given
    second = compiled(torch.ones(2))[1]
    torch.testing.assert_close(second, torch.arange(6).view(2, 3) + 1)


def test_large_values_stay_computed(monkeypatch):
    monkeypatch.setattr(fc, "MAX_ELEMENTS", 100)

    def f(x):
        return x + torch.arange(1000.0).view(10, 100).cos()

    done, _ = folded(f, torch.randn(10, 100))
    assert done == []
    assert_matches(f, torch.randn(10, 100), backend="cpp")


def test_folded_values_keep_their_dtype_and_strides(target):
    backend, device = target

    def f(x):
        table = torch.arange(12, device=x.device).view(3, 4).t().to(torch.bfloat16) * 0.5
        return x + table

    x = torch.randn(4, 3, device=device, dtype=torch.bfloat16)
    assert_matches(f, x, backend=backend)
    done, gm = folded(f, x)
    assert len(done) == 1 and done[0].dtype == "bfloat16"
    value = getattr(gm, done[0].attr)
    assert value.dtype == torch.bfloat16 and value.shape == (4, 3)


def test_a_closure_tensor_changed_in_place_is_seen():
    """A tensor the program reaches by itself is read on every call, so whatever is computed from
    it is not folded: changed in place between calls, the result follows, as eager's does."""
    mask = torch.zeros(4)

    def f(x):
        return x + torch.cumsum(mask, 0)  # cumsum is an extern: it would be folded if constant

    compiled = fusec.compile(f, backend="cpp")
    x = torch.zeros(4)
    torch.testing.assert_close(compiled(x), f(x))
    mask[0] = 1.0
    torch.testing.assert_close(compiled(x), f(x))
    assert folded(f, x)[0] == []
