"""Compile time of whole models: cold and warm, fusec vs torch.compile, side by side in one run.

    python benchmarks/compile_time.py                      # CPU: a 6-layer BERT and a ResNet
    python benchmarks/compile_time.py --models bert_base,resnet50 --dtype bfloat16   # on a GPU
    python benchmarks/compile_time.py --models all --json compile_time.json

For every model and system (fusec, torch.compile) two processes run one after the other over
one set of cache directories made empty for them (FUSEC_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR):

    cold   the first process: nothing cached; it compiles everything
    warm   the second process: everything cached (fusec: every kernel binary; torch.compile: its
           FX graph and AOT Autograd caches and Triton's); what a user rerunning a script waits

Each process builds the model (random weights, seeded), then times its first call: compile and
run, until the result is there (on CUDA, synchronized). Importing torch and the compiler is not
counted (both pay it). For fusec the time is also split per stage (`FUSEC_LOG=compile` prints the
same split): capture (torch.fx, make_fx), passes, codegen (lowering to kernel IR and rendering),
build (compilers), load (dlopen / MCJIT / import, program assembly), and run (the first run
itself, plus what the driver does around the stages; with graph breaks, TorchDynamo's tracing).
The output is compared with eager's so that a fast compile of a wrong program cannot pass.

The machine's load average is printed with the table: on a shared machine, the other users'
work lands in every number.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

# name -> (description, code building `model` and `inputs` from `torch`, `device`, `dtype`).
# The real models are those of the real-models benchmark, at its sizes; bert6 and resnet are
# the small transformers models that fit this project's 2-core CPU.
MODELS = {
    "bert6": ("transformers BERT, 6 layers, hidden 256, batch 2 x 128", """
        import transformers
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=1024))
        inputs = [torch.randint(0, 30522, (2, 128))]"""),
    "resnet": ("transformers ResNet, 4 stages x 2 blocks, batch 2 x 3 x 64 x 64", """
        import transformers
        model = transformers.ResNetModel(transformers.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2]))
        inputs = [torch.randn(2, 3, 64, 64)]"""),
    "gpt2": ("GPT-2 small with its LM head, batch 8 x 512", """
        import transformers
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        inputs = [torch.randint(0, 50257, (8, 512))]"""),
    "bert_base": ("BERT-base, batch 16 x 512", """
        import transformers
        model = transformers.BertModel(transformers.BertConfig())
        inputs = [torch.randint(0, 30522, (16, 512))]"""),
    "vit_base": ("transformers ViT-B/16, batch 32 x 224^2", """
        import transformers
        model = transformers.ViTModel(transformers.ViTConfig(image_size=224))
        inputs = [torch.randn(32, 3, 224, 224)]"""),
    "t5_encoder": ("T5-base encoder, batch 16 x 512", """
        import transformers
        model = transformers.T5EncoderModel(transformers.T5Config())
        inputs = [torch.randint(0, 32128, (16, 512))]"""),
    "resnet50": ("torchvision resnet50, batch 32 x 224^2", """
        import torchvision
        model = torchvision.models.resnet50()
        inputs = [torch.randn(32, 3, 224, 224)]"""),
    "mobilenet_v3": ("torchvision mobilenet_v3_large, batch 32 x 224^2", """
        import torchvision
        model = torchvision.models.mobilenet_v3_large()
        inputs = [torch.randn(32, 3, 224, 224)]"""),
    "efficientnet_b0": ("torchvision efficientnet_b0, batch 32 x 224^2", """
        import torchvision
        model = torchvision.models.efficientnet_b0()
        inputs = [torch.randn(32, 3, 224, 224)]"""),
    "convnext_tiny": ("torchvision convnext_tiny, batch 32 x 224^2", """
        import torchvision
        model = torchvision.models.convnext_tiny()
        inputs = [torch.randn(32, 3, 224, 224)]"""),
}
CPU_DEFAULT = ["bert6", "resnet"]
GPU_DEFAULT = ["bert_base", "vit_base", "t5_encoder", "resnet50", "mobilenet_v3",
               "efficientnet_b0"]
STAGES = ["capture", "passes", "codegen", "build", "load", "run"]

# What every child process runs to build `model` and `inputs` (from `device` and `dtype`, names
# of its own): the model's code from MODELS, seeded, moved, and cast. `with_model` puts it where a
# child's code says BUILD_MODEL (benchmarks/diagnostics/ reuse it).
BUILD = r'''
torch.manual_seed(0)
dtype = getattr(torch, dtype)
MODEL_CODE
model = model.eval().to(device)
if dtype.is_floating_point and dtype != torch.float32:
    model = model.to(dtype)
inputs = [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs]
'''


def with_model(child: str, name: str) -> str:
    """`child` with its BUILD_MODEL line replaced by the code that builds model `name`."""
    build = BUILD.replace("MODEL_CODE", textwrap.dedent(MODELS[name][1]).strip()).strip()
    return child.replace("BUILD_MODEL", build)


CHILD = r'''
import json, os, sys, time
system, name, device, dtype, backend = sys.argv[1:6]
import torch
if system == "fusec":
    import fusec, fusec.log
    stages = {}

    def record(compiled, label="program", _inner=fusec.log.compile_times):
        for stage, seconds in compiled.times.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
        stages["kernels"] = stages.get("kernels", 0) + len(compiled.kernels)
        stages["distinct"] = stages.get("distinct", 0) + len({id(k.built) for k in compiled.kernels})
        _inner(compiled, label)

    fusec.log.compile_times = record
else:
    import torch._inductor  # (imported by `import fusec` too: neither side pays it in the timing)
BUILD_MODEL


def first(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return first(out[0])


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


with torch.no_grad():
    want = first(model(*inputs)).float()
    sync()
    compiled = fusec.compile(model, backend=backend) if system == "fusec" else torch.compile(model)
    start = time.perf_counter()
    got = first(compiled(*inputs))
    sync()
    seconds = time.perf_counter() - start
err = ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
result = {"seconds": seconds, "rel_err": err}
if system == "fusec":
    result["stages"] = {k: v for k, v in stages.items() if k not in ("kernels", "distinct")}
    result["stages"]["run"] = seconds - sum(result["stages"].values())
    result["kernels"], result["distinct"] = stages.get("kernels", 0), stages.get("distinct", 0)
    result["compiles"] = fusec.cache.STATS["compiles"]
print(json.dumps(result))
'''


def run_child(system: str, name: str, device: str, dtype: str, backend: str, env: dict,
              timeout: int) -> dict:
    code = with_model(CHILD, name)
    proc = subprocess.run([sys.executable, "-c", code, system, name, device, dtype, backend],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(name: str, system: str, device: str, dtype: str, backend: str, timeout: int) -> dict:
    """Cold, then warm, over caches made empty for this model and system."""
    with tempfile.TemporaryDirectory(prefix=f"compile_time_{system}_") as root:
        env = dict(os.environ, FUSEC_CACHE_DIR=os.path.join(root, "fusec"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(root, "triton"))
        env.pop("FUSEC_LOG", None)
        if device == "cuda":
            env.pop("TRITON_INTERPRET", None)
        cold = run_child(system, name, device, dtype, backend, env, timeout)
        warm = run_child(system, name, device, dtype, backend, env, timeout) \
            if "error" not in cold else {"error": "cold run failed"}
    return {"model": name, "system": system, "cold": cold, "warm": warm}


def fmt(run: dict) -> str:
    return f"{run['seconds']:.2f}" if "seconds" in run else "fails"


def stage_text(run: dict) -> str:
    if "stages" not in run:
        return "-"
    return " ".join(f"{run['stages'].get(s, 0.0):.2f}" for s in STAGES)


def print_table(rows: list[dict], device: str, dtype: str) -> None:
    import torch
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"\n{where}, torch {torch.__version__}, {dtype}; seconds of the first call in a fresh "
          f"process (compile + first run); load average {os.getloadavg()[0]:.1f}")
    print("model | torch.compile cold | fusec cold | ratio | torch.compile warm | fusec warm | "
          "kernels (distinct) | fusec cold: " + " ".join(STAGES) + " | fusec warm: same | err")
    by = {(r["model"], r["system"]): r for r in rows}
    for name in dict.fromkeys(r["model"] for r in rows):
        f, t = by.get((name, "fusec")), by.get((name, "torch.compile"))
        ratio = "-"
        if f and t and "seconds" in f["cold"] and "seconds" in t["cold"]:
            ratio = f"{f['cold']['seconds'] / t['cold']['seconds']:.2f}"
        kernels = f"{f['cold'].get('kernels', '-')} ({f['cold'].get('distinct', '-')})" if f else "-"
        err = f"{f['cold']['rel_err']:.1e}" if f and "rel_err" in f["cold"] else "-"
        print(f"{name} | {fmt(t['cold']) if t else '-'} | {fmt(f['cold']) if f else '-'} | {ratio} | "
              f"{fmt(t['warm']) if t else '-'} | {fmt(f['warm']) if f else '-'} | {kernels} | "
              f"{stage_text(f['cold']) if f else '-'} | {stage_text(f['warm']) if f else '-'} | {err}")
    failures = [(r["model"], r["system"], r[k]["error"]) for r in rows for k in ("cold", "warm")
                if "error" in r[k]]
    for model, system, error in failures:
        print(f"  {model} {system}: {error}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help=f"comma-separated, or 'all' ({', '.join(MODELS)})")
    parser.add_argument("--systems", default="torch.compile,fusec")
    parser.add_argument("--device", default=None, help="cuda if there is a GPU, else cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--backend", default="auto", help="fusec's backend (auto|cpp|llvm|triton)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per process")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    names = (list(MODELS) if args.models == "all" else args.models.split(",") if args.models
             else GPU_DEFAULT if device == "cuda" else CPU_DEFAULT)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    rows = []
    for name in names:
        for system in args.systems.split(","):
            row = measure(name, system, device, dtype, args.backend, args.timeout)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows, device, dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "dtype": dtype, "load_average": os.getloadavg()[0],
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
