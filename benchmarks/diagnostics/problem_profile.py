"""One KernelBench-style problem, kernel by kernel: eager, torch.compile and fusec on a GPU.

    python benchmarks/diagnostics/problem_profile.py 7 35 hf_gpt2 ... [--dtype float32] [--iters 20] [--top 8]
        [--sources DIR]

benchmarks/kernelbench.py says which problems are slow; this says where their time goes. Each
problem (benchmarks/problems/<N>_*.py at its "gpu" scale) runs `--iters` times per system under
torch.profiler; the script prints the do_bench median, the GPU time per call and the kernels that
take most of it (name, count per call, time per call).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import fusec
from fusec.timing import median_ms

sys_path = Path(__file__).resolve().parents[1]


def load(number: str):
    """(name, build(scale) -> (model, inputs)): a problem by its number, or a real model by its
    row name in benchmarks/kernelbench.py (hf_gpt2, tv_resnet50, ...)."""
    import importlib.util
    import sys
    sys.path.insert(0, str(sys_path))
    import kernelbench
    models = {**kernelbench.MODELS, **kernelbench.MORE_MODELS}
    if number in models:
        return number, models[number]
    (path,) = sorted((sys_path / "problems").glob(f"{number}_*.py"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return path.stem, lambda scale: (mod.get_model(scale), mod.get_inputs(scale))


def kernels(fn, inputs, iters: int):
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(*inputs)
            torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters / 1e3, e.count / iters)
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("problems", nargs="+")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--sources", type=Path,
                   help="write fusec's kernel sources and its explain report under this folder")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    for number in args.problems:
        name, build = load(number)
        torch.manual_seed(0)
        model, inputs = build("gpu")
        model = model.to("cuda", dtype).eval()
        inputs = [t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda") for t in inputs]
        print(f"\n##### {name} ({args.dtype})")
        for system, fn in [("eager", model), ("torch.compile", torch.compile(model)),
                           ("fusec", fusec.compile(model))]:
            with torch.no_grad():
                fn(*inputs)
                ms = median_ms(fn, *inputs, device="cuda")
            rows = kernels(fn, inputs, args.iters)
            print(f"== {system}: {ms:.3f} ms per call (do_bench), GPU {sum(r[1] for r in rows):.3f} ms")
            for key, t, count in rows[:args.top]:
                print(f"   {t:7.4f} ms  x{count:<4.1f} {key[:110]}")
            if system == "fusec" and args.sources:
                folder = args.sources / name
                folder.mkdir(parents=True, exist_ok=True)
                for k in fn.kernels:
                    (folder / f"{k.name}.py").write_text(k.source)
                with torch.no_grad():
                    (folder / "explain.txt").write_text(str(fusec.explain(model, *inputs)))
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
