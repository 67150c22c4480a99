"""What loading cached Triton kernels costs on a warm start, piece by piece.

    python benchmarks/diagnostics/triton_warm_load.py resnet50,bert_base [cold,threads,...]

Variant "count" (first, in a cold cache) counts Triton's binaries on disk after the kernels were
compiled ahead and after the first run: more after the run means a kernel compiled twice.

Compiles the model once (cold, filling the caches), then, in fresh processes over the same
caches, times: Triton's one-off keys (`triton_key()`, the hash of Triton's own sources, and the
CUDA backend's hash, which runs `ptxas --version`), then the warm first call with fusec's stage
split, with the kernels' JIT lookups done ahead in threads (as fusec does) or at first launch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_time import with_model  # noqa: E402

CHILD = r'''
import json, sys, time
name, variant = sys.argv[1:3]
import torch
import fusec, fusec.log
import fusec.runtime.build as build
times = {}


def record(compiled, label="program", _inner=fusec.log.compile_times):
    for stage, seconds in compiled.times.items():
        times[stage] = times.get(stage, 0.0) + seconds


fusec.log.compile_times = record
device, dtype = "cuda", "bfloat16"
BUILD_MODEL
with torch.no_grad():
    model(*inputs)
    torch.cuda.synchronize()
    keys = {}
    if variant == "keys":
        from triton.runtime.cache import triton_key
        from triton.runtime.driver import driver
        from triton.compiler.compiler import make_backend
        start = time.perf_counter()
        triton_key()
        keys["triton_key"] = time.perf_counter() - start
        start = time.perf_counter()
        make_backend(driver.active.get_current_target()).hash()
        keys["backend_hash"] = time.perf_counter() - start
    if variant == "at_launch":
        build.jobs = lambda: 1
    counts = {}
    if variant == "count":  # Triton binaries on disk after compile_ahead, and after the run
        import glob, os
        def binaries():
            return len(glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.cubin")))
        ahead = build._compile_ahead

        def counted(todo, device):
            ahead(todo, device)
            counts["after_compile_ahead"] = binaries()
            counts["distinct"] = len(todo)
        build._compile_ahead = counted
    compiled = fusec.compile(model)
    start = time.perf_counter()
    compiled(*inputs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
if variant == "count":
    counts["after_first_run"] = binaries()
print(json.dumps({"variant": variant, "seconds": round(seconds, 3), "keys": keys, "counts": counts,
                  "stages": {k: round(v, 3) for k, v in times.items()}}))
'''


def main() -> None:
    for name in sys.argv[1].split(","):
        code = with_model(CHILD, name)
        with tempfile.TemporaryDirectory(prefix="triton_warm_") as root:
            env = dict(os.environ, FUSEC_CACHE_DIR=os.path.join(root, "fusec"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"))
            env.pop("TRITON_INTERPRET", None)
            variants = sys.argv[2].split(",") if len(sys.argv) > 2 else \
                ["cold", "threads", "keys", "at_launch", "threads"]
            for variant in variants:
                proc = subprocess.run([sys.executable, "-c", code, name, variant],
                                      capture_output=True, text=True, env=env)
                out = proc.stdout.strip().splitlines()
                print(name, out[-1] if proc.returncode == 0 and out else proc.stderr[-2000:])


if __name__ == "__main__":
    main()
