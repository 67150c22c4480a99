"""Indexed writes: `cache[:, :, pos] = k` (a static KV cache's update, reinplaced into
`index_put_`) done by the kernel that computes k, or by a small kernel of its own, instead of an
ATen call (fusec.ops.indexed_write; the store adds pos * stride, codegen/triton/__init__.py).

It is done on GPUs (fusec.ops.INDEXED_WRITE_DEVICES): there eager's out-of-range position is an
asynchronous device-side assert anyway. On a CPU the write stays eager's, which raises; the tests
widen the list so that the Triton interpreter runs the same kernels, and check that the CPU
backends keep the ATen call."""
import importlib

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from fusec import ops
from fusec.record import record_of

llama = importlib.import_module("fusec.examples.llama_decode")
# the example's tiny Llama with one layer and a narrower MLP: its decode kernels run under the
# Triton interpreter, where each GEMV program costs (the full TINY took two minutes a test)
SMALL_LLAMA = dict(llama.TINY, dim=32, heads=2, kv_heads=1, hidden=64, layers=1, vocab=64)
small_matmul = importlib.import_module("fusec.extensions.quant_gemv.small_matmul")


@pytest.fixture
def writes_here(monkeypatch):
    monkeypatch.setattr(ops, "INDEXED_WRITE_DEVICES", ("cuda", TRITON_DEVICE))


class Cache(torch.nn.Module):
    """A layer's KV-cache update: rotate k, write it at `pos`, read the whole cache."""

    def __init__(self, shape=(1, 2, 8, 6), dtype=torch.float32, device=TRITON_DEVICE):
        super().__init__()
        self.register_buffer("cache", torch.zeros(shape, dtype=dtype, device=device))

    def forward(self, k, pos, computed=True, setitem=False):
        if computed:
            k = k * 2  # (exact: the cache must be eager's bit for bit, also on a GPU)
        if setitem:  # (captured with a view of k between: its kernel, then the write's own)
            self.cache[:, :, pos] = k
        else:
            self.cache.index_copy_(2, pos, k)  # as Hugging Face's static cache writes
        return self.cache.sum(-1), self.cache * 3


def run_both(make, args_list, backend="triton"):
    """Compile a fresh module and run it next to eager on a second one, step by step: outputs
    and the buffers after every step must be eager's exactly."""
    mine, ref = make(), make()
    cf = fusec.compile(mine, backend=backend)
    for args in args_list:
        got, want = cf(*args), ref(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        assert torch.equal(mine.cache, ref.cache)
    return cf


def names(cf):
    return [k.name for k in cf.kernels]


def writers(cf):
    """The kernels that write a cache position."""
    return [k.name for k in cf.kernels if "aten.index_put_.default" in k.ops]


def externs(cf):
    """The ATen calls that write a position (index_put_ run by eager)."""
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    return [s.name for s in record_of(last.gm).schedule
            if s.kind == "extern" and "index_put" in s.name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_that_computes_k_writes_the_cache(writes_here, dtype):
    k = torch.randn(1, 2, 1, 6, device=TRITON_DEVICE).to(dtype)
    steps = [(k, torch.tensor([p], device=TRITON_DEVICE)) for p in (3, 0, 7)]
    cf = run_both(lambda: Cache(dtype=dtype), steps)
    assert writers(cf) == ["fused_mul_write_0"], names(cf)
    assert not externs(cf)
    src = next(k.source for k in cf.kernels if "write" in k.name)
    assert "_at = tl.where(" in src  # the position read in the kernel (a negative one counts from
    # the end, as in `cache[:, :, -1] = k`: checked below; index_copy_ itself refuses negatives)


def test_values_from_a_view_get_a_write_kernel_of_their_own(writes_here):
    kv = torch.randn(1, 2, 1, 12, device=TRITON_DEVICE)
    cf = run_both(lambda: Cache(), [(kv[..., 6:], torch.tensor([p], device=TRITON_DEVICE), False)
                                    for p in (1, 5)])
    assert writers(cf) == ["fused_write_0"] and not externs(cf)
    # `cache[:, :, pos] = k * 2`: k * 2 reaches the write through a view (k without its leading
    # 1); the view moves onto k (passes/lift_reshapes.py), so the write's kernel computes k * 2
    cf = run_both(lambda: Cache(), [(kv[..., :6], torch.tensor([p], device=TRITON_DEVICE), True,
                                     True) for p in (0, 6, -1, -8)])  # negatives: from the end
    assert writers(cf) == ["fused_mul_write_0"] and not externs(cf)


def test_the_cache_is_read_after_the_write_not_in_its_loop(writes_here):
    """`cache * 3` reads the whole buffer: the write's kernel must end first."""
    cf = run_both(lambda: Cache(), [(torch.randn(1, 2, 1, 6, device=TRITON_DEVICE),
                                     torch.tensor([2], device=TRITON_DEVICE))])
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    assert any("reads the buffer an indexed write updates" in r.reason
               for r in record_of(last.gm).refusals)


def test_out_of_range_writes_nothing(writes_here):
    """Eager raises (on a GPU, asynchronously); the kernel leaves the buffer as it was."""
    m = Cache()
    cf = fusec.compile(m, backend="triton")
    k = torch.randn(1, 2, 1, 6, device=TRITON_DEVICE)
    cf(k, torch.tensor([3], device=TRITON_DEVICE))
    before = m.cache.clone()
    cf(k, torch.tensor([8], device=TRITON_DEVICE))
    cf(k, torch.tensor([-9], device=TRITON_DEVICE))
    assert torch.equal(m.cache, before)


def test_what_stays_an_aten_call(writes_here):
    """Two positions at once, and accumulation: index_put_ as eager runs it."""
    class Two(Cache):
        def forward(self, k, pos):
            self.cache[:, :, pos] = k * 2
            return self.cache.sum(-1), self.cache * 3

    class Add(Cache):
        def forward(self, k, pos):
            self.cache.index_add_(2, pos, k * 2)
            return self.cache.sum(-1), self.cache * 3
    k2 = torch.randn(1, 2, 2, 6, device=TRITON_DEVICE)
    cf = run_both(Two, [(k2, torch.tensor([1, 4], device=TRITON_DEVICE))])
    assert externs(cf) and not writers(cf)
    cf = run_both(Add, [(k2[:, :, :1], torch.tensor([2], device=TRITON_DEVICE))] * 2)
    assert not writers(cf)


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_cpu_backends_keep_the_aten_call(backend):
    cf = run_both(lambda: Cache(device="cpu"), [(torch.randn(1, 2, 1, 6), torch.tensor([p]))
                                                for p in (0, 5)], backend=backend)
    assert externs(cf) and not writers(cf)


def test_a_caller_s_tensor_is_written_too(writes_here):
    """The cache passed as an argument, not a buffer: the caller's tensor is updated."""
    def f(cache, k, pos):
        cache[:, :, pos] = k * 2
        return cache.sum(-1)
    cache, ref = (torch.zeros(1, 2, 8, 6, device=TRITON_DEVICE) for _ in range(2))
    k = torch.randn(1, 2, 1, 6, device=TRITON_DEVICE)
    cf = fusec.compile(f, backend="triton")
    for p in (2, 6):
        pos = torch.tensor([p], device=TRITON_DEVICE)
        torch.testing.assert_close(cf(cache, k, pos), f(ref, k, pos))
        assert torch.equal(cache, ref)


def test_llama_decode_writes_its_cache_in_kernels(writes_here, monkeypatch):
    monkeypatch.setattr(small_matmul, "STORED_GEMV_DEVICES", ("cuda", TRITON_DEVICE))
    model = llama.Llama(SMALL_LLAMA, "bf16", device=TRITON_DEVICE).eval()
    cf = fusec.compile(model, backend="triton")
    assert llama.generate(cf, model, [1, 2], 3) == llama.generate(model, model, [1, 2], 3)
    assert not externs(cf)
    # per layer, k's rotary kernel writes k, and a small kernel writes v (a view of the q/k/v GEMV)
    assert len(writers(cf)) == 2 * SMALL_LLAMA["layers"]
    assert sum(n.startswith("fused_write") for n in writers(cf)) == SMALL_LLAMA["layers"]
