"""extensions/quant_gemv/packed_words.py + triton_gemv_packed_mma.py: GPTQ's and AWQ's int4 words
(eight nibbles to an int32, packed along K or along N) at M = 2 to 16 multiplied on tensor cores,
K split over several programs, as the packed-bytes int4 layer is (test_int4_mma.py).

Every case compiles the example layer with backend="triton" (under the interpreter on a CPU,
where tl.dot runs in float32 on the same exact values), checks that the tensor-core kernel was
generated, and compares with eager against a float64 product of the exactly dequantized weight:
the kernel applies the scale to float32 sums instead of rounding each weight to half precision,
so it must be at least as close to float64 as eager (up to a unit in the last place). Inputs the
fast form cannot compute as eager does (shift amounts that are not one nibble each, a scale whose
weights overflow, NaN and infinities) take the exact way and must give eager's non-finite values.
"""
import importlib

import pytest
import torch

import fusec
from conftest import TRITON_DEVICE
from test_int4_columns import closer_than_eager, gen

awq = importlib.import_module("fusec.examples.awq_linear")
gptq = importlib.import_module("fusec.examples.gptq_linear")

# (all of them Triton; a kernel that could not be built and ran eagerly instead is a failure here)
pytestmark = [pytest.mark.triton,
              pytest.mark.filterwarnings("error::fusec.runtime.eager.FallbackWarning")]
F16, BF16 = torch.float16, torch.bfloat16
DEV = TRITON_DEVICE
TEMPLATE = "extensions/quant_gemv/templates/triton_gemv_packed_mma.py.j2"
GENERIC = "extensions/quant_gemv/templates/triton_gemv.py.j2"
LAYERS = {"awq": awq.AWQLinear, "gptq": gptq.GPTQLinear}


def small_matmul_module():
    for name in ("fusec.extensions.quant_gemv.small_matmul", "fusec.passes.small_matmul"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("small_matmul")


@pytest.fixture(autouse=True)
def sixteen_rows_here(monkeypatch):
    """GEMVs of up to 16 rows on the CPU too (a GPU's SMALL_M_GPU), and AWQ's above 4 rows on a
    GPU too (SPLIT_COLUMNS_MAX_M keeps them for the library matmul there, measured against the
    generic GEMV before this kernel existed)."""
    small = small_matmul_module()
    monkeypatch.setattr(small, "SMALL_M", 16)
    monkeypatch.setattr(small, "SPLIT_COLUMNS_MAX_M", 16)


def layer_of(fmt, k, n, group, dtype=BF16, seed=0, **kw):
    torch.manual_seed(seed)
    return LAYERS[fmt](torch.randn(k, n, dtype=dtype) / k ** 0.5, group, **kw).to(DEV)


def gemv(cf):
    (kernel,) = [k for k in cf.kernels if "gemv" in k.name]
    return kernel


def run(layer, x, template=TEMPLATE):
    """Compile, run, check the GEMV's template and the result against eager and float64."""
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, eager = cf(x), layer(x)
    source = gemv(cf).source
    assert template in source, source[:1500]
    assert got.dtype == eager.dtype and got.shape == eager.shape
    want = x.cpu().double() @ layer.dequantized().cpu()
    ok = torch.isfinite(eager).cpu()
    closer_than_eager(got[ok], eager[ok], want[ok])
    return cf, got, eager


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("m", [2, 4, 16])
def test_awq_and_gptq_on_tensor_cores(fmt, m):
    n = 200 if fmt == "gptq" else 136  # 136 = 8 x 17: word columns that do not fill a program
    cf, _, _ = run(layer_of(fmt, 256, n, 128, seed=m), torch.randn(m, 256, generator=gen(m)).to(BF16).to(DEV))
    source = gemv(cf).source
    assert f"M = {m} rows of {'GPTQ' if fmt == 'gptq' else 'AWQ'}-style words" in source
    assert "_finish" in source and "dot(" in source


@pytest.mark.parametrize("fmt,group", [("awq", 32), ("gptq", 256)])
def test_float16_and_other_groups(fmt, group):
    run(layer_of(fmt, 512, 64, group, F16), torch.randn(3, 512, generator=gen(3)).to(F16).to(DEV))


class WithEpilogue(torch.nn.Module):
    """gelu(layer(x) + bias): what follows the product (the epilogue)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.register_buffer("bias", torch.randn(layer.n, generator=gen(11)).to(BF16).to(DEV))

    def forward(self, x):
        return torch.nn.functional.gelu(self.layer(x) + self.bias)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_an_epilogue_runs_in_the_finishing_kernel(fmt):
    model = WithEpilogue(layer_of(fmt, 256, 64, 128))
    x = torch.randn(3, 256, generator=gen(12)).to(BF16).to(DEV)
    cf = fusec.compile(model, backend="triton")
    with torch.no_grad():
        got, eager = cf(x), model(x)
        want = torch.nn.functional.gelu(x.cpu().double() @ model.layer.dequantized().cpu()
                                        + model.bias.cpu().double())
    source = gemv(cf).source
    assert TEMPLATE in source
    # GPTQ's rows are (M, N), the epilogue's: fused. AWQ's GEMV computes its columns as
    # (N/8, 8), and the bias and gelu stay a kernel of their own (fuse_reductions' decision)
    assert ("gelu" in source.split("_finish(")[1]) == (fmt == "gptq")
    closer_than_eager(got, eager, want)


def test_gptq_shift_amounts_in_another_order_take_the_fast_form():
    """The kernel reads the shift amounts when it runs: a permutation of 0, 4, ..., 28 puts
    each row of K in a nibble, so the fast form takes it (the row each nibble holds)."""
    layer = layer_of("gptq", 256, 64, 128)
    order = [8, 0, 28, 4, 16, 24, 12, 20]
    layer.wf.copy_(torch.tensor(order, dtype=torch.int32))
    x = torch.randn(2, 256, generator=gen(4)).to(BF16).to(DEV)
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, eager = cf(x), layer(x)
    assert TEMPLATE in gemv(cf).source
    w = _reordered_weight(layer, order)
    closer_than_eager(got, eager, x.cpu().double() @ w)


def _reordered_weight(layer, order):
    """The weight eager computes when wf holds `order` (row 8i + t from the nibble at order[t],
    zero point of column 8j + t from the nibble at order[t])."""
    k, n, g = layer.k, layer.n, layer.group
    sh = torch.tensor(order)
    q = ((layer.qweight.cpu()[:, None, :] >> sh[None, :, None]) & 15).reshape(k, n)
    z = ((layer.qzeros.cpu()[:, :, None] >> sh) & 15).reshape(k // g, n)
    return (q - z.repeat_interleave(g, 0)).double() * layer.scales.cpu().double().repeat_interleave(g, 0)


def test_gptq_shift_amounts_that_are_not_one_nibble_each_take_the_exact_way():
    layer = layer_of("gptq", 256, 64, 128)
    layer.wf.copy_(torch.tensor([0, 0, 8, 12, 16, 20, 24, 30], dtype=torch.int32))
    x = torch.randn(3, 256, generator=gen(5)).to(BF16).to(DEV)
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, eager = cf(x), layer(x)
    assert TEMPLATE in gemv(cf).source
    # each weight eager's, the products exact and added in float32: eager's up to the order of
    # the additions
    assert torch.allclose(got.float(), eager.float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("where", ["scale", "activation"])
def test_nan_and_inf_come_out_where_eagers_do(fmt, where):
    layer = layer_of(fmt, 256, 64, 128)
    x = torch.randn(2, 256, generator=gen(6)).to(BF16).to(DEV)
    if where == "scale":
        layer.scales[1, 9] = float("nan")
    else:
        x[1, 17] = float("inf")
    cf, got, eager = run(layer, x)
    assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf())
    assert got.isnan().any() or got.isinf().any()


def test_a_scale_whose_float16_weights_overflow_gives_eagers_infinities():
    layer = layer_of("gptq", 256, 64, 128, F16)
    layer.scales[1, 5] = 6000.0  # 15 * 6000 > 65504: eager's weight is inf where q - zero > 10
    x = torch.randn(2, 256, generator=gen(7)).to(F16).to(DEV)
    cf, got, eager = run(layer, x)
    assert not torch.isfinite(eager[:, 5]).all()
    assert torch.equal(got.isinf(), eager.isinf()) and torch.equal(got.isnan(), eager.isnan())


# ---- what the tensor-core kernel declines, and says why --------------------------------------------

def test_groups_smaller_than_a_chunk_keep_the_generic_gemv_and_say_why():
    cf, _, _ = run(layer_of("gptq", 256, 64, 64), torch.randn(3, 256, generator=gen(8)).to(BF16).to(DEV),
                   GENERIC)
    assert ("groups of 64 rows: the tensor-core kernel needs whole chunks of 128 rows of K"
            in gemv(cf).source)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_read_through_g_idx(act_order):
    """Zero points and scales read through g_idx (AutoGPTQ's torch path): in order (g_idx[k] =
    k // G) the fast form; in act order the kernel finds a chunk whose rows name other groups
    and takes the exact way, reading through g_idx as eager does."""
    layer = layer_of("gptq", 256, 64, 128, g_idx=True)
    if act_order:
        layer.g_idx.copy_(torch.arange(256, dtype=torch.int32) % 2)  # rows alternate groups
    x = torch.randn(2, 256, generator=gen(9)).to(BF16).to(DEV)
    cf = fusec.compile(layer, backend="triton")
    with torch.no_grad():
        got, eager = cf(x), layer(x)
    source = gemv(cf).source
    assert TEMPLATE in source and "g_idx does not name the chunk's group" in source
    closer_than_eager(got, eager, x.cpu().double() @ _weight_through_g_idx(layer))


def _weight_through_g_idx(layer):
    def nibbles(words, dim):
        return torch.stack([(words >> (4 * t)) & 15 for t in range(8)], dim + 1).flatten(dim, dim + 1)
    g = layer.g_idx.long().cpu()
    q = nibbles(layer.qweight.cpu(), 0).double()
    z = nibbles(layer.qzeros.cpu(), 1).double()
    return (q - z[g]) * layer.scales.cpu().double()[g]


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FUSEC_INT4_MMA", "0")
    cf, _, _ = run(layer_of("awq", 256, 64, 128), torch.randn(2, 256, generator=gen(10)).to(BF16).to(DEV),
                   GENERIC)
    assert "FUSEC_INT4_MMA=0: the tensor-core kernel is switched off" in gemv(cf).source


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("right", [False, True])
def test_both_operand_orders_and_pipelining(fmt, right, monkeypatch):
    """The weight tiles as the dots' left operands ([columns, K], the sums [columns, M]) or right
    ([K, columns] as the words lie, the sums [M, columns]; along K with a word's nibbles p and
    p + 4 joined as neighbours in K), with Triton's pipelining on: the block choice picks one per
    format and M on a GPU (packed_mma._blocks); every way must give the same result."""
    pm = importlib.import_module("fusec.extensions.quant_gemv.triton_gemv_packed_mma")
    chosen = pm._blocks
    monkeypatch.setattr(pm, "_blocks", lambda pw: chosen(pw)._replace(right=right, stages=2, joined=right))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")  # (a program saved by the other case is not this one)
    n = 200 if fmt == "gptq" else 136
    cf, _, _ = run(layer_of(fmt, 256, n, 128, seed=3), torch.randn(16, 256, generator=gen(16)).to(BF16).to(DEV))
    source = gemv(cf).source
    assert ("dot(x_tile(" in source or "dot(x, " in source) == right
    assert "num_stages=2" in source
    assert ("tl.join(lo, hi)" in source) == right
