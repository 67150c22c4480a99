"""What training saves for backward and what it recomputes (fusec/capture/partition.py's
partitioner, reported by fusec/inspect/training.py): gradients equal eager's under torch's min-cut
partitioner, it saves no more than AOT Autograd's default partition (strictly less where a
chain of pointwise ops can be recomputed from its input), and explain shows the decision."""
import copy
import math

import pytest
import torch

import fusec
from fusec.errors import FusecError
from fusec.inspect.training import peak_memory, saved_for_backward


class NewGELU(torch.nn.Module):
    """GPT-2's gelu (HF transformers' NewGELUActivation): the tanh approximation, written out."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                           * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_mlp(act=None):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), act or NewGELU(), torch.nn.Linear(32, 8))


class LayerNormBlock(torch.nn.Module):
    """A transformer's pre-norm MLP half: x + fc2(gelu(fc1(layernorm(x))))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def step_matches(model, x, backend, loss_of=lambda out: (out ** 2).mean()):
    """One training step through fusec.compile(model) and eagerly on a copy: the same loss and
    the same gradients. Returns the compiled model and its one partition decision."""
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend=backend)
    loss = loss_of(compiled(x))
    loss.backward()
    ref_loss = loss_of(ref(x))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)
    entries = saved_for_backward(compiled)
    assert entries, "no partition was recorded"
    return compiled, entries


def test_gelu_mlp_saves_less_and_recomputes(target):
    backend, device = target
    model = gelu_mlp().to(device)
    x = torch.randn(4, 16, device=device)
    compiled, [(label, p, forward, backward)] = step_matches(model, x, backend)
    assert p.partitioner == "min-cut"
    assert forward is not None and backward is not None  # both programs compiled, and kept
    # the default partition saves the gelu's inner values (pow, tanh, ...); min-cut saves its
    # input (the first linear's addmm) and recomputes the chain in the backward
    assert p.saved_bytes < p.default_bytes, (p.saved, p.default_saved)
    assert {"tanh", "pow"} <= {op for _, op in p.recomputed}, p.recomputed
    saved_ops = {s.op for s in p.saved if s.counted}
    assert "addmm" in saved_ops and "tanh" not in saved_ops, p.saved
    assert p.saved_bytes == sum(s.nbytes for s in p.saved if s.counted) > 0
    # parameters and their transposes are listed, not counted: they are alive anyway
    assert any(s.is_input for s in p.saved)

    text = str(fusec.explain(compiled, x))
    assert "=== training: saved for backward (training program, min-cut partitioner) ===" in text
    assert f"saved: {sum(s.counted for s in p.saved)} tensor(s), {p.saved_bytes} bytes" in text
    assert f"the default partition would save" in text and f"{p.default_bytes} bytes" in text
    assert "recomputed in the backward: " in text and "tanh" in text
    for s in p.saved:
        assert s.name in text
    data = fusec.explain(compiled, x).to_dict()["training"]
    assert data[0]["saved_bytes"] == p.saved_bytes and data[0]["default_bytes"] == p.default_bytes


def test_exact_gelu_saves_no_more_than_default(target):
    """nn.GELU() (erf) is one ATen op whose output feeds the second matmul: torch's min-cut keeps
    it saved (recomputing a value a matmul must read back is not free), so here the two
    partitions agree; they never differ the other way."""
    backend, device = target
    model = gelu_mlp(torch.nn.GELU()).to(device)
    x = torch.randn(4, 16, device=device)
    _, [(_, p, _, _)] = step_matches(model, x, backend)
    assert p.saved_bytes <= p.default_bytes


def test_layernorm_block(target):
    backend, device = target
    model = LayerNormBlock().to(device)
    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    compiled, [(_, p, _, _)] = step_matches(model, x, backend)
    assert p.partitioner == "min-cut"
    assert p.saved_bytes <= p.default_bytes, (p.saved, p.default_saved)
    assert "training: saved for backward" in str(fusec.explain(compiled, x))


def test_gpt2(target):
    transformers = pytest.importorskip("transformers")
    backend, device = target
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16,
                                     vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(device)
    ids = torch.randint(0, 64, (2, 8), device=device)
    compiled = fusec.compile(model, backend=backend)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    ref = transformers.GPT2LMHeadModel(config).to(device)
    ref.load_state_dict(model.state_dict())
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-5, msg=name)
    entries = saved_for_backward(compiled)
    assert entries
    for _, p, _, _ in entries:
        assert p.partitioner == "min-cut"
        assert p.saved_bytes <= p.default_bytes, (p.saved, p.default_saved)
    # GPT-2's gelu is the tanh chain of NewGELU above: the backward recomputes it
    assert sum(p.default_bytes - p.saved_bytes for _, p, _, _ in entries) > 0
    assert "tanh" in {op for _, p, _, _ in entries for _, op in p.recomputed}


def test_default_partition_when_switched_off(monkeypatch):
    """FUSEC_REMAT=0: AOT Autograd's default partition, reported as such."""
    monkeypatch.setenv("FUSEC_REMAT", "0")
    x = torch.randn(4, 16)
    compiled, [(_, p, _, _)] = step_matches(gelu_mlp(), x, "cpp")
    assert p.partitioner == "default" and p.recomputed == [] and p.moved == []
    assert p.saved_bytes == p.default_bytes > 0
    text = str(fusec.explain(compiled, x))
    assert "default partition, FUSEC_REMAT=0" in text
    assert "recomputed in the backward: nothing (FUSEC_REMAT=0" in text

    monkeypatch.setenv("FUSEC_REMAT", "sometimes")
    with pytest.raises(FusecError, match="FUSEC_REMAT"):
        fusec.compile(gelu_mlp(), backend="cpp")(x).sum().backward()


def test_torch_compile_backend_uses_min_cut():
    torch._dynamo.reset()
    model = gelu_mlp()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    opt = torch.compile(model, backend="fusec", options={"backend": "cpp"})
    opt(x).sum().backward()
    ref(x).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)
    [(label, p, forward, backward)] = saved_for_backward(opt)
    assert label == "region 1" and p.partitioner == "min-cut"
    assert p.saved_bytes < p.default_bytes
    text = str(fusec.explain(opt))
    assert "=== training: saved for backward (region 1, min-cut partitioner) ===" in text
    assert "tanh" in text.split("=== training: saved for backward")[1]
    torch._dynamo.reset()


def test_peak_memory_on_cpu_is_an_estimate():
    model = gelu_mlp()
    x = torch.randn(4, 16)
    compiled = fusec.compile(model, backend="cpp")
    peak = peak_memory(lambda: compiled(x).sum().backward(), compiled, device="cpu")
    [(_, p, forward, backward)] = saved_for_backward(compiled)
    assert peak.how.startswith("estimated")
    # at least what the backward holds: the saved tensors and the gradients it returns
    assert peak.bytes >= p.saved_bytes + p.backward_out_bytes
    assert p.backward_out_bytes == sum(t.numel() * 4 for t in model.parameters())
    with pytest.raises(ValueError, match="pass the fusec-compiled object"):
        peak_memory(lambda: None, device="cpu")
