"""runtime/training_graphs.py: a training step's forward and backward replayed as CUDA graphs.

Each test trains a small convolutional classifier (convolution, batch norm, ReLU, pooling, a
linear layer, cross-entropy) in float32 on the GPU, once eagerly and once through
`fusec.compile`, and compares the parameters after the steps. The graphs are captured at the
second call of each program and replayed after; the ways a training loop can hold on to what a
replay would overwrite (two forwards before one backward, gradients accumulated over several
backwards, losses and outputs kept in a list) must give eager's numbers. Without a GPU those
tests skip; the last two run on the CPU (what the runtime decides before any graph).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusec
from conftest import GPU
from fusec.runtime.training_graphs import program_position, training_blocker

gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with Triton compiling for it")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        logits = self.fc(h.flatten(1))
        return F.cross_entropy(logits, y), logits


def batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g).cuda(), torch.randint(0, 10, (8,), generator=g).cuda())
            for _ in range(n)]


def setup(compile_it: bool, **options):
    torch.manual_seed(0)
    model = Net().cuda()
    options.setdefault("cuda_graphs", True)  # (training graphs are on where asked for)
    run = fusec.compile(model, **options) if compile_it else model
    return model, run, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def graphs_of(run) -> list:
    """The TrainingGraph of each training program (forward, backward), None where it has none."""
    return [part.last.__dict__.get("training_graph") if part.last is not None else None
            for part in run.train_parts]


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(a.bn.running_mean, b.bn.running_mean, rtol=1e-4, atol=1e-5)


def plain_loop(compile_it: bool, data: list, **options):
    model, run, opt = setup(compile_it, **options)
    kept = []
    for x, y in data:
        loss, logits = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        kept.append((loss, logits))  # (a replay must not overwrite what an earlier step returned)
    return model, run, kept


@gpu
def test_a_training_step_replays_forward_and_backward():
    data = batches(7)
    eager, _, eager_kept = plain_loop(False, data)
    model, run, kept = plain_loop(True, data)
    assert_same_parameters(model, eager)
    for (loss, logits), (e_loss, e_logits) in zip(kept, eager_kept):
        torch.testing.assert_close(loss, e_loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, e_logits, rtol=1e-4, atol=1e-5)
    graphs = graphs_of(run)
    assert len(graphs) == 2 and all(g is not None for g in graphs), \
        [part.last.__dict__.get("training_graph_blocker") for part in run.train_parts]
    assert all(g.replays >= 5 for g in graphs)  # captured at the second step, replayed from it
    assert graphs[0].handed and graphs[1].ptrs  # activations handed over, read in place
    text = str(fusec.explain(run, *data[0]))
    assert "forward: one CUDA graph, replayed" in text and "backward: one CUDA graph" in text


def same_as_eager(train) -> "fusec.CompiledModule":
    """`train(run, opt)` once eagerly and once through fusec (graphs on): the same parameters
    after it. Returns the compiled module."""
    trained = []
    for compile_it in (False, True):
        model, run, opt = setup(compile_it)
        train(run, opt)
        trained.append((model, run))
    assert_same_parameters(trained[1][0], trained[0][0])
    return trained[1][1]


@gpu
def test_two_forwards_before_one_backward():
    """The second forward runs while the first one's activations wait for the backward: it
    must not replay over them (it runs step by step), and both backwards see their own."""
    data = batches(8)

    def train(run, opt):
        for (x1, y1), (x2, y2) in zip(data[::2], data[1::2]):
            l1, _ = run(x1, y1)
            l2, _ = run(x2, y2)
            (l1 + 0.5 * l2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    forward = graphs_of(same_as_eager(train))[0]
    assert forward is not None and forward.replays >= 2


@gpu
def test_gradients_accumulated_over_several_backwards():
    data = batches(9)

    def train(run, opt):
        for i, (x, y) in enumerate(data):
            loss, _ = run(x, y)
            (loss / 3).backward()  # each backward adds to .grad: the copies out must be their own
            if i % 3 == 2:
                opt.step()
                opt.zero_grad(set_to_none=True)
    same_as_eager(train)


@gpu
def test_retain_graph_and_a_second_backward():
    data = batches(5)

    def train(run, opt):
        for x, y in data:
            loss, _ = run(x, y)
            loss.backward(retain_graph=True)
            loss.backward()  # the same saved activations, read twice
            opt.step()
            opt.zero_grad(set_to_none=True)
    same_as_eager(train)


@gpu
@pytest.mark.parametrize("setting", [False, "auto"])
def test_training_graphs_only_where_asked_for(setting):
    _, run, _ = plain_loop(True, batches(4), cuda_graphs=setting)
    assert graphs_of(run) == [None, None]
    assert all(part.graph_pair is None for part in run.train_parts)


def test_a_program_on_the_cpu_is_never_a_cuda_graph():
    def step(x):
        return (x.sin() * 2).sum()
    cf = fusec.compile(step, backend="cpp")
    cf(torch.randn(8, 4))
    assert training_blocker(cf.last).startswith("not all on one CUDA device (cpu)")


def test_handed_outputs_are_found_among_the_programs_outputs():
    """The forward's outputs from `fusec_saved_from` on are its saved activations; the program
    returns every output but the constants (an input returned as it is keeps its place)."""
    def fw(x):
        return x, x * 2, None, x + 1, 3
    cf = fusec.compile(fw, backend="cpp")
    x = torch.randn(4)
    cf(x)
    program_outputs = cf.last.program([x])
    assert len(program_outputs) == 3
    assert program_position(cf.last, 3) == 2  # graph output 3 (x + 1) is the program's third
    torch.testing.assert_close(program_outputs[program_position(cf.last, 3)], x + 1)
