"""fusec under torch.distributed on this CPU: DDP and FSDP2 with the gloo backend, two processes.

One spawn per model (two local processes, 127.0.0.1, a free port, bounded in time) trains the
same model 5 steps from one seed, each process on its own batches, eagerly and then through fusec
in each of the ways people write it:

    DDP(fusec.compile(model))              the module compiled inside the wrapper
    fusec.compile(DDP(model))              the wrapper compiled (it goes to TorchDynamo, which
                                           knows DDP: fusec/api.py `_dynamo_first`)
    fully_shard(fusec.compile(block))      FSDP2's per-block recipe
    fusec.compile(fully_shard(model))      the whole sharded model

and with what training scripts add to them (a way's `+variant`):

    +bf16      FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    +autocast  the forward under torch.autocast("cpu", bfloat16)
    +ckpt      torch.utils.checkpoint around each block's body, inside the block
    +wrapper   FSDP2 over checkpoint_wrapper(fusec.compile(block)) blocks
    +accum     2 micro-batches a step: DDP's no_sync() / FSDP2's set_requires_gradient_sync(False)
               for the first, the gradients all-reduced once, after the second

The losses of rank 0 and every parameter afterwards (FSDP2's gathered with `full_tensor`) must
equal eager's run of the same way and variant to float32 rounding (rtol 1e-5): a gradient that
skipped its all-reduce shows at once. Runs in bfloat16 (+bf16, +autocast) are compared within
bfloat16's tolerance instead (`BF16`, torch.testing's rtol for bfloat16). (SGD with momentum:
AdamW divides each gradient by its own size, so where a gradient is only rounding noise, such as
a bias before a norm, it turns that noise into full-size steps and any two correct programs drift
apart; tests/test_optimizer_step.py covers AdamW.)

The CNN's spawn also asks `fusec.explain` and `fusec.profile` on every rank for one step of
fusec.compile(DDP(model)) and of the per-block FSDP2 recipe (fusec/inspect/distributed.py), and
the last test runs benchmarks/distributed.py under torchrun for 2 steps.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

ROOT = Path(__file__).parent.parent
STEPS = 5
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-3)  # torch.testing's rtol for bfloat16; atol for weights near 0

WAYS = {
    # (fusec(fsdp), TorchDynamo's path for a sharded model, on the CNN only: through Dynamo,
    # the whole GPT-2 costs this file most of a minute more on a 2-core machine)
    # (fsdp(fusec blocks) in float32 on the CNN only: GPT-2's blocks take that path in bf16)
    "gpt2": ["eager-ddp", "ddp(fusec)", "fusec(ddp)", "eager-fsdp",
             "eager-fsdp+bf16", "fsdp(fusec blocks)+bf16", "eager-ddp+autocast",
             "ddp(fusec)+autocast"],
    "cnn": ["eager-ddp", "ddp(fusec)", "fusec(ddp)", "eager-fsdp", "fsdp(fusec blocks)",
            "fusec(fsdp)", "eager-ddp+ckpt", "ddp(fusec)+ckpt", "eager-fsdp+wrapper",
            "fsdp(fusec blocks)+wrapper", "eager-ddp+accum", "fusec(ddp)+accum",
            "eager-fsdp+accum", "fsdp(fusec blocks)+accum"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpt2(use_cache: bool = False):
    """A tiny GPT-2. Training scripts turn the key/value cache off (a training step has no use
    for it); with it on, each block fills the model's cache, which `test_blocks_that_fill_a_cache`
    covers."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=use_cache,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class Block(nn.Module):
    """conv, batch norm, relu; with `ckpt`, the body runs under torch.utils.checkpoint (its
    activations recomputed in the backward), inside the block fusec compiles."""

    def __init__(self, cin: int, cout: int, ckpt: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(cout), nn.ReLU())
        self.ckpt = ckpt

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False) if self.ckpt else self.body(x)


class SmallCNN(nn.Module):
    def __init__(self, ckpt: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(3, 8, ckpt), Block(8, 8, ckpt)])
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


def wrap(model, way: str):
    """The model as `way` runs it: (what to call, the DDP module or None)."""
    import fusec
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    how, _, variant = way.partition("+")
    if how == "eager-ddp":
        return (ddp := DDP(model)), ddp
    if how == "ddp(fusec)":
        return (ddp := DDP(fusec.compile(model, backend="cpp"))), ddp
    if how == "fusec(ddp)":
        return fusec.compile(ddp := DDP(model), backend="cpp"), ddp
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if variant == "bf16" else MixedPrecisionPolicy()
    blocks = blocks_of(model)
    for i in range(len(blocks)):
        if how == "fsdp(fusec blocks)":
            blocks[i] = fusec.compile(blocks[i], backend="cpp")
        if variant == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
                checkpoint_wrapper
            blocks[i] = checkpoint_wrapper(blocks[i])
        fully_shard(blocks[i], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return (fusec.compile(model, backend="cpp") if how == "fusec(fsdp)" else model), None


def train(model_name: str, way: str, rank: int) -> tuple[list, list]:
    """5 steps of SGD; rank 0's losses and the parameters after (gathered)."""
    variant = way.partition("+")[2]
    torch.manual_seed(0)
    model = gpt2() if model_name == "gpt2" else SmallCNN(ckpt=variant == "ckpt")
    run, ddp = wrap(model, way)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # each process its own batches
    losses = []
    for _ in range(STEPS):
        if variant == "accum":  # the first micro-batch's gradients stay on this rank
            if ddp is not None:
                with ddp.no_sync():
                    (loss_of(model_name, run, gen) / 2).backward()
            else:
                model.set_requires_gradient_sync(False)
                (loss_of(model_name, run, gen) / 2).backward()
                model.set_requires_gradient_sync(True)
            loss = loss_of(model_name, run, gen) / 2
        elif variant == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model_name, run, gen)
        else:
            loss = loss_of(model_name, run, gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return losses, [p.detach().float().clone() for p in params]


def step_views(rank: int) -> dict:
    """fusec.explain and fusec.profile of one step of fusec.compile(DDP(cnn)) and of the
    per-block FSDP2 recipe, on every rank (the step's collectives need both)."""
    import fusec
    views = {}
    for way in ("fusec(ddp)", "fsdp(fusec blocks)"):
        torch.manual_seed(0)
        model = SmallCNN()
        run, _ = wrap(model, way)
        x = torch.randn(4, 3, 8, 8)
        run(x).pow(2).mean().backward()  # compiled, as after a first training step
        before = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        explained, profiled = fusec.explain(run, x), fusec.profile(run, x)
        untouched = all((a is None and p.grad is None) or torch.equal(a, p.grad)
                        for a, p in zip(before, model.parameters()))
        views[way] = (str(explained), explained.to_dict(), str(profiled), untouched)
    return views


def worker(rank: int, port: int, model_name: str, ways: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # (the two ranks compile the same kernels at the same moments into one cache: one builds each
    # kernel, the other waits on its lock and loads it, fusec/cache.py build_once)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {way: train(model_name, way, rank) for way in ways}
        if model_name == "cnn":
            results["views"] = step_views(rank)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def spawn(model_name: str, ways: list, out: Path) -> dict:
    """Run `worker` in two processes; {way: (rank 0's losses, the parameters after)}."""
    context = mp.start_processes(worker, args=(free_port(), model_name, ways, str(out)),
                                 nprocs=2, join=False, start_method="spawn")
    for _ in range(900):  # at most 15 minutes (GPT-2's: 1-2 minutes of CPU time, about 5 of
        if context.join(timeout=1):  # wall clock with a cold kernel cache on a 2-core machine
            break  # that 8 other processes share)
    else:
        for p in context.processes:
            p.kill()
        pytest.fail("the two processes did not finish in 15 minutes")
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn per model, shared by the tests below (each spawn pays its compiles once)."""
    made, failed = {}, {}

    def get(model_name: str) -> dict:
        if model_name in failed:  # (one spawn per model, even when it failed)
            pytest.fail(f"the {model_name} processes failed (see the first test that ran "
                        f"them): {failed[model_name]}")
        if model_name not in made:
            out = tmp_path_factory.mktemp(model_name) / "results.pt"
            try:
                made[model_name] = spawn(model_name, WAYS[model_name], out)
            except BaseException as err:
                failed[model_name] = str(err).strip().splitlines()[-1][:300] if str(err) else repr(err)
                raise
        return made[model_name]
    return get


def reference(way: str) -> str:
    how, plus, variant = way.partition("+")
    return ("eager-fsdp" if "fsdp" in how else "eager-ddp") + plus + variant


@pytest.mark.parametrize("model_name, way", [(m, w) for m, ways in WAYS.items()
                                             for w in ways if not w.startswith("eager")])
def test_training_matches_eager(runs, model_name, way):
    results = runs(model_name)
    losses, params = results[way]
    want_losses, want_params = results[reference(way)]
    tol = BF16 if way.endswith(("+bf16", "+autocast")) else FP32
    assert losses == pytest.approx(want_losses, rel=tol["rtol"], abs=tol["atol"]), way
    assert len(params) == len(want_params)
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, **tol, msg=way)


@pytest.mark.parametrize("model_name", list(WAYS))
def test_eager_ddp_and_fsdp2_agree(runs, model_name):
    """DDP and FSDP2 train the same model the same way: their eager runs agree too (so a test
    above that compares with one of them is not comparing with a broken wrapper)."""
    results = runs(model_name)
    torch.testing.assert_close(results["eager-ddp"][0], results["eager-fsdp"][0], **FP32)
    for a, b in zip(results["eager-ddp"][1], results["eager-fsdp"][1]):
        torch.testing.assert_close(a, b, **FP32)


def test_explain_and_profile_show_collectives_between_programs(runs):
    views = runs("cnn")["views"]
    text, data, profiled, untouched = views["fusec(ddp)"]
    assert untouched, "explain/profile changed the parameters' gradients"
    assert "rank 0 of 2 (gloo)" in text and "fusec.compile(DistributedDataParallel(SmallCNN))" in text
    kinds = [(e["kind"], e["where"]) for e in data["events"]]
    # DDP: the forward broadcasts rank 0's batch-norm buffers; the gradients' all-reduce follows
    # the backward program that computed them
    assert kinds.index(("broadcast", "")) < kinds.index(("forward program", ""))
    assert kinds.index(("backward program", "")) < kinds.index(("all-reduce", "bucket 0"))
    assert data["programs"][0]["forward"] and data["programs"][0]["backward"]
    assert "start ms" in profiled and "all-reduce" in profiled

    text, data, profiled, untouched = views["fsdp(fusec blocks)"]
    assert untouched
    kinds = [(e["kind"], e["where"]) for e in data["events"]]
    assert [p["name"] for p in data["programs"]] == ["blocks.0", "blocks.1"]
    for block in ("blocks.0", "blocks.1"):  # gathered before its forward, reduced after its backward
        assert kinds.index(("all-gather", block)) < kinds.index(("forward program", block))
        assert kinds.index(("backward program", block)) < kinds.index(("reduce-scatter", block))
    # the backward runs the blocks in reverse
    assert kinds.index(("backward program", "blocks.1")) < kinds.index(("backward program", "blocks.0"))
    assert "reduce-scatter    blocks.0" in text


def test_blocks_that_fill_a_cache():
    """FSDP2's per-block recipe with transformers' cache on (its default): HF GPT-2 hands every
    block the model's DynamicCache, which the block fills with its keys and values. Compiled
    block by block, the first block gets an empty cache and fills it, the second a cache holding
    tensors: neither can be one graph (a graph cannot change the caller's objects), so both are
    compiled in regions through TorchDynamo (fusec/capture/calls.py, "Note (argument objects
    while tracing)"). One process, no FSDP: what it needs of capture is the same. The cache the
    caller gets back holds eager's real keys, and the gradients are eager's."""
    import fusec
    torch.manual_seed(0)
    model, ref = gpt2(use_cache=True), gpt2(use_cache=True)
    ref.load_state_dict(model.state_dict())
    blocks = blocks_of(model)
    for i in range(len(blocks)):
        blocks[i] = fusec.compile(blocks[i], backend="cpp")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.warns(fusec.GraphBreakWarning, match="puts tensors into an argument DynamicCache"):
        out = model(input_ids=ids, labels=ids)
    want = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, **FP32)
    for layer, ref_layer in zip(out.past_key_values.layers, want.past_key_values.layers):
        assert type(layer.keys) is torch.Tensor  # not a fake tensor left by tracing
        torch.testing.assert_close(layer.keys, ref_layer.keys, **FP32)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32, msg=name)


def test_checkpoint_inside_a_compiled_block_recomputes():
    """torch.utils.checkpoint inside a program fusec compiles for training: traced through, it
    would be computed right but its activations saved anyway; so it is a graph break, and
    TorchDynamo's checkpoint region tells AOT Autograd's partitioner to recompute them
    (fusec/capture/tracing.py). The gradients are eager's, and nothing of the block's body is
    saved for the backward. One process: the `+ckpt` ways above run it under DDP."""
    import fusec
    torch.manual_seed(0)
    block, ref = Block(3, 8, ckpt=True), Block(3, 8, ckpt=True)
    ref.load_state_dict(block.state_dict())
    compiled = fusec.compile(block, backend="cpp")
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(fusec.GraphBreakWarning, match="torch.utils.checkpoint"):
        compiled(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **FP32)
    partitions = [p for r in fusec.regions(compiled).regions for p in r.parts.partitions]
    assert partitions and all(p.saved_bytes == 0 for p in partitions), \
        [[s.name for s in p.saved if s.counted] for p in partitions]
    assert any(op == "convolution" for p in partitions for _, op in p.recomputed)


def test_benchmark_runs_under_torchrun(tmp_path):
    """benchmarks/distributed.py under torchrun, 2 processes on this CPU, 2 steps, small GPT-2,
    FSDP2 with compiled blocks (one block's program to compile: the cheapest wrapper to run):
    every system trains, its losses within tolerance of eager's, the JSON says so."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "benchmarks" / "distributed.py"), "--model", "gpt2", "--wrap", "fsdp2",
           "--systems", "eager,fusec", "--steps", "2", "--warmup", "1", "--small",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["eager", "fusec"]
    for row in rows:
        assert row["ok"] and len(row["losses"]) == 2 and row["step_ms"] > 0, row
    assert "step ms" in proc.stdout and "fusec" in proc.stdout
