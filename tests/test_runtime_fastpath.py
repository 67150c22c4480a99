"""The thin runtime (issue 4): a repeated call goes through a generated guard and the program's
straight-line function, never through the general call path (fusec/api.py `_call`).

Behaviour only, never timing (benchmarks/overhead.py measures): results match eager through the
fast path on every backend, anything that changes the signature recompiles (or raises a clear
error) instead of reusing a program, outputs are fresh per call, and everything the general path
does (in-place updates, training, keyword arguments, nested inputs and outputs, modules) still
happens.
"""
import pytest
import torch

import fusec
from fusec.fastpath import MISS
from conftest import GPU, TRITON_DEVICE


def affine_sin(x, y):
    return torch.sin(x) * 2 + y


class GeneralPathTaken(AssertionError):
    pass


def forbid_general_path(cf, monkeypatch):
    """From now on, any call that leaves the fast path fails the test."""
    def refuse(args, kwargs):
        raise GeneralPathTaken("the call left the fast path")
    monkeypatch.setattr(cf, "_call", refuse)


def compiled(fn, backend, **options):
    return fusec.compile(fn, backend=backend, **options)


# ---- results through the fast path ------------------------------------------------------------

def test_repeated_calls_match_eager_without_the_general_path(target, monkeypatch):
    backend, device = target
    cf = compiled(affine_sin, backend)
    x, y = torch.randn(64, 32, device=device), torch.randn(32, device=device)
    torch.testing.assert_close(cf(x, y), affine_sin(x, y))  # compiles, prepares the fast path
    forbid_general_path(cf, monkeypatch)
    for _ in range(3):
        x, y = torch.randn(64, 32, device=device), torch.randn(32, device=device)
        torch.testing.assert_close(cf(x, y), affine_sin(x, y))
    assert "def fast(args)" in cf._fast.source


def test_the_guard_refuses_every_other_signature(target):
    backend, device = target
    cf = compiled(affine_sin, backend)
    x, y = torch.randn(8, 4, device=device), torch.randn(4, device=device)
    cf(x, y)
    others = [
        (torch.randn(9, 4, device=device), y),                    # shape
        (x.double(), y),                                          # dtype
        (torch.randn(4, 8, device=device).t(), y),                # strides
        (x.to("meta"), y),                                        # device
        (x.clone().requires_grad_(), y),                          # requires_grad
        (torch.nn.Parameter(x.clone(), requires_grad=False), y),  # a Tensor subclass
        (x,),                                                     # arity
        (x, 2.0),                                                 # not a tensor
    ]
    for args in others:
        assert cf._fast(args) is MISS, args
    assert cf._fast((x.clone(), y.clone())) is not MISS


def test_new_shape_dtype_or_strides_recompile(target):
    backend, device = target
    cf = compiled(affine_sin, backend)
    y = torch.randn(16, device=device)
    signatures = [torch.randn(8, 16, device=device), torch.randn(4, 16, device=device),
                  torch.randn(8, 16, device=device).double(),
                  torch.randn(16, 8, device=device).t()]
    programs = []
    for n, x in enumerate(signatures, start=1):
        for _ in range(2):  # the second call takes the fast path
            want = affine_sin(x, y.to(x.dtype))
            torch.testing.assert_close(cf(x, y.to(x.dtype)), want)
        assert len(cf.compiled) == n
        programs.append(cf.last)
    # alternating between known signatures: its own program every time, nothing compiled
    for _ in range(2):
        for x, program in zip(signatures, programs):
            torch.testing.assert_close(cf(x, y.to(x.dtype)), affine_sin(x, y.to(x.dtype)))
            assert cf.last is program
    assert len(cf.compiled) == len(signatures)


def test_another_device_is_never_run_on_a_stale_program():
    cf = compiled(affine_sin, "cpp")
    x, y = torch.randn(8, 4), torch.randn(4)
    cf(x, y)
    cf(x, y)
    with pytest.raises(fusec.DeviceError):
        cf(x.to("meta"), y.to("meta"))  # the C++ backend says why; it does not run the CPU program


@pytest.mark.skipif(not GPU, reason="needs a second device")
def test_cpu_then_cuda_compiles_twice():
    cf = fusec.compile(affine_sin)
    for device in ("cpu", "cuda", "cpu", "cuda"):
        x, y = torch.randn(8, 4, device=device), torch.randn(4, device=device)
        out = cf(x, y)
        assert out.device.type == device
        torch.testing.assert_close(out, affine_sin(x, y))
    assert len(cf.compiled) == 2


def test_outputs_of_call_n_survive_call_n_plus_1(target):
    backend, device = target
    cf = compiled(lambda x: (torch.sin(x) + 1, torch.cos(x)), backend)
    x = torch.randn(256, device=device)
    outs = []
    for _ in range(4):
        outs.append(cf(x))
        x.add_(1.0)  # same tensor, same address, new values
    for n, (a, b) in enumerate(outs):
        x_then = x - (4 - n)
        torch.testing.assert_close(a, torch.sin(x_then) + 1)
        torch.testing.assert_close(b, torch.cos(x_then))
    assert len({o[0].data_ptr() for o in outs}) == len(outs)


def test_empty_tensors(target):
    backend, device = target
    cf = compiled(torch.sin, backend)
    for _ in range(2):
        out = cf(torch.empty(0, 3, device=device))
        assert out.shape == (0, 3)


# ---- what the general path does, still done -----------------------------------------------------

def test_in_place_updates_of_inputs(target):
    backend, device = target

    def bump(x, y):
        x.mul_(2)
        return x, x + y

    cf = compiled(bump, backend)
    for _ in range(3):
        x, y = torch.randn(32, device=device), torch.randn(32, device=device)
        x_eager = x.clone()
        got = cf(x, y)
        want = bump(x_eager, y)
        assert got[0] is x  # the caller's own tensor, updated
        torch.testing.assert_close(x, x_eager)
        torch.testing.assert_close(got[1], want[1])


def test_requires_grad_inputs_train(target):
    backend, device = target
    cf = compiled(affine_sin, backend)
    x, y = torch.randn(16, 8, device=device), torch.randn(8, device=device)
    cf(x, y)
    cf(x, y)  # the fast path is ready for tensors that do not require grad
    xg = x.clone().requires_grad_()
    out = cf(xg, y)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(xg.grad, 2 * torch.cos(x))
    with torch.no_grad():  # the same tensor in inference: no graph, same numbers
        for _ in range(2):
            out = cf(xg, y)
            assert out.grad_fn is None
            torch.testing.assert_close(out, affine_sin(x, y))
    out = cf(xg, y)  # grad mode back on: trains again
    assert out.grad_fn is not None


def test_keyword_and_nested_arguments(target):
    backend, device = target

    def f(x, parts, *, scale=1.0):
        return {"y": x * scale + parts["b"], "z": (torch.sin(parts["a"]), None, 3)}

    cf = compiled(f, backend)
    x, a, b = (torch.randn(16, device=device) for _ in range(3))
    for scale in (1.0, 2.0, 1.0):
        got = cf(x, {"a": a, "b": b}, scale=scale)
        want = f(x, {"a": a, "b": b}, scale=scale)
        torch.testing.assert_close(got["y"], want["y"])
        torch.testing.assert_close(got["z"][0], want["z"][0])
        assert got["z"][1:] == (None, 3)
    # the same leaves in another place of the structure are another signature
    swapped = cf(x, {"b": b, "a": a})
    torch.testing.assert_close(swapped["y"], f(x, {"b": b, "a": a})["y"])
    torch.testing.assert_close(swapped["z"][0], torch.sin(a))


def test_output_structures_and_constants(target, monkeypatch):
    backend, device = target
    x = torch.randn(8, device=device)
    programs = [lambda x: torch.sin(x),
                lambda x: (torch.sin(x),),
                lambda x: [torch.sin(x), x * 2],
                lambda x: {"s": torch.sin(x), "n": None},
                lambda x: (torch.sin(x), None, 2.5, x),
                lambda x: x.shape,  # a torch.Size, not a tuple (benchmarks/opinfo_sweep.py)
                lambda x: (torch.sin(x), [x.size()], torch.broadcast_shapes(x.shape, (3, 1)))]
    for fn in programs:
        cf = compiled(fn, backend)
        cf(x)
        with monkeypatch.context() as m:
            forbid_general_path(cf, m)
            got, want = cf(x), fn(x)
        assert type(got) is type(want)
        is_size = lambda v: isinstance(v, torch.Size)  # noqa: E731
        got_leaves = torch.utils._pytree.tree_leaves(got, is_leaf=is_size)
        want_leaves = torch.utils._pytree.tree_leaves(want, is_leaf=is_size)
        assert len(got_leaves) == len(want_leaves)
        for g, w in zip(got_leaves, want_leaves):
            if isinstance(w, torch.Tensor):
                torch.testing.assert_close(g, w)
            else:
                assert type(g) is type(w) and g == w


def test_last_follows_the_call(target):
    backend, device = target
    cf = compiled(torch.sin, backend)
    small, big = torch.randn(3, device=device), torch.randn(5, 7, device=device)
    for x in (small, small, big, small):
        cf(x)
    assert "(3,)" in cf.source() and "(5, 7)" not in cf.source()


def test_check_mode_never_skips_the_check(monkeypatch):
    cf = compiled(torch.sin, "cpp", check=True)
    x = torch.randn(64)
    cf(x)
    calls = []
    import fusec.check
    real = fusec.check.check_outputs
    monkeypatch.setattr(fusec.check, "check_outputs", lambda *a: calls.append(1) or real(*a))
    cf(x)
    cf(x)
    assert len(calls) == 2


# ---- modules ----------------------------------------------------------------------------------

def test_module_parameters_are_read_at_every_call(target):
    backend, device = target
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Tanh()).to(device)
    cm = fusec.compile(model, backend=backend)
    x = torch.randn(4, 16, device=device)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(cm(x), model(x))
        model[0].weight.mul_(3)  # in place
        torch.testing.assert_close(cm(x), model(x))
        model[0].bias = torch.nn.Parameter(torch.randn(16, device=device))  # replaced
        torch.testing.assert_close(cm(x), model(x))
        n = len(cm._compiled.compiled)
        model[0].weight.data = torch.randn(32, device=device)[::2]  # new strides: recompiles
        torch.testing.assert_close(cm(x), model(x))
        assert len(cm._compiled.compiled) == n + 1


def test_module_training_flag_is_part_of_the_signature():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    cm = fusec.compile(model, backend="cpp")
    x = torch.randn(64, 8)
    with torch.no_grad():
        model.eval()
        for _ in range(2):
            torch.testing.assert_close(cm(x), model(x))
        model.train()
        dropped = cm(x)
        assert (dropped == 0).any()  # dropout is on: not the eval program
        model.eval()
        torch.testing.assert_close(cm(x), model(x))


# ---- the program's straight-line function ------------------------------------------------------

def test_straight_line_program_is_the_interpreted_program(target):
    backend, device = target

    def f(x, w):
        h = torch.relu(torch.sin(x) @ w) * 2
        return h, x.t(), h.sum(dim=1)

    cf = compiled(f, backend)
    x, w = torch.randn(8, 4, device=device), torch.randn(4, 6, device=device)
    cf(x, w)
    program = cf.last.program
    assert program.run.source.startswith("def run(inputs):")
    fast = program.run([x, w])
    slow = program.interpret([x, w])
    assert len(fast) == len(slow) == 3
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b)
        assert a.stride() == b.stride()
    for got, want in zip(cf(x, w), f(x, w)):
        torch.testing.assert_close(got, want)


def test_programs_a_cuda_graph_may_replay_take_the_general_run(monkeypatch):
    """A program CUDA graphs may replay (no blocker) goes through `_run` on the fast path too,
    which decides between a plain run, a capture and a replay. On the CPU, with cuda_graphs off,
    `_run` runs the program: what is checked is that the fast path calls it and rebuilds the
    outputs' structure."""
    from fusec.fastpath import no_fast_path
    programs = [lambda x: torch.sin(x),
                lambda x: (torch.sin(x), None, x),
                lambda x: [torch.sin(x), x * 2],
                lambda x: {"s": torch.sin(x)}]
    x = torch.randn(16)
    for fn in programs:
        cf = compiled(fn, "cpp", cuda_graphs=False)
        cf(x)
        cf.last.graph_blocker = None  # as if the program could be one CUDA graph
        cf._fast_paths.clear()
        cf._fast = no_fast_path
        cf(x)  # prepares the fast path again, now through `_run`
        runs = []
        real_run = cf._run
        monkeypatch.setattr(cf, "_run", lambda *a: runs.append(1) or real_run(*a))
        with monkeypatch.context() as m:
            forbid_general_path(cf, m)
            got, want = cf(x), fn(x)
        assert runs == [1]
        assert type(got) is type(want)
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            if isinstance(w, torch.Tensor):
                torch.testing.assert_close(g, w)
            else:
                assert g == w
        if isinstance(want, tuple):
            assert got[2] is x  # an input returned as it is


def test_a_step_the_writer_does_not_know_is_called_as_a_step(monkeypatch):
    """Steps without an emitter (here: every one but kernels) are written as calls of the step
    object on a dict of the live values: slower, same result."""
    from fusec.runtime import writer as runtime

    def f(x, w):
        h = torch.relu(torch.sin(x) @ w)
        return h, x.t(), torch.split(h, 2, dim=1)[1]

    monkeypatch.setattr(runtime, "_EMITTERS", {runtime.KernelStep: runtime._emit_kernel})
    cf = compiled(f, "cpp")
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    for _ in range(2):
        for got, want in zip(cf(x, w), f(x, w)):
            torch.testing.assert_close(got, want)
    assert "(env)" in cf.last.program.run.source
