"""Batch norm in inference is captured at the torch level (fusec/capture/torch_level.py, the
note on BatchNorm): the pointwise formula straight away, not torch's composite chain and then
the decomposition. The same values as eager on every backend, fewer traced nodes, and training
mode (batch statistics, running statistics updated) still takes torch's path."""
import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches
from fusec.capture import frontend, torch_level


def _norm(cls, channels, device, dtype=torch.float32, affine=True):
    torch.manual_seed(0)
    norm = cls(channels, affine=affine).to(device, dtype).eval()
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        if affine:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return norm


@pytest.mark.parametrize("cls,shape", [(torch.nn.BatchNorm1d, (5, 6)),
                                       (torch.nn.BatchNorm1d, (3, 6, 7)),
                                       (torch.nn.BatchNorm2d, (2, 6, 5, 3)),
                                       (torch.nn.BatchNorm3d, (2, 6, 3, 4, 2))])
@pytest.mark.parametrize("affine", [True, False])
def test_inference_batch_norm_matches_eager(target, cls, shape, affine):
    backend, device = target
    norm = _norm(cls, 6, device, affine=affine)
    x = torch.randn(shape, device=device)
    x[0, 0] = float("nan")
    with torch.no_grad():
        assert_matches(lambda x: torch.relu(norm(x)) * 2, x, backend=backend)


def test_inference_batch_norm_in_bfloat16_and_non_contiguous(target):
    """Every tensor is an argument, so the float64 reference upcasts the statistics and the
    affine too (a module's bfloat16 parameters would stay bfloat16 in it)."""
    backend, device = target
    norm = _norm(torch.nn.BatchNorm2d, 4, device, torch.bfloat16)
    x = torch.randn(2, 5, 4, 3, device=device, dtype=torch.bfloat16).transpose(1, 2)

    def f(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, False, 0.1, 1e-5)
    assert_matches(f, x, norm.running_mean, norm.running_var, norm.weight.detach(),
                   norm.bias.detach(), backend=backend)


def test_functional_batch_norm_with_running_statistics(target):
    backend, device = target
    mean, var = torch.randn(3, device=device), torch.rand(3, device=device) + 0.5
    weight = torch.randn(3, device=device)
    x = torch.randn(4, 3, 2, device=device)
    assert_matches(lambda x: F.batch_norm(x, mean, var, weight, None, False, 0.1, 1e-3), x,
                   backend=backend)


def test_training_batch_norm_updates_running_statistics_as_eager_does():
    norm, twin = _norm(torch.nn.BatchNorm2d, 4, "cpu"), _norm(torch.nn.BatchNorm2d, 4, "cpu")
    norm.train()
    twin.train()
    compiled = fusec.compile(norm, backend="cpp")
    x = torch.randn(3, 4, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), twin(x))
    torch.testing.assert_close(norm.running_mean, twin.running_mean)
    torch.testing.assert_close(norm.running_var, twin.running_var)


def test_captured_at_the_torch_level_with_fewer_nodes(monkeypatch):
    norm = torch.nn.Sequential(*[_norm(torch.nn.BatchNorm2d, 8, "cpu") for _ in range(4)])
    x = torch.randn(2, 8, 4, 4)
    with torch.no_grad():
        ours = frontend.capture(norm, (x,)).gm
        monkeypatch.delitem(torch_level.TORCH_LEVEL, torch.nn.functional.batch_norm)
        monkeypatch.delitem(torch_level.TORCH_LEVEL, torch.batch_norm)
        theirs = frontend.capture(norm, (x,)).gm
    targets = [str(n.target) for n in ours.graph.nodes if n.op == "call_function"]
    assert not any("batch_norm" in t for t in targets), targets
    assert len(ours.graph.nodes) < len(theirs.graph.nodes)
