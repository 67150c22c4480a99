"""The training fast path (fusec/runtime/training_call.py): training calls like the last one skip
the general path, and still give eager's losses, gradients and buffers; a call that differs
(a replaced parameter, a requires_grad flip, a new shape or dtype, eval()) leaves it."""
import copy

import pytest
import torch

import fusec
from conftest import CPU_BACKENDS
from train_check import same_state, same_step


class Net(torch.nn.Module):
    """Linear, batch norm (running statistics: buffers the step updates), ReLU, Linear; the
    loss against `y` computed inside, as a training benchmark's models do."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return ((self.l2(self.bn(self.l1(x)).relu()) - y) ** 2).mean()


class Pair:
    """A model trained eagerly and its copy trained through fusec, step by step, compared."""

    def __init__(self, backend: str):
        torch.manual_seed(0)
        self.ref = Net()
        self.model = copy.deepcopy(self.ref)
        self.compiled = fusec.compile(self.model, backend=backend)
        self.cf = self.compiled._compiled  # the CompiledFunction
        self.general = 0  # calls that took the general path
        general_path = self.cf._call

        def counted(args, kwargs):
            self.general += 1
            return general_path(args, kwargs)
        self.cf._call = counted
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                     for m in (self.ref, self.model)]

    def step(self, *args, **kwargs):
        """One step on both: the same loss, gradients and buffers."""
        losses = []
        for run in (self.ref, self.compiled):
            loss = run(*args, **kwargs)
            if loss.requires_grad:
                loss.backward()
            losses.append(loss.detach())
        same_step(losses[1], losses[0], self.model, self.ref)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.same_state()

    def same_state(self):
        same_state(self.model, self.ref)


def batch(n=4, dtype=torch.float32):
    return torch.randn(n, 8, dtype=dtype), torch.randn(n, 4, dtype=dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_steps_match_eager_through_the_fast_path(backend):
    """Keyword arguments, batch norm in training: every call after the second (the first
    compiles, the second makes the fast path) skips the general path, and losses, gradients,
    parameters and running statistics stay eager's."""
    pair = Pair(backend)
    for _ in range(6):
        x, y = batch()
        pair.step(x=x, y=y)
    assert pair.general == 2
    assert "kwargs['x']" in pair.cf._train_fast.source
    assert pair.model.bn.num_batches_tracked.item() == 6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_positional_arguments(backend):
    pair = Pair(backend)
    for _ in range(4):
        pair.step(*batch())
    assert pair.general == 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replaced_parameter(backend):
    """A parameter replaced by another of the same kind is read where it lives (the fast path
    stays and uses the new one); one with other strides leaves it, and compiles again."""
    pair = Pair(backend)
    for _ in range(3):
        pair.step(*batch())
    new = torch.randn(16, 8)
    for m in (pair.ref, pair.model):
        m.l1.weight = torch.nn.Parameter(new.clone())
    pair.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ref, pair.model)]
    general = pair.general
    pair.step(*batch())
    assert pair.general == general  # same shape, strides, dtype: the same program
    compiles = pair.cf.compiles
    t = torch.randn(8, 16)
    for m in (pair.ref, pair.model):
        m.l1.weight = torch.nn.Parameter(t.clone().t())  # (16, 8), strides (1, 16)
    pair.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ref, pair.model)]
    for _ in range(3):
        pair.step(*batch())
    assert pair.cf.compiles == compiles + 1
    assert pair.general == general + 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_requires_grad_flip(backend):
    """A frozen parameter: a new program, whose gradients leave it alone, as eager's do."""
    pair = Pair(backend)
    for _ in range(3):
        pair.step(*batch())
    for m in (pair.ref, pair.model):
        m.l1.weight.requires_grad_(False)
    compiles = pair.cf.compiles
    for _ in range(3):
        pair.step(*batch())
    assert pair.cf.compiles == compiles + 1
    assert pair.model.l1.weight.grad is None
    for m in (pair.ref, pair.model):
        m.l1.weight.requires_grad_(True)
    for _ in range(2):
        pair.step(*batch())
    assert pair.cf.compiles == compiles + 1  # the first program again


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_new_shape_and_dtype(backend):
    pair = Pair(backend)
    for _ in range(3):
        pair.step(*batch())
    compiles = pair.cf.compiles
    for _ in range(3):
        pair.step(*batch(6))
    assert pair.cf.compiles > compiles
    for m in (pair.ref, pair.model):
        m.double()
    pair.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pair.ref, pair.model)]
    compiles = pair.cf.compiles
    for _ in range(3):
        pair.step(*batch(dtype=torch.float64))
    assert pair.cf.compiles > compiles
    assert pair.model.l1.weight.dtype is torch.float64


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_eval_train_and_no_grad(backend):
    """eval() (batch norm reads its running statistics, updates nothing) leaves the training
    fast path; so does grad mode off; back in train(), the first program's fast path again."""
    pair = Pair(backend)
    for _ in range(3):
        pair.step(*batch())
    for m in (pair.ref, pair.model):
        m.eval()
    for _ in range(2):
        pair.step(*batch())
    with torch.no_grad():
        pair.step(*batch())
    for m in (pair.ref, pair.model):
        m.train()
    general = pair.general
    for _ in range(3):
        pair.step(*batch())
    assert pair.general == general + 1  # the general path once: it finds the fast path made


class Scaled(torch.nn.Module):
    """A forward that reads a Python attribute (a guard: capture/guards.py)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.scale = 2.0

    def forward(self, x):
        return (self.lin(x) * self.scale).square().mean()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_python_state_change_leaves_the_fast_path(backend):
    """The Python state a capture read is checked on the fast path too: a new `scale` is a new
    program, with eager's loss and gradients."""
    torch.manual_seed(0)
    ref = Scaled()
    model = copy.deepcopy(ref)
    compiled = fusec.compile(model, backend=backend)
    for scale in (2.0, 2.0, 2.0, 5.0, 5.0, 2.0):
        ref.scale = model.scale = scale
        x = torch.randn(3, 8)
        loss, ref_loss = compiled(x), ref(x)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for p, q in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
            p.grad = q.grad = None
    assert compiled._compiled.compiles == 2


LIN = torch.nn.Linear(8, 4)


def through_a_global(x):
    return LIN(x).square().mean()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_function_reaching_a_module_through_a_global(backend):
    """A function (not a module) whose weights are a global module's: the fast path reads them
    where the global holds them, and a module bound to the global later is noticed."""
    global LIN
    compiled = fusec.compile(through_a_global, backend=backend)
    for step in range(5):
        if step == 3:
            LIN = torch.nn.Linear(8, 4)  # another module, of the same shapes
        x = torch.randn(3, 8)
        loss = compiled(x)
        loss.backward()
        grads = [p.grad for p in LIN.parameters()]
        for p in LIN.parameters():
            p.grad = None
        ref = through_a_global(x)
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
        for g, p in zip(grads, LIN.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
            p.grad = None


class _Ref:
    """Where a lifted tensor lives (what capture/guards.py's refs give the fast path)."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def expression(self, owner: str) -> str:
        return f"{owner}._parameters[{self.name!r}]"


def test_a_shape_family_check_decides_the_callers_sizes():
    """With `family_check`, the caller's tensors are checked for type, rank, dtype, device and
    requires_grad, and the family's check decides their sizes; the parameters keep exact checks."""
    from fusec.fastpath import MISS
    from fusec.runtime.training_call import training_fast_path
    lin = torch.nn.Linear(8, 4)
    seen = []

    def family_check(tensors):
        seen.append([tuple(t.shape) for t in tensors])
        return tensors[2].shape[1] == 8 and tensors[2].is_contiguous()
    state = [lin.weight, lin.bias]
    x = torch.randn(3, 8)
    fast = training_fast_path(lambda *ts: "hit", state, (), {"x": x},
                              [_Ref(lin, "weight"), _Ref(lin, "bias")], lin, ([], {}),
                              family_check=family_check)
    assert "x.shape" not in fast.source and "family_check(" in fast.source
    assert fast((), {"x": torch.randn(5, 8)}) == "hit"  # another batch size: the same path
    assert seen[-1] == [(4, 8), (4,), (5, 8)]
    assert fast((), {"x": torch.randn(5, 7)}) is MISS  # the family's check says no
    assert fast((), {"x": torch.randn(5, 8, dtype=torch.float64)}) is MISS
    assert fast((), {"x": torch.randn(5, 8, 1)}) is MISS  # another rank
    lin.weight = torch.nn.Parameter(torch.randn(4, 9))  # a parameter's sizes: checked exactly
    assert fast((), {"x": torch.randn(5, 8)}) is MISS
    without = training_fast_path(lambda *ts: "hit", state, (), {"x": x},
                                 [_Ref(lin, "weight"), _Ref(lin, "bias")], lin, ([], {}))
    assert "family_check(" not in without.source
