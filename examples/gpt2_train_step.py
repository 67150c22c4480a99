"""One training step of a 2-layer GPT (random weights, random token ids): embedding, two
transformer blocks, the LM head, cross-entropy, backward, AdamW. fusec compiles forward and
backward; the gradients and the updated weights match an eager copy."""
import copy

import torch
import torch.nn.functional as F

import fusec
from fusec.demo import Example
from fusec.examples.gpt2_block import Block


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 256, seq: int = 32, n_embd: int = 64, n_head: int = 4,
                 n_layer: int = 2):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, n_embd)
        self.pos = torch.nn.Embedding(seq, n_embd)
        self.blocks = torch.nn.ModuleList(Block(n_embd, n_head, seq) for _ in range(n_layer))
        self.ln_f = torch.nn.LayerNorm(n_embd)
        self.head = torch.nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def step(backend: str = "auto", device: str = "cpu", batch: int = 4, seq: int = 32):
    torch.manual_seed(0)
    model = TinyGPT(seq=seq).to(device)
    eager = copy.deepcopy(model)
    idx = torch.randint(0, 256, (batch, seq), device=device)
    targets = torch.randint(0, 256, (batch, seq), device=device)
    compiled = fusec.compile(model, backend=backend)
    results = []
    for m in (compiled, eager):
        opt = torch.optim.AdamW((model if m is compiled else eager).parameters(), lr=1e-3)
        loss = m(idx, targets)
        loss.backward()
        opt.step()
        results.append(loss.item())
    grad_err = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), eager.parameters()))
    weight_err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters()))
    print(f"loss: fusec {results[0]:.6f}, eager {results[1]:.6f}")
    print(f"max |grad difference| {grad_err:.2e}, max |weight difference| after AdamW {weight_err:.2e}")
    print(f"{len(compiled.kernels)} fused kernels (forward + backward)")
    return results, grad_err, weight_err


def example(batch: int = 4, seq: int = 32, device: str = "cpu") -> Example:
    """The CLI's entry point (`fusec explain examples/gpt2_train_step.py`): the TinyGPT's
    forward (embedding, two blocks, LM head, cross-entropy loss) for inference, with the same
    random weights and token ids as `step()`. `step()` is the training step itself."""
    torch.manual_seed(0)
    model = TinyGPT(seq=seq).to(device).eval()
    idx = torch.randint(0, 256, (batch, seq), device=device)
    targets = torch.randint(0, 256, (batch, seq), device=device)
    return Example("gpt2_train_step", model, (idx, targets),
                   "a 2-layer GPT's forward and loss: fused kernels between extern matmuls")


SMALL = dict(batch=2, seq=16)  # `fusec ... --small`: sizes for quick looks and tests

if __name__ == "__main__":
    step()
