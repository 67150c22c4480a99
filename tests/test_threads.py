"""Compiling and calling from several threads at once (a web server's workers): no failure,
eager's answers, one compile per signature, and `print` left as it was.

Capture runs one at a time in the process (fusec/capture/tracing.py, "Note (tracing and
threads)"), a compiled function compiles one signature at a time (CompiledFunction._compile_new),
and a program whose intermediates live in a pool runs in one thread at a time (api.py,
`one_at_a_time`).
"""
from __future__ import annotations

import builtins
import threading

import pytest
import torch

import fusec
from fusec import events
from fusec.errors import GraphBreakError

BACKENDS = ["cpp", "llvm", "triton"]
N_THREADS = 8


def softmaxish(x):
    return torch.softmax(x * 2, -1) + x.sum(-1, keepdim=True)


def mlp(x, w):  # two intermediates in the program's pool (memory plan: 512 bytes)
    h = torch.relu(x @ w)
    return (h @ w).sigmoid() @ w


def _in_threads(work) -> list:
    """Run work(i) in N_THREADS threads that start together; returns the errors raised."""
    start = threading.Barrier(N_THREADS)
    errors = []

    def body(i):
        try:
            start.wait()
            work(i)
        except BaseException as err:  # noqa: BLE001 (every failure is reported by the test)
            errors.append(err)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(N_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.fixture(autouse=True)
def _print_untouched(monkeypatch):
    monkeypatch.setenv("FUSEC_RECOMPILE_LIMIT", "16")  # 8 shapes per function here
    real = builtins.print
    yield
    assert builtins.print is real
    print("print still prints")  # (raised GraphBreakError for the rest of the process)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_shared_function_same_shape(backend):
    cf = fusec.compile(softmaxish, backend=backend)
    xs = [torch.randn(4, 8) for _ in range(N_THREADS)]
    results = {}

    def work(i):
        for _ in range(3):
            results[i] = cf(xs[i])

    assert _in_threads(work) == []
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], softmaxish(x))
    assert cf.compiles == 1 and len(cf.compiled) == 1  # the others waited for that compile


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [False, None])
def test_one_shared_function_different_shapes(backend, dynamic):
    """Every thread a size of its own: one program per size (dynamic=False), or, by default, a
    shape family that one thread compiles and the others find once they get the lock (the size
    of 1 row and the first size stay programs of their own)."""
    cf = fusec.compile(softmaxish, backend=backend, dynamic=dynamic)
    xs = [torch.randn(i + 1, 8) for i in range(N_THREADS)]
    results = {}

    def work(i):
        for _ in range(2):
            results[i] = cf(xs[i])

    assert _in_threads(work) == []
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], softmaxish(x))
    if dynamic is False:
        assert cf.compiles == N_THREADS
    else:
        assert cf.compiles <= 3 and len(cf.families) == 1, (cf.compiles, cf.recompiles)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_a_module_called_in_threads_while_one_compiles(backend):
    """A served module: threads call it compiled, with sizes of their own, and eagerly, while
    another thread compiles it. Capture traces a copy of the module tree, so no call meanwhile
    sees the traced parameters (it read fake tensors before: a crash, or a wrong answer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    cm = fusec.compile(model, backend=backend, dynamic=False)
    xs = [torch.randn(i + 1, 8) for i in range(N_THREADS)]
    with torch.no_grad():
        want = [model(x) for x in xs]

    def work(i):
        with torch.no_grad():
            for _ in range(3):
                run = cm if i % 2 else model  # (half of them eager)
                torch.testing.assert_close(run(xs[i]), want[i])
                torch.testing.assert_close(cm(xs[(i + 1) % N_THREADS]), want[(i + 1) % N_THREADS])

    assert _in_threads(work) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_functions(backend):
    fns = [fusec.compile(softmaxish, backend=backend) for _ in range(N_THREADS)]
    xs = [torch.randn(2 + i % 3, 8) for i in range(N_THREADS)]
    results = {}

    def work(i):
        for _ in range(2):
            results[i] = fns[i](xs[i])

    assert _in_threads(work) == []
    for i, x in enumerate(xs):
        torch.testing.assert_close(results[i], softmaxish(x))


def test_a_program_with_a_pool_runs_in_many_threads():
    """Two threads running one program at once would share its pool of intermediates."""
    cf = fusec.compile(mlp, backend="cpp")
    w = torch.randn(16, 16) / 4
    xs = [torch.randn(8, 16) for _ in range(N_THREADS)]
    cf(xs[0], w)
    assert cf.last.program.memory.pool_bytes > 0
    bad = []

    def work(i):
        want = mlp(xs[i], w)
        for _ in range(200):
            if not torch.allclose(cf(xs[i], w), want, rtol=1e-4, atol=1e-5):
                bad.append(i)

    assert _in_threads(work) == []
    assert bad == []


def test_print_in_other_threads_while_one_captures(capsys):
    """A capture refuses `print` in the program it traces, not in the threads beside it."""
    def noisy(x):
        print("traced")
        return x + 1

    stop = threading.Event()
    refused = []

    def capture_again_and_again():
        while not stop.is_set():
            try:
                fusec.compile(noisy, backend="cpp", fullgraph=True)(torch.ones(2))
            except GraphBreakError:
                refused.append(1)

    t = threading.Thread(target=capture_again_and_again)
    t.start()
    try:
        for _ in range(300):
            print("main thread")  # would raise GraphBreakError while the other thread traces
    finally:
        stop.set()
        t.join(timeout=120)
    assert refused  # the traced program's print was refused every time
    assert capsys.readouterr().out.count("main thread") == 300


def test_training_calls_from_many_threads():
    """Gradients needed: AOT Autograd compiles forward and backward on the first call, once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cm = fusec.compile(model, backend="cpp")
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(N_THREADS)]
    grads = {}

    class Count:
        programs = 0

        def compiled(self, compiled_graph, label):
            Count.programs += 1

    events.watch(count := Count())

    def work(i):
        out = cm(xs[i]).square().sum()
        grads[i] = torch.autograd.grad(out, xs[i])[0]

    assert _in_threads(work) == []
    for i, x in enumerate(xs):
        want = torch.autograd.grad(model(x).square().sum(), x)[0]
        torch.testing.assert_close(grads[i], want, rtol=1e-4, atol=1e-5)
    events.unwatch(count)
    assert len([k for k in cm._compiled.compiled if k[0] == "train"]) == 1
    assert Count.programs == 2  # one forward, one backward


def test_a_graph_handed_twice_to_the_training_compiler_is_compiled_once():
    """AOT Autograd compiles a backward on its first `.backward()` without a lock: threads that
    start their first backward together each hand fusec the same graph (a deep copy). The
    second gets the first one's function, so the program count above stays two."""
    import copy

    from fusec.capture.training import graph_compiler

    gm = torch.fx.symbolic_trace(lambda x: (x * 2).sin())
    parts: list = []
    compile_part = graph_compiler(lambda g: fusec.compile(g, backend="cpp"), parts)
    x = torch.randn(3, 4)
    first = compile_part(copy.deepcopy(gm), [x])
    assert compile_part(copy.deepcopy(gm), [x]) is first
    assert compile_part(copy.deepcopy(gm), [torch.randn(5, 4)]) is not first  # other inputs
    assert len(parts) == 2
    torch.testing.assert_close(first([x.clone()]), (x * 2).sin())
