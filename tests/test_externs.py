"""Extern ops (matmuls, convolution, attention, embedding) run as ATen calls; the pointwise and
reduction work around them fuses into the kernels before and after them."""
import torch
import torch.nn.functional as F

from conftest import assert_matches
from fusec.record import record_of


def steps(cf):
    return [(s.kind, s.name) for s in record_of(cf.last.gm).schedule]


def test_conv_bias_relu_batchnorm_eval(target):
    backend, device = target
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9, device=device)
    w, b = torch.randn(4, 3, 3, 3, device=device), torch.randn(4, device=device)
    mean, var = torch.randn(4, device=device), torch.rand(4, device=device) + 0.5

    def f(x, w, b, mean, var):
        y = F.conv2d(x, w, padding=1)
        return F.relu(F.batch_norm(y + b.view(1, 4, 1, 1), mean, var, training=False)) * 0.5
    with torch.no_grad():
        cf = assert_matches(f, x, w, b, mean, var, backend=backend)
    kinds = steps(cf)
    assert [k for k, _ in kinds].count("extern") == 1, kinds  # the convolution
    assert [k for k, _ in kinds].count("kernel") == 1, kinds  # bias, batch norm, relu, scale


def test_embedding_then_layernorm_and_scaled_matmul(target):
    backend, device = target
    torch.manual_seed(0)
    table = torch.randn(50, 16, device=device)
    idx = torch.randint(0, 50, (4, 7), device=device)
    w = torch.randn(16, 16, device=device)

    def f(idx, table, w):
        h = F.layer_norm(F.embedding(idx, table), (16,))
        return torch.tanh((h @ w) * 0.25 + 1.0)
    cf = assert_matches(f, idx, table, w, backend=backend)
    kinds = steps(cf)
    # the embedding is read inside the layer norm's kernel (passes/check_gathers.py), after a
    # small kernel that checks the indices; scale + add + tanh after the matmul
    assert [k for k, _ in kinds].count("kernel") == 3, kinds
    assert sorted(name for k, name in kinds if k == "extern") == \
        ["aten._assert_async.msg", "aten.mm.default"], kinds


def test_sdpa_with_fused_neighbours(target):
    backend, device = target
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, device=device) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q * 2.0, k, v, is_causal=True) + 1.0
    assert_matches(f, q, k, v, backend=backend)


def test_baddbmm_and_dropout_in_eval(target):
    backend, device = target
    torch.manual_seed(0)
    a, b1, b2 = (torch.randn(3, 4, 4, device=device) for _ in range(3))

    def f(a, b1, b2):
        return F.dropout(torch.baddbmm(a, b1, b2).sigmoid(), p=0.3, training=False) * 3
    cf = assert_matches(f, a, b1, b2, backend=backend)
    assert [k for k, _ in steps(cf)].count("kernel") == 1


def test_attention_without_dropout_does_not_block_a_cuda_graph():
    """The fused attention ops are tagged nondeterministic_seeded (they can apply dropout); with
    dropout_p 0 they draw no random numbers, so a program calling them may be one CUDA graph (an
    H100 profile of torchvision's vit_b_16 ran step by step for this)."""
    from fusec.runtime import ExternStep, draws_random_numbers
    aten = torch.ops.aten
    q = (None, None, None)
    cudnn = aten._scaled_dot_product_cudnn_attention.default
    assert not draws_random_numbers(ExternStep(cudnn, (*q, None, False, 0.0, False, False), {}, 0, None))
    assert draws_random_numbers(ExternStep(cudnn, (*q, None, False, 0.1, False, False), {}, 0, None))
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert not draws_random_numbers(ExternStep(efficient, (*q, None, False), {}, 0, None))  # default 0
    flash = aten._scaled_dot_product_flash_attention.default
    assert draws_random_numbers(ExternStep(flash, q, {"dropout_p": 0.5}, 0, None))
    assert draws_random_numbers(ExternStep(aten.rand.default, ([3],), {}, 0, None))
    assert not draws_random_numbers(ExternStep(aten.add.Tensor, (1, 2), {}, 0, None))
