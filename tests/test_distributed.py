"""fusec under torch.distributed on this CPU: DDP and FSDP2 with the gloo backend, two processes.

Each test spawns two local processes (127.0.0.1, a free port, bounded in time). In them, the
same script trains the same model 5 steps from one seed, each process on its own batches,
eagerly and then through fusec in each of the ways people write it:

    DDP(fusec.compile(model))              the module compiled inside the wrapper
    fusec.compile(DDP(model))              the wrapper compiled (it goes to TorchDynamo, which
                                           knows DDP: fusec/api.py `_dynamo_first`)
    fully_shard(fusec.compile(block))      FSDP2's per-block recipe
    fusec.compile(fully_shard(model))      the whole sharded model

The losses of rank 0 and every parameter afterwards (FSDP2's gathered with `full_tensor`) must
equal eager's run to float32 rounding: a gradient that skipped its all-reduce shows at once.
(SGD with momentum: AdamW divides each gradient by its own size, so where a gradient is only
rounding noise, such as a bias before a norm, it turns that noise into full-size steps and any
two correct programs drift apart; tests/test_optimizer_step.py covers AdamW.)

Known gap: FSDP2's per-block recipe on HF GPT-2's blocks fails while compiling the backward
(AOT Autograd finds a fake tensor constant in the graph); the test below says so (strict xfail).
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

STEPS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def blocks_of(model) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.blocks


def loss_of(model_name: str, run, gen):
    if model_name == "gpt2":
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        out = run(input_ids=ids, labels=ids)
        return out.loss if hasattr(out, "loss") else out["loss"]
    return run(torch.randn(4, 3, 8, 8, generator=gen)).pow(2).mean()


def train(model_name: str, how: str, rank: int) -> tuple[list, list]:
    import fusec
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = gpt2() if model_name == "gpt2" else SmallCNN()
    if how == "eager-ddp":
        run = DDP(model)
    elif how == "ddp(fusec)":
        run = DDP(fusec.compile(model, backend="cpp"))
    elif how == "fusec(ddp)":
        run = fusec.compile(DDP(model), backend="cpp")
    else:  # FSDP2
        blocks = blocks_of(model)
        for i in range(len(blocks)):
            if how == "fsdp(fusec blocks)":
                blocks[i] = fusec.compile(blocks[i], backend="cpp")
            fully_shard(blocks[i])
        fully_shard(model)
        run = fusec.compile(model, backend="cpp") if how == "fusec(fsdp)" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # each process its own batches
    losses = []
    for _ in range(STEPS):
        loss = loss_of(model_name, run, gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return losses, [p.detach().clone() for p in params]


def worker(rank: int, port: int, model_name: str, ways: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {how: train(model_name, how, rank) for how in ways}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("model_name, ways", [
    ("gpt2", ["eager-ddp", "ddp(fusec)", "fusec(ddp)", "eager-fsdp", "fusec(fsdp)"]),
    ("cnn", ["eager-ddp", "fusec(ddp)", "eager-fsdp", "fsdp(fusec blocks)"]),
])
def test_distributed_training_matches_eager(model_name, ways, tmp_path):
    results = spawn(model_name, ways, tmp_path)
    for how in ways:
        reference = results["eager-fsdp" if "fsdp" in how else "eager-ddp"]
        losses, params = results[how]
        assert losses == pytest.approx(reference[0], rel=1e-5, abs=1e-6), how
        for got, want in zip(params, reference[1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=how)
    # DDP and FSDP2 train the same model the same way: the two eager runs agree too
    torch.testing.assert_close(results["eager-ddp"][0], results["eager-fsdp"][0], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.xfail(strict=True, reason="FSDP2 per block on HF GPT-2: AOT Autograd finds a fake "
                   "tensor constant in fusec's captured block (see the module docstring)")
def test_fsdp2_per_block_gpt2(tmp_path):
    results = spawn("gpt2", ["eager-fsdp", "fsdp(fusec blocks)"], tmp_path)
    torch.testing.assert_close(results["fsdp(fusec blocks)"][1], results["eager-fsdp"][1])


def spawn(model_name: str, ways: list, tmp_path) -> dict:
    """Run `worker` in two processes; {way: (rank 0's losses, the parameters after)}."""
    out = str(tmp_path / "results.pt")
    context = mp.start_processes(worker, args=(free_port(), model_name, ways, out), nprocs=2,
                                 join=False, start_method="spawn")
    for _ in range(600):  # at most 10 minutes
        if context.join(timeout=1):
            break
    else:
        for p in context.processes:
            p.kill()
        pytest.fail("the two processes did not finish in 10 minutes")
    return torch.load(out)
