"""cf.source() includes the program as runnable Python (like torch.compile's output code):
executing that wrapper gives the same results as the compiled function."""
import torch

import fusec
from fusec.demo import load_example
from fusec.runtime import python_wrapper


def run_wrapper(compiled_graph, *inputs):
    namespace: dict = {}
    exec(python_wrapper(compiled_graph.program), namespace)
    return namespace["call"](*inputs)


def test_wrapper_runs_and_matches(target):
    backend, device = target

    def f(x, w):
        return torch.relu(torch.sin(x) @ w).t() @ w + 1
    x, w = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    cf = fusec.compile(f, backend=backend)
    want = cf(x, w)
    (got,) = run_wrapper(cf.last, x, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert "def call(x, w):" in cf.source()


def test_gpt2_block_wrapper(target):
    backend, device = target
    ex = load_example("gpt2_block").example(batch=2, seq=16, n_embd=32, n_head=2, device=device)
    with torch.no_grad():
        cm = fusec.compile(ex.fn, backend=backend)
        want = cm(*ex.inputs)
        last = cm._compiled.last
        params = [*last.captured.lifted]
        (got,) = run_wrapper(last, *params, *ex.inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_shown_program_is_the_program_that_runs(target):
    """One writer: cf.source() holds the very text Program.run was compiled from, and every
    global that text reads is defined above it."""
    backend, device = target

    def f(x, w):
        return torch.sin(x) @ w + 1
    x, w = torch.randn(4, 16, device=device), torch.randn(16, 16, device=device)
    cf = fusec.compile(f, backend=backend)
    cf(x, w)
    run = cf.last.program.run
    assert run.source.startswith("def run(inputs):") and run.source in cf.source()
    shown = python_wrapper(cf.last.program)
    for definition in run.definitions:
        assert definition in shown


def test_spell_makes_the_value_again():
    from fusec.ir import Layout
    from fusec.runtime.writer import spell
    values = [3, 2.5, float("inf"), None, "x", torch.float16, torch.device("cpu"),
              torch.channels_last, torch.ops.aten.mm.default, Layout("x", (2, 3), (3, 1), 0),
              [1, (2, 3)], (torch.int8,)]
    scope = {"torch": torch, "Layout": Layout}
    for v in values:
        assert eval(spell(v), scope) == v, v
    # small constant tensors are written out exactly (values, dtype, strides); others are not
    for t in [torch.ones(2), torch.randn(3, 4).t().to(torch.bfloat16), torch.arange(6) > 2,
              torch.randn(2, 3, dtype=torch.float16)]:
        again = eval(spell(t), scope)
        assert again.dtype == t.dtype and again.stride() == t.stride() and torch.equal(again, t)
    assert spell(torch.ones(5000)) is None  # past SPELLED_TENSOR_ELEMENTS
    assert spell(torch.tensor([1.0, float("nan")])) is None
    assert spell(torch.ones(3).expand(2, 3)) is None


def test_common_externs_are_called_through_torchs_binding():
    """A convolution and a linear layer's addmm are written as `torch.convolution` and
    `torch.addmm` (writer.py, Note: an extern call through torch's own binding), their list
    arguments spelled out, and the shown program runs to eager's result."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    cf = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        torch.testing.assert_close(cf(x), model(x))
        program = cf._compiled.last.program
        definitions = "\n".join(program.run.definitions)
        assert "= torch.convolution" in definitions and "= torch.addmm" in definitions
        assert "immutable_list made while compiling" not in definitions, definitions
        scope: dict = {}
        exec(python_wrapper(program), scope)
        torch.testing.assert_close(scope["call"](*(list(model.state_dict().values()) + [x]))[0],
                                   model(x))


def test_views_of_pool_buffers_are_made_once():
    """`y.t() @ y.sin()`: the transpose handed to the matmul is a view of a buffer carved out of
    the pool, the same memory on every call, so the program makes it once (a global) instead of
    calling as_strided per call; the answers stay eager's call after call, with new inputs."""
    def f(x, w):
        y = torch.relu(x @ w + 1)
        return (y.t() @ y.sin()).sum(0)
    cf = fusec.compile(f, backend="cpp")
    for seed in range(3):
        torch.manual_seed(seed)
        x, w = torch.randn(8, 16), torch.randn(16, 16)
        torch.testing.assert_close(cf(x, w), f(x, w))
    source = cf.last.program.run.source
    assert "a view of _relu, made once" in source and ".as_strided(" not in source, source
