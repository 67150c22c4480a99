"""Training on a GPU through the Triton backend: the GPU half of the training tests.

On a machine with CUDA (and Triton not in its interpreter) each test trains a small model from
benchmarks/train_models.py (random init, dropout 0) the same way benchmarks/train.py does: bf16
autocast, fused AdamW, the loss inside the model, a few steps from one seed, once eagerly and once
through `fusec.compile`. The losses must follow eager's step by step within bf16's tolerance, and
the compiled optimizer step (`fusec.compile(opt.step)`) must leave the parameters where eager's
leaves them. Without a GPU every test here skips (the CPU backends' training tests are
tests/test_training.py, test_training_fusion.py, test_remat.py and test_optimizer_step.py).
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

import fusec
from conftest import GPU

pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU with Triton compiling for it")

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

STEPS = 5


def losses(model, batches, compile_it: bool) -> list[float]:
    torch.manual_seed(0)
    model = copy.deepcopy(model)
    run = fusec.compile(model) if compile_it else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    out = []
    for batch in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "resnet50"])
def test_small_models_train_like_eager(name):
    from train_models import workload
    w = workload(name, device="cuda", small=True, steps=STEPS)
    eager = losses(w.model, w.batches, False)
    fused = losses(w.model, w.batches, True)
    # bf16 autocast: each step's matmuls round to 8 bits of mantissa, and the two programs
    # accumulate in different orders, so losses drift apart by a few bf16 ulps over the steps
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name, foreach", [("SGD", False), ("SGD", True), ("Adam", False),
                                           ("Adam", True), ("AdamW", False), ("AdamW", True)])
def test_optimizer_step_on_the_gpu(name, foreach):
    kw = dict(SGD=dict(momentum=0.9), Adam={}, AdamW=dict(weight_decay=0.1))[name]
    cls = getattr(torch.optim, name)

    def train(how: str):  # tests/test_optimizer_step.py's model, loss and batches, on CUDA
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4)).cuda()
        opt = cls(model.parameters(), lr=0.05, foreach=foreach, **kw)
        step = {"eager": lambda: opt.step, "inductor": lambda: torch.compile(opt.step),
                "fusec": lambda: fusec.compile(opt.step)}[how]()
        gen = torch.Generator().manual_seed(1)
        for _ in range(10):
            model(torch.randn(5, 8, generator=gen).cuda()).pow(2).sum().backward()
            step()
            opt.zero_grad()
        torch._dynamo.reset()
        return [p.detach().clone() for p in model.parameters()]

    eager, inductor, got = train("eager"), train("inductor"), train("fusec")
    # A compiled step rounds differently from eager's one-op-at-a-time kernels (a multiply and
    # an add contracted into one FMA), and Adam divides each gradient by its own size, so where a
    # gradient is rounding noise one ulp becomes a full step: after 10 steps two correct programs
    # are apart by up to ~2e-4 here. fusec must be as close to eager as torch.compile's own
    # program is (twice its distance, at least float32 rounding).
    theirs = max((i - e).abs().max().item() for i, e in zip(inductor, eager))
    ours = max((g - e).abs().max().item() for g, e in zip(got, eager))
    assert ours <= max(2 * theirs, 1e-5), (ours, theirs)
