"""Gathered reads (`wte(input_ids)`, `scales[g_idx]`, passes/check_gathers.py): a kernel reads
the index value and then the row it names, so the gathered rows are never stored; the index
values are checked once, and a bad one raises as eager does. Every backend, against eager.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import GPU, assert_matches
from fusec.record import record_of

F16, BF16 = torch.float16, torch.bfloat16


def gen(seed):
    return torch.Generator().manual_seed(seed)


def kernels_with(cf, op):
    return [k for k in cf.kernels if any(op in o for o in k.ops)]


# ---- pointwise: the read joins the kernel of what follows it ------------------------------------

def embed(ids, table, positions):
    return F.embedding(ids, table) * 2.0 + positions


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_embedding_joins_the_add_that_follows(target, index_dtype):
    backend, device = target
    table = torch.randn(50, 16, generator=gen(0))
    positions = torch.randn(7, 16, generator=gen(1))
    ids = torch.randint(0, 50, (3, 7), generator=gen(2)).to(index_dtype)
    args = [t.to(device) for t in (ids, table, positions)]
    # two kernels: the check of the ids (a small reduction) and the embedding with its add
    cf = assert_matches(embed, *args, backend=backend, kernels=2)
    (fused,) = kernels_with(cf, "embedding")
    assert {"aten.embedding.default", "aten.add.Tensor"} <= set(fused.ops)


def test_index_with_negative_values_counts_from_the_end(target):
    backend, device = target
    x = torch.randn(9, 5, generator=gen(3))
    idx = torch.tensor([0, -1, 4, -9, 8, 2])
    cf = assert_matches(lambda x, i: x[i].sin(), x.to(device), idx.to(device), backend=backend)
    assert kernels_with(cf, "index.Tensor")


@pytest.mark.parametrize("dtype", [torch.float32, BF16, F16, torch.int32, torch.uint8])
def test_dtypes(target, dtype):
    backend, device = target
    x = (torch.randn(12, 6, generator=gen(4)) * 10).to(dtype)
    idx = torch.randint(0, 12, (4, 5), generator=gen(5))
    assert_matches(lambda x, i: x[i] + 1, x.to(device), idx.to(device), backend=backend)


def test_picked_dim_in_the_middle_and_a_transposed_source(target):
    """x[:, idx] of a 3-D x seen through a transpose: the rows are picked along dim 1 of a
    non-contiguous source, and index_select picks along the last dim."""
    backend, device = target
    x = torch.randn(5, 4, 6, generator=gen(6)).transpose(0, 2)  # (6, 4, 5), strides (1, 5, 20)
    idx = torch.tensor([[3, 0], [1, 1], [2, 3]])
    assert_matches(lambda x, i: x[:, i] * 3, x.to(device), idx.to(device), backend=backend)
    sel = torch.tensor([4, 0, 0, 2])
    assert_matches(lambda x, i: torch.index_select(x, 2, i).exp(), x.to(device), sel.to(device),
                   backend=backend)


def test_nan_rows_and_broadcast_against_a_larger_tensor(target):
    backend, device = target
    table = torch.randn(10, 8, generator=gen(7))
    table[3, 2] = float("nan")
    ids = torch.tensor([3, 1, 3])
    other = torch.randn(2, 3, 8, generator=gen(8))
    assert_matches(lambda i, t, o: F.embedding(i, t) + o, ids.to(device), table.to(device),
                   other.to(device), backend=backend)


def test_empty_index(target):
    backend, device = target
    table = torch.randn(10, 8, generator=gen(9))
    ids = torch.zeros(0, dtype=torch.int64)
    assert_matches(lambda i, t: F.embedding(i, t) * 2, ids.to(device), table.to(device),
                   backend=backend)


def test_computed_source_and_index_are_stored_first_with_a_reason(target):
    backend, device = target
    x = torch.randn(10, 4, generator=gen(10))
    ids = torch.randint(0, 9, (6,), generator=gen(11))

    def f(x, ids):
        return (x * 2)[ids + 1].cos()

    cf = assert_matches(f, x.to(device), ids.to(device), backend=backend)
    reasons = [r.reason for r in record_of(cf.last.gm).refusals]
    assert any("source of a gathered read" in r for r in reasons), reasons
    assert any("index of a gathered read" in r for r in reasons), reasons


# ---- out of range: eager's error, not a wrong number ------------------------------------------

@pytest.mark.parametrize("backend", ["cpp", "llvm"] + ([] if GPU else ["triton"]))
def test_an_index_out_of_range_raises(backend):
    table = torch.randn(10, 8, generator=gen(12))
    cf = fusec.compile(lambda i, t: F.embedding(i, t) + 1, backend=backend)
    assert torch.equal(cf(torch.tensor([1, 9]), table), F.embedding(torch.tensor([1, 9]), table) + 1)
    for bad in ([1, 10], [-1, 2]):  # embedding takes no negative index
        with pytest.raises(IndexError, match="fusec: index out of range"):
            cf(torch.tensor(bad), table)
        with pytest.raises(IndexError):
            F.embedding(torch.tensor(bad), table)
    x = torch.randn(4, 3, generator=gen(13))
    cf = fusec.compile(lambda x, i: x[i] * 2, backend=backend)
    assert torch.equal(cf(x, torch.tensor([-4, 3])), x[torch.tensor([-4, 3])] * 2)
    with pytest.raises(IndexError, match=r"every value of i must be in \[-4, 4\)"):
        cf(x, torch.tensor([-5, 0]))
    with pytest.raises(IndexError):  # eager's type: an `except IndexError:` catches both
        x[torch.tensor([-5, 0])]


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_an_index_out_of_range_is_a_device_side_assert_on_a_gpu(tmp_path):
    """On a GPU eager's own index kernel stops the process with a device-side assert; the
    compiled program's check does the same (torch._assert_async). The CUDA context is lost
    after that, so it runs in a process of its own."""
    import subprocess
    import sys
    script = tmp_path / "bad_index.py"
    script.write_text(
        "import torch, torch.nn.functional as F, fusec\n"
        "t = torch.randn(10, 8, device='cuda')\n"
        "cf = fusec.compile(lambda i, t: F.embedding(i, t) + 1)\n"
        "cf(torch.tensor([1, 9], device='cuda'), t)\n"
        "torch.cuda.synchronize()\n"
        "print('good index ok', flush=True)\n"
        "cf(torch.tensor([1, 10], device='cuda'), t)\n"
        "torch.cuda.synchronize()\n"
        "print('bad index passed', flush=True)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "good index ok" in run.stdout and "bad index passed" not in run.stdout, run.stderr
    assert run.returncode != 0 and ("fusec: index out of range" in run.stderr
                                    or "device-side assert" in run.stderr), run.stderr[-2000:]


def test_one_assert_for_all_checks_with_a_message_cuda_takes():
    """Several index tensors: one _assert_async of all their checks, its message cut to the 254
    characters CUDA's _assert_async accepts (it raises on a longer one)."""
    tables = [torch.randn(40 + i, 4, generator=gen(20 + i)) for i in range(6)]

    def f(a_rather_long_index_name_0, a_rather_long_index_name_1, a_rather_long_index_name_2,
          a_rather_long_index_name_3, a_rather_long_index_name_4, a_rather_long_index_name_5,
          *tables):
        ids = (a_rather_long_index_name_0, a_rather_long_index_name_1, a_rather_long_index_name_2,
               a_rather_long_index_name_3, a_rather_long_index_name_4, a_rather_long_index_name_5)
        return sum(F.embedding(i, t) for i, t in zip(ids, tables))

    ids = [torch.randint(0, 40, (3,), generator=gen(30 + i)) for i in range(6)]
    cf = assert_matches(f, *ids, *tables, backend="cpp")
    (check,) = [n for n in cf.last.gm.graph.nodes if n.target is torch.ops.aten._assert_async.msg]
    assert len(check.args[1]) <= 254 and check.args[1].endswith(" ...")
    with pytest.raises(IndexError, match="fusec: index out of range"):
        cf(*ids[:5], torch.tensor([0, 45, 1]), *tables)


def test_explain_shows_the_check_and_the_fused_read():
    table = torch.randn(50, 16)
    ids = torch.randint(0, 50, (2, 5)).int()

    def f(ids, table):
        return F.embedding(ids, table) * 2 + 1

    text = str(fusec.explain(f, ids, table, backend="cpp"))
    assert "check_gathers" in text and "_assert_async" in text
    assert "checks ids once: every value in [0, 50)" in text
    assert "fused_embedding_mul_add" in text


# ---- GPTQ with act order: g_idx gathers inside the GEMV ------------------------------------------

class ActOrderQuantLinear(torch.nn.Module):
    """A 4-bit linear stored as GPTQ checkpoints store it: qweight (K/8, N) int32 holding eight
    nibbles along K, qzeros (groups, N/8) int32 holding eight along N, scales (groups, N) and
    g_idx (K,), the group of each row of K. With act order the rows were quantized in another
    order, so g_idx is not k // G and the scales must be gathered (as GPTQ's torch path does)."""

    def __init__(self, k, n, group, dtype=F16, seed=0):
        super().__init__()
        g = gen(seed)
        groups = k // group
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        self.q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        self.z = torch.randint(0, 15, (groups, n), generator=g, dtype=torch.int32)
        self.register_buffer("qweight", (self.q.view(k // 8, 8, n) << shifts[None, :, None])
                             .sum(1, dtype=torch.int32))
        self.register_buffer("qzeros", ((self.z.view(groups, n // 8, 8) << shifts)
                                        .sum(2, dtype=torch.int32)))
        self.register_buffer("scales", (torch.rand(groups, n, generator=g) / 50 + 1e-3).to(dtype))
        self.register_buffer("g_idx", (torch.randperm(k, generator=g) // group).int())
        self.register_buffer("wf", shifts)

    def forward(self, x):
        zeros = torch.bitwise_right_shift(self.qzeros.unsqueeze(2).expand(-1, -1, 8),
                                          self.wf.view(1, 1, 8)).to(torch.int8)
        zeros = torch.bitwise_and(zeros, 15).reshape(self.scales.shape)
        w = torch.bitwise_right_shift(self.qweight.unsqueeze(1).expand(-1, 8, -1),
                                      self.wf.view(1, 8, 1)).to(torch.int8)
        w = torch.bitwise_and(w, 15).reshape(-1, self.qweight.shape[1])
        g = self.g_idx.long()
        w = self.scales[g] * (w - zeros[g])
        return torch.matmul(x, w)


@pytest.mark.parametrize("m", [1, 4])
def test_act_order_gptq_gathers_its_scales_inside_the_gemv(target, m):
    backend, device = target
    layer = ActOrderQuantLinear(256, 64, 32).to(device)
    x = torch.randn(m, 256, generator=gen(14)).to(F16).to(device)
    g = layer.g_idx.long().cpu()
    want = layer.scales.cpu()[g].float() * (layer.q - layer.z[g]).float()
    assert torch.allclose(layer(x).float().cpu(), x.float().cpu() @ want, rtol=1e-2, atol=1e-2)
    # three kernels: the check of g_idx, the zero points unpacked (groups x N, small), and the
    # GEMV, which reads the packed words and gathers scales and zero points itself: nothing
    # weight-sized is stored, and no gather runs in eager (at one row on a GPU the GEMV's K is
    # cut in chunks, and a fourth kernel adds them up: extensions/quant_gemv/tests/)
    cf = assert_matches(layer, x, backend=backend, kernels=4 if device == "cuda" and m == 1 else 3)
    (gemv,) = [k for k in cf.kernels if "p_qweight" in k.source]
    assert "qweight" in gemv.source and sum(o == "aten.index.Tensor" for o in gemv.ops) == 2
    if backend in ("cpp", "llvm") and m > 1:  # the rows unrolled: each weight element read once
        assert f"_m{m - 1}" in gemv.source
    text = str(fusec.explain(layer, x, backend=backend))
    assert "aten.index" not in text.split("extern (eager ATen) calls:")[1].splitlines()[0]


def test_a_gathered_gemv_split_in_two_reductions(target, monkeypatch):
    """A GEMV of few columns and a long K is split in two reductions on a GPU
    (passes/split_reductions.py); the gathered reads are cut with K (the Unflattener's gather
    case), and the reads they replace leave the graph."""
    import importlib
    backend, device = target
    split = importlib.import_module("fusec.passes.split_reductions")
    monkeypatch.setattr(split, "SPLIT_DEVICES", ("cpu", "cuda"))
    # (chunks of 256 rows of K, not 4096: K = 1024 is cut as 8192 is on a GPU, and the
    # interpreter runs an eighth of the programs' work)
    monkeypatch.setattr(split, "MIN_CHUNK", 256)
    layer = ActOrderQuantLinear(1024, 64, 128, seed=3).to(device)
    x = torch.randn(1, 1024, generator=gen(15)).to(F16).to(device)
    cf = assert_matches(layer, x, backend=backend)
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    assert any(d.taken for d in record_of(last.gm).split_reductions)


@pytest.mark.parametrize("m", [1, 3])
def test_gathered_activations_of_a_gemv(target, m):
    """The GEMV's activation rows are gathered (an embedding, then an int8 linear). The GEMV
    views its activations as (M, 1, K), a view that ends the embedding's kernel: the M rows are
    stored (M x K, small), and the GEMV reads the int8 weight."""
    backend, device = target
    table = torch.randn(30, 64, generator=gen(40)).to(BF16)
    w = torch.randint(-127, 128, (48, 64), generator=gen(41), dtype=torch.int8)
    s = torch.rand(48, generator=gen(42)).to(BF16)
    ids = torch.tensor([7, 0, 29][:m])

    def f(ids, table, w, s):
        return (F.embedding(ids, table) @ w.to(table.dtype).t()) * s

    cf = assert_matches(f, *(t.to(device) for t in (ids, table, w, s)), backend=backend)
    names = [k.name for k in cf.kernels]
    assert "fused_embedding_1" in names and any("gemv" in n for n in names), names
