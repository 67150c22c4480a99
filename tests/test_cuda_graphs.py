"""CUDA graphs: the whole program replayed as one graph. Needs a GPU (runs in the GPU session)."""
import pytest
import torch

import fusec
from conftest import GPU

pytestmark = pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU (and real Triton: "
                                                 "not TRITON_INTERPRET=1)")


def f(x, y):
    # a softmax kernel, a matmul, and a kernel after it: three launches, one graph
    return (torch.softmax(torch.sin(x) * y, dim=-1) @ x.t()) + 1.0


def test_graphs_give_the_same_results_as_plain_launches():
    x, y = torch.randn(64, 128, device="cuda"), torch.randn(128, device="cuda")
    graphed = fusec.compile(f)
    plain = fusec.compile(f, cuda_graphs=False)
    for _ in range(4):
        torch.testing.assert_close(graphed(x, y), plain(x, y), rtol=0, atol=0)
    assert graphed.last.runner is not None, graphed.last.graph_blocker
    assert plain.last.runner is None


def test_replay_sees_inputs_changed_in_place_and_keeps_old_outputs():
    x, y = torch.randn(64, 128, device="cuda"), torch.randn(128, device="cuda")
    cf = fusec.compile(f)
    outs = []
    for i in range(4):
        x.add_(0.5)  # same address, new contents
        outs.append(cf(x, y))
        torch.testing.assert_close(outs[-1], f(x, y))
    assert cf.last.runner is not None
    for a, b in zip(outs, outs[1:]):
        assert not torch.equal(a, b)  # call N's output survived call N+1
    z = torch.randn(64, 128, device="cuda")  # another address
    torch.testing.assert_close(cf(z, y), f(z, y))


def test_new_shape_captures_a_new_graph():
    cf = fusec.compile(f)
    for n in (32, 48, 32):
        x, y = torch.randn(n, 128, device="cuda"), torch.randn(128, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(cf(x, y), f(x, y))
    assert len(cf.compiled) == 2


def test_module_parameters_read_in_place_and_recaptured_when_replaced():
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.GELU()).cuda()
    cm = fusec.compile(model)
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(cm(x), model(x))
        model[0].weight.mul_(2)  # updated in place: the graph reads it
        torch.testing.assert_close(cm(x), model(x))
        model[0].weight = torch.nn.Parameter(torch.randn(64, device="cuda"))  # replaced
        torch.testing.assert_close(cm(x), model(x))


def test_programs_that_write_inputs_are_not_graphed():
    def g(x):
        x.add_(1)
        return x * 2
    cf = fusec.compile(g)
    x = torch.zeros(8, device="cuda")
    for i in range(3):
        cf(x)
    assert torch.equal(x, torch.full_like(x, 3.0))
    assert cf.last.graph_blocker and "in place" in cf.last.graph_blocker


class KVCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4, 16, 8, device="cuda"))

    def forward(self, k, pos):
        self.cache.index_copy_(2, pos, k)  # written in place (passes/reinplace.py)
        return torch.softmax(self.cache.sum(-1), dim=-1)


def test_buffer_updated_in_place_is_graphed_and_written_on_every_replay():
    module, twin = KVCache(), KVCache()
    cm = fusec.compile(module)
    with torch.no_grad():
        for step in range(5):
            k, pos = torch.randn(2, 4, 1, 8, device="cuda"), torch.tensor([step], device="cuda")
            torch.testing.assert_close(cm(k, pos), twin(k, pos))
            torch.testing.assert_close(module.cache, twin.cache, rtol=0, atol=0)
    last = cm._compiled.last
    assert last.graph_blocker is None and last.runner is not None, last.graph_blocker


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.count.add_(1)  # not idempotent: the capture's warm-up must not count
        return x * self.count


def test_buffer_written_by_a_graph_counts_each_call_once():
    module, twin = Counter(), Counter()
    cm = fusec.compile(module)
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        for step in range(5):
            torch.testing.assert_close(cm(x), twin(x))
            assert module.count.item() == twin.count.item() == step + 1


def test_user_input_updated_by_index_put_is_not_graphed():
    def write(cache, k, pos):
        cache.index_copy_(1, pos, k)
        return cache.sum(1)
    cf = fusec.compile(write)
    cache, twin = torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda")
    for step in range(3):
        k, pos = torch.randn(4, 1, device="cuda"), torch.tensor([step], device="cuda")
        torch.testing.assert_close(cf(cache, k, pos), write(twin, k, pos))
        torch.testing.assert_close(cache, twin)
    assert cf.last.graph_blocker and "in place" in cf.last.graph_blocker


def test_several_compiled_models_alive_at_once_share_the_capture_stream():
    """Two graphed models (matmuls in both: they share one capture stream and its cuBLAS
    workspace), called in turns under no_grad: each replays its own graph, right every time,
    and in-place outputs (passes/schedule.py, plan_inplace) stay per call."""
    from fusec.demo import load_example
    from fusec.runtime import capture_stream
    mlp = load_example("gelu_mlp").example(batch=16, dim=64, device="cuda")
    gpt = load_example("gpt2_block").example(batch=2, seq=16, n_embd=32, n_head=2, device="cuda")
    a, b = fusec.compile(mlp.fn), fusec.compile(gpt.fn)
    with torch.no_grad():
        outs = []
        for _ in range(4):
            outs.append((a(*mlp.inputs), b(*gpt.inputs)))
            torch.testing.assert_close(outs[-1][0], mlp.fn(*mlp.inputs))
            torch.testing.assert_close(outs[-1][1], gpt.fn(*gpt.inputs))
        assert a._compiled.last.runner is not None and b._compiled.last.runner is not None
        assert b._compiled.last.inplace  # softmax over the scores, ...
        first = [o.clone() for o in outs[0]]
        a(*mlp.inputs), b(*gpt.inputs)
        assert all(torch.equal(x, y) for x, y in zip(outs[0], first))  # not overwritten
    from fusec.runtime import cuda_graphs as runtime
    assert list(runtime._CAPTURE_STREAMS.values()) == [capture_stream(torch.device("cuda"))]


def test_big_memory_bound_program_runs_step_by_step_and_says_why():
    """A matmul and a softmax over 64 MB each: the GPU's own time (tens of us at least) hides the
    two launches, so a graph would only add the copy of the input and the output
    (fusec/runtime/cuda_graphs.py)."""
    def g(x):
        return torch.softmax(x @ x, dim=-1)
    x = torch.randn(4096, 4096, device="cuda")
    cf = fusec.compile(g)
    for _ in range(3):
        torch.testing.assert_close(cf(x), g(x))
    assert cf.last.runner is None
    assert "hide behind the GPU" in cf.last.graph_blocker, cf.last.graph_blocker


def test_sliced_and_expanded_inputs_keep_their_strides_in_the_graph():
    """The graph's own copy of an input has the input's strides: the program was compiled for
    them. A slice (`kv[..., 64:]`, gaps between rows) once came back contiguous from `clone()`,
    and every replay read the wrong elements; an expanded input keeps its broadcast dim."""
    kv = torch.randn(32, 256, device="cuda")
    b = torch.randn(1, 128, device="cuda")
    fn = lambda x, y: (torch.sin(x) * y + 1.0) @ x.t()  # noqa: E731
    graphed = fusec.compile(fn)
    for step in range(4):
        kv.mul_(1.5)
        x, y = kv[:, 128:], b.expand(32, 128)  # a slice of kv, read with kv's row stride
        # (the kernel's multiply-add is one FMA on the GPU: a few ulp from eager's two roundings;
        # reading the wrong elements was off by the values themselves)
        torch.testing.assert_close(graphed(x, y), fn(x, y), rtol=1e-4, atol=1e-4)
    assert graphed.last.runner is not None, graphed.last.graph_blocker


def test_static_copy_keeps_strides():
    from fusec.runtime.cuda_graphs import copy_into, static_copy
    t = torch.randn(2, 12, device="cuda")[:, 6:]
    s = static_copy(t)
    assert s.stride() == t.stride() and torch.equal(s, t)
    e = torch.randn(1, 3, device="cuda").expand(4, 3)
    s = static_copy(e)
    assert s.stride() == (0, 1) and torch.equal(s, e)
    new = torch.randn(3, device="cuda").expand(4, 3)
    assert torch.equal(copy_into(s, new), new)
