"""Where a warm start's time goes: a model compiled cold (filling the caches), then again in a
fresh process under cProfile, which prints the functions that took the time.

    python benchmarks/diagnostics/warm_profile.py bert_base resnet50 --out /tmp/warm

The models are benchmarks/compile_time.py's. Each prints fusec's stage split of the warm first
call, then the top of cProfile's table by cumulative and by own time; the raw profile is saved
as `<out>/<model>.prof` for `python -m pstats`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_time import with_model  # noqa: E402

CHILD = r'''
import cProfile, json, pstats, sys, time
name, device, dtype, prof_path = sys.argv[1:5]
import torch
import fusec, fusec.log
times = {}


def record(compiled, label="program", _inner=fusec.log.compile_times):
    for stage, seconds in compiled.times.items():
        times[stage] = times.get(stage, 0.0) + seconds
    _inner(compiled, label)


fusec.log.compile_times = record
BUILD_MODEL
with torch.no_grad():
    model(*inputs)
    torch.cuda.synchronize() if device == "cuda" else None
    compiled = fusec.compile(model)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    compiled(*inputs)
    torch.cuda.synchronize() if device == "cuda" else None
    profiler.disable()
    seconds = time.perf_counter() - start
print(json.dumps({"seconds": round(seconds, 3), "stages": {k: round(v, 3) for k, v in times.items()}}))
if prof_path != "-":
    profiler.dump_stats(prof_path)
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(40)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in args.models:
        code = with_model(CHILD, name)
        with tempfile.TemporaryDirectory(prefix="warm_profile_") as root:
            env = dict(os.environ, FUSEC_CACHE_DIR=os.path.join(root, "fusec"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"))
            env.pop("TRITON_INTERPRET", None) if device == "cuda" else None
            for run, prof in (("cold", "-"), ("warm", os.path.join(args.out, f"{name}.prof"))):
                proc = subprocess.run([sys.executable, "-c", code, name, device, dtype, prof],
                                      capture_output=True, text=True, env=env)
                print(f"===== {name} {run} =====")
                print(proc.stdout if proc.returncode == 0 else proc.stderr[-3000:])


if __name__ == "__main__":
    main()
