"""What a warm start's Triton work costs, step by step, with threads or without.

    python benchmarks/diagnostics/warm_phases.py mobilenet_v3 [resnet50 ...]

cProfile sees only the thread that enabled it, and fusec makes kernels ready in worker threads
(fusec/runtime/build.py, `_compile_ahead`). This wraps Triton's steps in wall-clock timers summed
over all threads instead: `triton.compile` (a cache hit reads the compiled files),
`CompiledKernel.__init__`, `_init_handles` (launcher and binary), `compile_module_from_src`
(the launcher's C module), `JITFunction.parse` and `cache_key`, `warmup`, and fusec's
`launcher` (import) and `_bytecode`. A sum larger than the stage's wall-clock means threads
waited on each other.

Each model is compiled cold (filling fresh caches), then warm with FUSEC_COMPILE_JOBS unset,
=1 (no compiling ahead: the first launch does the work) and =4, then unset again. The models are
benchmarks/compile_time.py's, in bf16 on CUDA.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compile_time import with_model  # noqa: E402

CHILD = r'''
import functools, json, sys, threading, time
device, dtype = "cuda", "bfloat16"
import torch
import fusec, fusec.log
import fusec.codegen.triton as fusec_triton
import triton.compiler
import triton.compiler.compiler as triton_compiler
import triton.runtime.build as triton_build
import triton.runtime.jit as jit
sums, lock = {}, threading.Lock()


def timed(label, fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with lock:
                sums[label] = sums.get(label, 0.0) + time.perf_counter() - start
    return inner


# (the JIT binds `triton.compiler.compile` when it first builds a binder: patch both names)
triton.compiler.compile = triton_compiler.compile = timed("triton.compile", triton_compiler.compile)
triton_compiler.CompiledKernel.__init__ = timed("CompiledKernel.__init__",
                                                triton_compiler.CompiledKernel.__init__)
triton_compiler.CompiledKernel._init_handles = timed("_init_handles",
                                                     triton_compiler.CompiledKernel._init_handles)
try:
    import triton.backends.nvidia.driver as nvidia_driver
    nvidia_driver.compile_module_from_src = timed("compile_module_from_src",
                                                  nvidia_driver.compile_module_from_src)
except (ImportError, AttributeError):
    pass
fusec_triton._bytecode = timed("_bytecode", fusec_triton._bytecode)
fusec_triton.launcher = timed("launcher (import)", fusec_triton.launcher)
jit.JITFunction.warmup = timed("warmup", jit.JITFunction.warmup)
jit.JITFunction.parse = timed("parse", jit.JITFunction.parse)
if isinstance(jit.JITFunction.__dict__.get("cache_key"), property):
    jit.JITFunction.cache_key = property(timed("cache_key", jit.JITFunction.cache_key.fget))
stages = {}


def record(compiled, label="program", _inner=fusec.log.compile_times):
    for stage, seconds in compiled.times.items():
        stages[stage] = stages.get(stage, 0.0) + seconds


fusec.log.compile_times = record
BUILD_MODEL
with torch.no_grad():
    model(*inputs)
    torch.cuda.synchronize()
    compiled = fusec.compile(model)
    start = time.perf_counter()
    compiled(*inputs)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
print(json.dumps({"total": round(total, 3), "stages": {k: round(v, 3) for k, v in stages.items()},
                  "summed over threads": {k: round(v, 3) for k, v in sums.items()}}))
'''


def main() -> None:
    for name in sys.argv[1:] or ["mobilenet_v3"]:
        code = with_model(CHILD, name)
        with tempfile.TemporaryDirectory(prefix="warm_phases_") as root:
            env = dict(os.environ, FUSEC_CACHE_DIR=os.path.join(root, "fusec"),
                       TRITON_CACHE_DIR=os.path.join(root, "triton"))
            env.pop("TRITON_INTERPRET", None)
            env.pop("FUSEC_COMPILE_JOBS", None)
            for run, jobs in (("cold", None), ("warm", None), ("warm", "1"), ("warm", "4"),
                              ("warm", None)):
                run_env = dict(env, FUSEC_COMPILE_JOBS=jobs) if jobs else env
                proc = subprocess.run([sys.executable, "-c", code], env=run_env,
                                      capture_output=True, text=True)
                result = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 \
                    else proc.stderr[-1500:]
                print(f"{name} {run} FUSEC_COMPILE_JOBS={jobs or 'unset'}: {result}", flush=True)


if __name__ == "__main__":
    main()
