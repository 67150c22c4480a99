"""Guards on the Python state a capture read (fusec/capture/guards.py), and autograd through
modules and tensors a program reaches through closures and globals.

Every case: the first call compiles, a repeated call with nothing changed compiles nothing, a
change gives eager's new answer through a new program (with the reason in the `recompiled`
event), and going back to an old value finds the old program again.
"""
import argparse
import dataclasses
import os
import types

import pytest
import torch
from torch import nn

import fusec
from fusec import events, fastpath

SCALE = 2.0
USE_SIN = True
W = torch.linspace(-1, 1, 8)
GLOBAL_LIN = nn.Linear(8, 4)


class Reasons:
    """Watches fusec's events: the reason of every recompile."""

    def __init__(self):
        self.said = []

    def recompiled(self, label, reason):
        self.said.append(reason)


@pytest.fixture
def reasons():
    watcher = events.watch(Reasons())
    yield watcher.said
    events.unwatch(watcher)


def same(cf, fn, x):
    """cf(x) equals eager fn(x); returns how many programs cf compiled so far."""
    torch.testing.assert_close(cf(x), fn(x))
    cf = getattr(cf, "_compiled", cf)
    return cf.compiles


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0
        self.use_sin = True

    def forward(self, x):
        y = x * self.scale
        return y.sin() if self.use_sin else y.cos()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Scaled()

    def forward(self, x):
        return self.inner(x) + 1


def test_module_attributes(target, reasons):
    backend, device = target
    m = Scaled()
    cm = fusec.compile(m, backend=backend)
    x = torch.randn(16, device=device)
    assert same(cm, m, x) == 1
    assert same(cm, m, x) == 1  # nothing changed: the fast path, no compile
    m.scale = 5.0
    assert same(cm, m, x) == 2
    assert reasons[-1] == "self.scale changed: 2.0 -> 5.0"
    m.use_sin = False  # a flag that picks the branch
    assert same(cm, m, x) == 3
    assert reasons[-1] == "self.use_sin changed: True -> False"
    assert cm._compiled.recompiles == reasons[-2:]  # what fusec.explain(cm, x) shows
    m.scale, m.use_sin = 2.0, True  # back: the first program again
    assert same(cm, m, x) == 3
    m.scale = 2  # an int is not the float it equals: eager's int scalar keeps x's dtype alike,
    assert same(cm, m, x) == 4  # but the guard checks the type (as Dynamo's does)


def test_submodule_attribute_and_training(target, reasons):
    backend, device = target
    m = Outer()
    cm = fusec.compile(m, backend=backend)
    x = torch.randn(16, device=device)
    assert same(cm, m, x) == 1
    m.inner.scale = -3.0
    assert same(cm, m, x) == 2
    assert reasons[-1] == "self.inner.scale changed: 2.0 -> -3.0"
    m.eval()  # `training` is part of the signature
    assert same(cm, m, x) == 3
    m.train()
    assert same(cm, m, x) == 3


def global_helper(x):
    return x.sin() if USE_SIN else x.cos()


def reads_globals(x):
    return global_helper(x * SCALE) + W


def test_globals_and_a_helper_function(target, reasons):
    global SCALE, USE_SIN, W
    backend, device = target
    if device != "cpu":
        pytest.skip("W is a CPU tensor")
    saved = SCALE, USE_SIN, W
    cf = fusec.compile(reads_globals, backend=backend)
    x = torch.randn(8)
    try:
        assert same(cf, reads_globals, x) == 1
        assert same(cf, reads_globals, x) == 1
        SCALE = 4.0
        assert same(cf, reads_globals, x) == 2
        assert reasons[-1] == "global SCALE changed: 2.0 -> 4.0"
        USE_SIN = False  # read by the helper the function calls
        assert same(cf, reads_globals, x) == 3
        assert reasons[-1] == "global USE_SIN changed: True -> False"
        W = torch.ones(8)  # another tensor (baked into the program: guarded by identity)
        assert same(cf, reads_globals, x) == 4
        assert "global W changed" in reasons[-1]
        W.mul_(3)  # the same tensor, written in place: the program reads it where it lives
        assert same(cf, reads_globals, x) == 4
    finally:
        SCALE, USE_SIN, W = saved


def closure(scale, mask):
    def f(x):
        return (x * scale + mask).relu()

    def set(new_scale=None, new_mask=None):
        nonlocal scale, mask
        if new_scale is not None:
            scale = new_scale
        if new_mask is not None:
            mask = new_mask
    return f, set


def test_closure_values(target, reasons):
    backend, device = target
    f, set_ = closure(1.5, torch.zeros(8, device=device))
    cf = fusec.compile(f, backend=backend)
    x = torch.randn(8, device=device)
    assert same(cf, f, x) == 1
    assert same(cf, f, x) == 1
    set_(new_scale=-1.0)
    assert same(cf, f, x) == 2
    assert reasons[-1] == "closure variable scale changed: 1.5 -> -1.0"
    set_(new_mask=torch.full((8,), 0.5, device=device))
    assert same(cf, f, x) == 3
    assert "closure variable mask changed" in reasons[-1]
    f.__closure__[0].cell_contents.add_(2.0)  # the mask, in place: no compile needed
    assert f.__code__.co_freevars[0] == "mask"
    assert same(cf, f, x) == 3


class Config:
    """A config object as models keep one (HF's PretrainedConfig is one of these)."""

    def __init__(self, **values):
        self.__dict__.update(values)


@dataclasses.dataclass
class Settings:
    scale: float = 2.0
    act: str = "relu"


class Configured(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.opts = {"shift": 1.0, "sizes": [1, 2]}
        self.weights = [0.5, 0.25]

    def forward(self, x):
        y = x * self.config.scale + self.opts["shift"] * self.weights[0]
        y = y + self.config.norm.eps
        return y.relu() if self.config.act == "relu" else y.sigmoid()


def test_config_objects_dicts_and_lists(target, reasons):
    """State inside a config object (and the config inside it), a dict and a list attribute."""
    backend, device = target
    m = Configured(Config(scale=2.0, act="relu", norm=Config(eps=0.5)))
    cm = fusec.compile(m, backend=backend)
    x = torch.randn(16, device=device)
    assert same(cm, m, x) == 1
    assert same(cm, m, x) == 1
    assert type(m.config) is Config and type(m.config.norm) is Config  # classes put back
    m.config.scale = 3.0
    assert same(cm, m, x) == 2
    assert reasons[-1] == "self.config.scale changed: 2.0 -> 3.0"
    m.config.norm.eps = -4.0  # a config inside the config
    assert same(cm, m, x) == 3
    assert reasons[-1] == "self.config.norm.eps changed: 0.5 -> -4.0"
    m.config.act = "sigmoid"
    assert same(cm, m, x) == 4
    m.opts["shift"] = 7.0  # an item of a dict, changed in place
    assert same(cm, m, x) == 5
    assert reasons[-1].startswith("self.opts changed: {'shift': 1.0")
    m.weights[0] = -1.0  # an item of a list
    assert same(cm, m, x) == 6
    assert reasons[-1] == "self.weights changed: [0.5, 0.25] -> [-1.0, 0.25]"
    m.config = Config(scale=2.0, act="relu", norm=Config(eps=0.5))  # another config object
    assert same(cm, m, x) == 7
    m.config.scale = 9.0
    assert same(cm, m, x) == 8


SETTINGS = Settings()
TABLE = {"scale": 3.0}
NAMESPACE = types.SimpleNamespace(scale=2.0)
ARGS = argparse.Namespace(scale=2.0)


def reads_config_globals(x):
    y = x * SETTINGS.scale * TABLE["scale"] * NAMESPACE.scale * ARGS.scale
    return y.relu() if SETTINGS.act == "relu" else y.tanh()


def test_config_globals(target, reasons):
    """A global dataclass, dict, SimpleNamespace (a C type: its whole __dict__ is guarded) and
    argparse.Namespace, each changed in place."""
    backend, device = target
    cf = fusec.compile(reads_config_globals, backend=backend)
    x = torch.randn(8, device=device)
    saved = dataclasses.replace(SETTINGS), dict(TABLE), vars(NAMESPACE).copy(), vars(ARGS).copy()
    try:
        assert same(cf, reads_config_globals, x) == 1
        SETTINGS.act = "tanh"
        assert same(cf, reads_config_globals, x) == 2
        assert reasons[-1] == "SETTINGS.act changed: 'relu' -> 'tanh'"
        TABLE["scale"] = -1.0
        assert same(cf, reads_config_globals, x) == 3
        assert reasons[-1] == "global TABLE changed: {'scale': 3.0} -> {'scale': -1.0}"
        NAMESPACE.scale = 0.5
        assert same(cf, reads_config_globals, x) == 4
        assert reasons[-1] == "vars(NAMESPACE) changed: {'scale': 2.0} -> {'scale': 0.5}"
        ARGS.scale = 4.0
        assert same(cf, reads_config_globals, x) == 5
        assert reasons[-1] == "ARGS.scale changed: 2.0 -> 4.0"
        SETTINGS.act = "relu"  # back to the first values: no compile
        TABLE["scale"], NAMESPACE.scale, ARGS.scale = 3.0, 2.0, 2.0
        assert same(cf, reads_config_globals, x) == 5
    finally:
        SETTINGS.scale, SETTINGS.act = saved[0].scale, saved[0].act
        TABLE.clear(), TABLE.update(saved[1])
        vars(NAMESPACE).update(saved[2]), vars(ARGS).update(saved[3])


def test_a_container_of_objects_is_not_guarded_by_contents():
    """A list of modules (or anything but constants) has no contents guard: its items are not
    values the graph froze, they are followed where the program reads them as modules."""
    from fusec.capture import guards
    assert guards._kind([nn.ReLU()]) is None
    assert guards._kind(list(range(guards.CONTAINER_LIMIT + 1))) is None
    assert guards._kind({"a": (1, 2.0, "x"), "b": [None, True]}) == "container"
    frozen = guards.freeze({"a": [1, {2: 3.0}]})
    assert guards._thaw(frozen) == {"a": [1, {2: 3.0}]} and hash(frozen)


def test_a_value_that_changes_every_call_reaches_the_limit(monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "3")
    m = Scaled()
    cm = fusec.compile(m, backend="cpp")
    x = torch.randn(8)
    with pytest.warns(UserWarning, match="recompile limit"):
        for step in range(6):
            m.scale = float(step)
            torch.testing.assert_close(cm(x), m(x))
    assert cm._compiled.compiles == 3


def test_no_python_state_no_guard():
    """A program that reads no Python state has no guard line in its fast path."""
    x = torch.randn(8)
    cf = fusec.compile(lambda x: torch.sin(x) * 2, backend="cpp")
    cf(x)
    assert "try:" not in cf._fast.source
    lin = nn.Linear(8, 4)  # (no submodules: no guard on its tree either)
    cm = fusec.compile(lin, backend="cpp")
    with torch.no_grad():
        cm(x)
    # a module's one guard: that no hook was registered since (`NoHooks`, one id compare)
    source = cm._compiled._fast.source
    assert source.count("g_s") == 1 and "g_s0.ids" in source, source


class ReadsWhatIsNotThere(nn.Module):
    """What library code does: an environment variable looked up with `os.environ.get` that is
    not set, an optional attribute read with `getattr(self, name, None)` that is not there."""

    def forward(self, x):
        y = x * 2
        if os.environ.get("FUSEC_TEST_UNSET_FLAG"):
            y = y + 1
        shift = getattr(self, "shift", None)
        return y if shift is None else y + shift


@pytest.mark.parametrize("grad", [False, True])
def test_a_value_that_is_not_there_keeps_the_fast_path(grad, reasons, monkeypatch):
    """A capture that read something missing guards that it stays missing (one `in` or
    `hasattr` a call): calls like the last take the fast path (the generated check hits, no
    general path) where such a program sent every call through the general path; setting the
    variable or the attribute gives eager's answer through a new program, and removing them
    finds the first program again."""
    monkeypatch.delenv("FUSEC_TEST_UNSET_FLAG", raising=False)
    model = ReadsWhatIsNotThere()
    cm = fusec.compile(model, backend="cpp")
    cf = cm._compiled
    x = torch.randn(8, requires_grad=grad)

    def call():
        with torch.set_grad_enabled(grad):
            return cm(x)
    for _ in range(2):
        torch.testing.assert_close(call(), x * 2)
    fast = cf._train_fast if grad else cf._fast
    assert "'FUSEC_TEST_UNSET_FLAG' in" in fast.source and "hasattr(" in fast.source, fast.source
    with torch.set_grad_enabled(grad):
        assert fast(*(((x,), {}) if grad else ((x,),))) is not fastpath.MISS
    monkeypatch.setattr(cf, "_call", lambda *a: pytest.fail("a call like the last took the "
                                                             "general path"))
    torch.testing.assert_close(call(), x * 2)
    monkeypatch.undo()
    monkeypatch.setenv("FUSEC_TEST_UNSET_FLAG", "1")
    torch.testing.assert_close(call(), x * 2 + 1)
    model.shift = 3.0
    torch.testing.assert_close(call(), x * 2 + 4)
    assert cf.compiles == 3
    monkeypatch.delenv("FUSEC_TEST_UNSET_FLAG")
    del model.shift
    torch.testing.assert_close(call(), x * 2)
    assert cf.compiles == 3 and len(reasons) == 2, reasons


# ---- the module tree: submodules replaced, added, removed ----------------------------------------

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(6, 3))

    def forward(self, x):
        x = self.lin(x)
        for layer in self.layers:
            x = layer(x).tanh()
        return self.head(x)


CHANGES = {  # what a user does to the model between calls
    "a submodule replaced": lambda m: setattr(m, "lin", nn.Linear(6, 6)),
    "a ModuleList grows": lambda m: m.layers.append(nn.Linear(6, 6)),
    "a Sequential's child replaced": lambda m: m.head.__setitem__(0, nn.GELU()),
    "a layer deleted": lambda m: m.layers.__delitem__(0),
    "a subtree replaced": lambda m: setattr(m, "head", nn.Sequential(nn.Linear(6, 6), nn.SiLU(),
                                                                     nn.Linear(6, 3))),
    "a bias set to None": lambda m: setattr(m.lin, "bias", None),
    "a weight replaced": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(6, 6))),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("grad", [False, True])
def test_a_changed_module_tree_gives_eagers_answer(change, grad):
    """Eager runs the tree as it is on each call: so does the compiled module, after any of
    these changes (each once the fast path is made), compiling again where it must and saying
    which child changed; the changed tree is guarded in turn (a second change is seen too)."""
    model = Block()
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(4, 6)
    with torch.set_grad_enabled(grad):
        for _ in range(2):
            torch.testing.assert_close(cm(x), model(x))
        CHANGES[change](model)
        torch.testing.assert_close(cm(x), model(x))
        if change == "a subtree replaced":
            model.head[1] = nn.ReLU()  # inside the new subtree
            torch.testing.assert_close(cm(x), model(x))
            assert "self.head.1 changed: SiLU" in cm._compiled.recompiles[-1]
    if change == "a submodule replaced" and not grad:
        assert "self.lin changed: Linear" in cm._compiled.recompiles[-1]


# ---- autograd through closures and globals ------------------------------------------------------

def lin_closure():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    return lin, (lambda x: torch.tanh(lin(x)).sum())


def global_lin(x):
    return torch.tanh(GLOBAL_LIN(x)).sum()


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("where", ["closure", "global"])
def test_gradients_of_a_reached_module(target, fullgraph, where):
    backend, device = target
    if where == "closure":
        lin, f = lin_closure()
    else:
        lin, f = GLOBAL_LIN, global_lin
    saved = [p.detach().clone() for p in lin.parameters()]
    lin.to(device)
    try:
        cf = fusec.compile(f, backend=backend, fullgraph=fullgraph)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        x = torch.randn(3, 8, device=device)
        for step in range(2):  # the second call runs with the optimizer's new weights
            loss = cf(x)
            assert loss.requires_grad
            want = f(x)
            torch.testing.assert_close(loss, want)
            (want_w, want_b) = torch.autograd.grad(want, [lin.weight, lin.bias])
            opt.zero_grad()
            loss.backward()
            torch.testing.assert_close(lin.weight.grad, want_w)
            torch.testing.assert_close(lin.bias.grad, want_b)
            opt.step()
        assert [k[0] for k in cf.compiled] == ["train"]  # one forward-backward pair, kept
    finally:
        with torch.no_grad():
            for p, s in zip(lin.parameters(), saved):
                p.copy_(s)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_gradients_of_a_closure_tensor(target, fullgraph):
    backend, device = target
    w = torch.randn(8, device=device, requires_grad=True)

    def f(x):
        return (x * w).sin().sum()
    cf = fusec.compile(f, backend=backend, fullgraph=fullgraph)
    x = torch.randn(4, 8, device=device)
    loss = cf(x)
    assert loss.requires_grad
    loss.backward()
    want = torch.autograd.grad(f(x), w)[0]
    torch.testing.assert_close(w.grad, want)
    with torch.no_grad():  # an in-place update, as an optimizer's: the next call sees it
        w.sub_(0.5 * w.grad)
    torch.testing.assert_close(cf(x), f(x))


def test_a_global_rebound_to_another_module(target):
    """`GLOBAL_LIN = nn.Linear(...)` again: its new weights are lifted, not the old ones."""
    global GLOBAL_LIN
    backend, device = target
    old = GLOBAL_LIN
    try:
        GLOBAL_LIN = nn.Linear(8, 4).to(device)
        cf = fusec.compile(global_lin, backend=backend)
        x = torch.randn(3, 8, device=device)
        with torch.no_grad():
            assert same(cf, global_lin, x) == 1
            GLOBAL_LIN = nn.Linear(8, 4).to(device)
            assert same(cf, global_lin, x) == 2
            assert cf._state()[0] is GLOBAL_LIN.weight
    finally:
        GLOBAL_LIN = old


def test_gradients_of_a_plain_tensor_attribute(target):
    """A module attribute that is a tensor needing grad (not registered as a parameter)."""
    backend, device = target

    class Gain(nn.Module):
        def __init__(self):
            super().__init__()
            self.__dict__["gain"] = torch.full((8,), 1.5, device=device, requires_grad=True)

        def forward(self, x):
            return (x * self.gain).tanh().sum()
    m = Gain()
    cm = fusec.compile(m, backend=backend)
    x = torch.randn(4, 8, device=device)
    loss = cm(x)
    loss.backward()
    want = torch.autograd.grad(m(x), m.gain)[0]
    torch.testing.assert_close(m.gain.grad, want)


def test_saved_programs_follow_the_state(tmp_path, monkeypatch):
    """A program saved for one value of an attribute is not loaded for another (the fingerprint
    writes down the values the torch calls get), and a loaded program is guarded like any."""
    from fusec import cache
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_SAVED_PROGRAMS", raising=False)
    x = torch.randn(16)
    m = Scaled()
    assert same(fusec.compile(m, backend="cpp"), m, x) == 1  # compiled and saved
    loaded = cache.STATS["programs loaded"]
    m.scale = 5.0  # "a later process" with another scale: its own program
    assert same(fusec.compile(m, backend="cpp"), m, x) == 1
    assert cache.STATS["programs loaded"] == loaded
    m.scale = 2.0  # the first state again: loaded from disk, and guarded
    cm = fusec.compile(m, backend="cpp")
    assert same(cm, m, x) == 1
    assert cache.STATS["programs loaded"] == loaded + 1
    m.scale = -1.0
    assert same(cm, m, x) == 2


def test_first_calls_from_several_threads_compile_once():
    """Threads that waited for another's compile find its program, though their keys were made
    before that capture found the guards."""
    import threading
    m = Scaled()
    cm = fusec.compile(m, backend="cpp")
    x = torch.randn(16)
    results, start = [], threading.Barrier(4)

    def call():
        start.wait()
        results.append(cm(x))
    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:
        torch.testing.assert_close(r, m(x))
    assert cm._compiled.compiles == 1
