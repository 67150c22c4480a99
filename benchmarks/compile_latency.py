"""Compile latency with a warm cache: a new process runs `fusec.compile(sin4)(x)` on 1000 CPU
floats after an earlier process built the kernel. Prints import time and the call's time.

    python benchmarks/compile_latency.py
"""
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch, fusec
t1 = time.perf_counter()
# torch's tracing machinery: the first fusec call of a process imports it (a warm start's
# fingerprint makes fake tensors), not `import fusec` (issue 52); timed apart from the call
import torch._dynamo, torch._inductor
t1b = time.perf_counter()
x = torch.randn(1000)
def sin4(x):
    return torch.sin(torch.sin(torch.sin(torch.sin(x))))
t2 = time.perf_counter()
fusec.compile(sin4, backend="cpp")(x)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "tracing_import_s": t1b - t1,
                  "compile_and_call_s": t3 - t2,
                  "compiles": fusec.cache.STATS["compiles"]}))
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FUSEC_CACHE_DIR=cache)
        runs = []
        for _ in range(4):
            out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                                 text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs[0], runs[1:]
    print(f"cold cache: compile + call {cold['compile_and_call_s']:.3f} s "
          f"({cold['compiles']} kernel compiled)")
    for r in warm:
        print(f"warm cache: import fusec {r['import_s']:.2f} s, torch's tracing machinery (once "
              f"per process, by its first call) {r['tracing_import_s']:.2f} s, compile + call "
              f"{r['compile_and_call_s']:.3f} s, {r['compiles']} kernels compiled")
    best = min(r["compile_and_call_s"] for r in warm)
    print(f"best warm compile + call: {best:.3f} s (target < 0.2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
