"""Buffers a training forward updates (batch norm's running statistics, a step counter, an EMA):
AOT Autograd keeps the writes in the forward's graph (`keep_inference_input_mutations`, in
fusec/capture/training.py, training_family.py and regions.py), fusec's program returns the new
values and two foreach calls write them after it (fusec/capture/buffer_updates.py;
passes/reinplace.py for inference programs' copies), and after every step they hold eager's
values."""
import copy

import pytest
import torch

import fusec
from conftest import CPU_BACKENDS, TRITON_DEVICE
from train_check import train_alongside as checked_alongside


def device_of(backend):
    return "cpu" if backend in CPU_BACKENDS else TRITON_DEVICE


def train_alongside(model, backend, xs, device, make_loss=lambda out: (out ** 2).mean()):
    """Train `model` compiled by fusec and an eager copy on the same batches (SGD): the losses,
    gradients and every buffer agree after each step. Returns (compiled, model, eager copy)."""
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend=backend)
    checked_alongside(compiled, model, ref, xs, lambda m, x: make_loss(m(x.to(device))))
    return compiled, model, ref


def conv_bn(momentum=0.1, track=True, affine=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1),
                               torch.nn.BatchNorm2d(8, momentum=momentum, affine=affine,
                                                    track_running_stats=track),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1),
                               torch.nn.BatchNorm2d(4))


def batches(n=3, shape=(4, 3, 6, 6)):
    torch.manual_seed(1)
    return [torch.randn(*shape) for _ in range(n)]


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_running_statistics_match_eager_after_steps(backend):
    device = device_of(backend)
    compiled, model, ref = train_alongside(conv_bn().to(device), backend, batches(), device)
    assert model[1].num_batches_tracked.item() == 3
    # eval() after training: the running statistics the steps wrote normalize now
    model.eval()
    ref.eval()
    x = torch.randn(2, 3, 6, 6, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_buffers_are_written_after_the_program_at_once(backend, monkeypatch):
    """The statistics and counters are written by two foreach calls after the forward program
    (capture/buffer_updates.py), not one copy each by AOT Autograd's wrapper: the program writes
    into no input (no overlap check per call), makes no clone, and has no kernel for the
    counters' `+= 1`."""
    from fusec.aliasing import mutated_inputs
    calls = []
    for name in ("_foreach_copy_", "_foreach_add_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda ts, *a, real=real, name=name:
                            calls.append((name, len(ts))) or real(ts, *a))
    compiled, model, _ = train_alongside(conv_bn(), backend, batches(2), "cpu")
    assert calls[-2:] == [("_foreach_copy_", 4), ("_foreach_add_", 2)]  # 2 norms
    forward = compiled._compiled.train_parts[0]
    source = forward.source()
    text = source[source.index("def run("):source.index("# ===== graph")]  # the program's steps
    assert "_aten_copy" not in text and "_aten_add_" not in text, text
    assert mutated_inputs(forward.last.program) == ()
    names = [k.name for k in forward.kernels]  # a kernel per norm, none for a counter
    assert sum(n.startswith("fused_sum") for n in names) == 2, names
    assert not any(n.startswith("fused_add_") for n in names), names


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cumulative_average_momentum_none(backend):
    """momentum=None: the running statistics are the cumulative average, whose factor
    1 / num_batches_tracked is read from the counter the same forward increments (in Python:
    a graph break, so the norm's regions go through TorchDynamo's AOT Autograd)."""
    train_alongside(conv_bn(momentum=None), backend, batches(4), "cpu")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_running_statistics(backend):
    """track_running_stats=False: no buffers, batch statistics in train and eval."""
    compiled, model, ref = train_alongside(conv_bn(track=False, affine=False), backend,
                                           batches(2), "cpu")
    assert model[1].running_mean is None
    model.eval()
    ref.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)


class Buffers(torch.nn.Module):
    """Buffers a forward reads after updating them, and one read before: a step counter, an EMA
    of the batch mean, and a shift that the output adds before the forward halves it. (A buffer
    the backward needs may not be updated after it is read: eager's autograd refuses that.)"""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("shift", torch.full((6,), 2.0))

    def forward(self, x):
        y = self.lin(x) + self.shift  # the old shift
        with torch.no_grad():
            self.shift.mul_(0.5)
            self.steps += 1
            self.ema.mul_(0.9).add_(0.1 * y.mean(0))
        return y - self.ema * self.steps  # the new EMA and count


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_buffers_read_before_and_after_their_update(backend):
    torch.manual_seed(1)
    xs = [torch.randn(5, 6) for _ in range(3)]
    _, model, _ = train_alongside(Buffers(), backend, xs, "cpu")
    assert model.steps.item() == 3


class Halves(torch.nn.Module):
    """A buffer that is a view of another: `first` is row 0 of `both`. Writing one writes the
    other."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("both", torch.zeros(2, 4))
        self.register_buffer("first", self.both[0])

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.first.add_(y.mean(0))
        return y * self.both.sum(0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_buffer_that_views_another(backend):
    torch.manual_seed(1)
    xs = [torch.randn(3, 4) for _ in range(3)]
    _, model, ref = train_alongside(Halves(), backend, xs, "cpu")
    assert model.first.data_ptr() == model.both.data_ptr()  # still one memory
    torch.testing.assert_close(model.both, ref.both)


class Updates(torch.nn.Module):
    """An inference forward that updates an EMA and a counter (no gradients: the program itself
    writes them, passes/reinplace.py)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        self.ema.mul_(0.9).add_(0.1 * torch.relu(x).mean(0))
        return x - self.ema


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inference_buffer_updates_copy_once(backend):
    """Without gradients the writes stay in the program: each buffer is copied from its new
    value once (no clone first), and the counter's `+= 1` is one in-place add."""
    model, ref = Updates(), Updates()
    compiled = fusec.compile(model, backend=backend)
    torch.manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 6)
            torch.testing.assert_close(compiled(x), ref(x))
    torch.testing.assert_close(model.ema, ref.ema)
    assert model.calls.item() == 3
    source = compiled.source()
    text = source[source.index("def run("):source.index("# ===== graph")]
    assert text.count("_aten_copy__default") == 1 and "_aten_copy_default" not in text, text
    assert text.count("_aten_add__Tensor") == 1, text


def test_only_a_single_final_write_leaves_the_graph():
    """buffer_writes on graphs by hand: one final write of a whole input leaves the graph (and
    `apply` does it after); two writes into one input, or a write read later, stay in order."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from fusec.capture.buffer_updates import buffer_writes

    def once(a, x):
        y = x * 2
        a.copy_(x + 1)
        return (y,)  # (AOT Autograd's graphs return a tuple)

    def twice(a, x):
        a.copy_(x + 1)
        a.copy_(x * 2)
        return (x - 1,)

    def read_after(a, x):
        a.copy_(x + 1)
        return (a * 3,)

    x = torch.randn(4)
    gm = make_fx(once)(torch.zeros(4), x)
    taken = buffer_writes(gm)
    assert taken.copies == [(0, 1)] and not taken.counters
    a = torch.zeros(4)
    out = taken.apply([a, x], list(gm(a.clone(), x)))
    torch.testing.assert_close(out[0], x * 2)
    torch.testing.assert_close(a, x + 1)
    for f in (twice, read_after):
        gm = make_fx(f)(torch.zeros(4), x)
        assert not buffer_writes(gm), f.__name__
        assert sum(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes) >= 1


class BrokenNorms(torch.nn.Module):
    """Two batch norms with a graph break between them: each in a region of its own
    (fusec/capture/regions.py, through TorchDynamo), each region's buffers written after it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.bn1d = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), \
            torch.nn.BatchNorm1d(8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        torch._dynamo.graph_break()
        return self.bn1d(y.mean((2, 3)))


@pytest.mark.parametrize("way", ["fusec.compile", "torch.compile"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_regions_update_their_buffers_as_eager(backend, way):
    torch.manual_seed(0)
    model = BrokenNorms()
    ref = copy.deepcopy(model)
    run = fusec.compile(model, backend=backend) if way == "fusec.compile" else \
        torch.compile(model, backend="fusec", options={"backend": backend})
    for _ in range(3):
        x = torch.randn(4, 3, 10, 10)
        run(x).square().mean().backward()
        ref(x).square().mean().backward()
    for (name, got), want in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
