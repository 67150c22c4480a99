"""reinplace: a functionalized buffer update (`index_put` + `copy_` back) written in place, only
where nothing else reads the buffer. Every case runs against eager, buffer contents included."""
import sys
from pathlib import Path

import torch

from conftest import assert_matches
from fusec.frontend import capture
from fusec.passes import run_pipeline
from fusec.record import record_of

aten = torch.ops.aten
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class Cache(torch.nn.Module):
    """A static KV cache: write position `pos`, then read the whole cache."""

    def __init__(self, device, dtype=torch.float32, read_old=False):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 3, 8, 4, device=device, dtype=dtype))
        self.read_old = read_old

    def forward(self, k, pos):
        old = self.cache.sum() if self.read_old else 0
        self.cache.index_copy_(2, pos, k)
        return (self.cache * 2).sum(-1) + old


def decisions(module, *inputs):
    gm, _ = run_pipeline(capture(module, inputs).gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return record_of(gm).reinplace, targets


def run_steps(module, compiled, device, steps=3, dtype=torch.float32):
    """Several steps, each checked against eager on a twin module (outputs and buffers)."""
    twin = Cache(device, dtype, module.read_old)
    for step in range(steps):
        k = torch.randn(2, 3, 1, 4, device=device, dtype=dtype)
        pos = torch.tensor([(step * 3) % 8], device=device)
        got, want = compiled(k, pos), twin(k, pos)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(module.cache, twin.cache, rtol=0, atol=0)


def test_cache_update_is_written_in_place(target):
    backend, device = target
    module = Cache(device)
    done, targets = decisions(module, torch.randn(2, 3, 1, 4, device=device),
                              torch.tensor([5], device=device))
    assert [d[1] is not None for d in done] == [True], done
    if device == "cpu":  # on a GPU a kernel writes it (fusec.ops.indexed_write, test_indexed_write.py)
        assert aten.index_put_.default in targets
    assert aten.index_put.default not in targets and aten.copy_.default not in targets
    import fusec
    run_steps(module, fusec.compile(module, backend=backend), device)


def test_half_precision_cache(target):
    backend, device = target
    import fusec
    module = Cache(device, torch.bfloat16)
    run_steps(module, fusec.compile(module, backend=backend), device, dtype=torch.bfloat16)


def test_old_value_read_keeps_the_copy(target):
    """Reading the buffer before the update: the in-place write would destroy what it reads."""
    backend, device = target
    module = Cache(device, read_old=True)
    done, targets = decisions(module, torch.randn(2, 3, 1, 4, device=device),
                              torch.tensor([1], device=device))
    assert done and done[0][1] is None and "reads the buffer" in done[0][2]
    import fusec
    run_steps(module, fusec.compile(module, backend=backend), device)


def test_values_from_the_buffer_itself_are_not_written_in_place(target):
    backend, device = target

    def shift(cache, pos):
        cache.index_put_([pos], cache[pos - 1] * 2)
        return cache.sum(0)

    cache = torch.randn(6, 5, device=device)
    pos = torch.tensor([3], device=device)
    done, _ = decisions(shift, cache.clone(), pos)
    assert all(d[1] is None for d in done)
    mine, theirs = cache.clone(), cache.clone()
    assert_matches(shift, mine, pos, backend=backend)
    shift(theirs, pos)  # assert_matches ran it on `mine` twice (fusec, then eager)
    shift(theirs, pos)
    torch.testing.assert_close(mine, theirs)


def test_user_argument_updated_in_place(target):
    backend, device = target

    def write(cache, k, pos):
        cache[:, pos] = k
        return cache.amax(1)

    import fusec
    compiled = fusec.compile(write, backend=backend)
    cache, twin = torch.zeros(4, 7, device=device), torch.zeros(4, 7, device=device)
    for step in range(3):
        k = torch.randn(4, 1, device=device)
        pos = torch.tensor([step * 2], device=device)
        torch.testing.assert_close(compiled(cache, k, pos), write(twin, k, pos))
        torch.testing.assert_close(cache, twin, rtol=0, atol=0)


def test_llama_decode_tokens_match_eager(target):
    backend, device = target
    import fusec
    from llama_decode import TINY, Llama, generate
    model = Llama(dict(TINY, layers=1), "bf16", device=device).eval()
    eager = generate(model, model, [1, 2, 3], 6)
    assert generate(fusec.compile(model, backend=backend), model, [1, 2, 3], 6) == eager


class ConvCache(torch.nn.Module):
    """A convolution's output written into a 4-d buffer: the layout pass may run the convolution
    channels-last, but the buffer itself must be written where it lives."""

    def __init__(self, device):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1).to(device)
        self.register_buffer("cache", torch.zeros(5, 4, 6, 6, device=device))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, torch.relu(self.conv(x)))
        return self.cache.mean((2, 3))


def test_conv_output_into_buffer(target):
    backend, device = target
    import fusec
    module, twin = ConvCache(device), ConvCache(device)
    twin.load_state_dict(module.state_dict())
    compiled = fusec.compile(module, backend=backend)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(1, 3, 6, 6, device=device)
            pos = torch.tensor([step], device=device)
            torch.testing.assert_close(compiled(x, pos), twin(x, pos))
            torch.testing.assert_close(module.cache, twin.cache)


def test_explain_says_what_was_written_in_place():
    import fusec
    module = Cache("cpu")
    e = fusec.explain(module, torch.randn(2, 3, 1, 4), torch.tensor([2]), backend="cpp")
    passes = {p["after"]: p for p in e.to_dict()["passes"]}
    assert "1 buffer update(s) in place" in passes["reinplace"]["summary"]
    assert any("index_put -> index_put__default: nothing else reads p_cache: written in place" in d
               for d in passes["reinplace"]["details"])
    kept = fusec.explain(Cache("cpu", read_old=True), torch.randn(2, 3, 1, 4), torch.tensor([2]),
                         backend="cpp")
    details = {p["after"]: p for p in kept.to_dict()["passes"]}["reinplace"]["details"]
    assert any("index_put: kept: something else reads the buffer" in d for d in details)
