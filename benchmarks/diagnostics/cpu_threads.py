"""How `fusec demo`'s CPU kernels scale with threads next to eager, and which OpenMP runtimes
the process holds (a second libgomp would mean two pools of spinning threads).

    python benchmarks/diagnostics/cpu_threads.py --threads 1,4,16

Each thread count runs in a fresh process with OMP_NUM_THREADS set (every OpenMP runtime in the
process reads it). Times are torch.utils.benchmark medians, eager and each CPU backend taking
turns on the same inputs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import importlib, os, sys, torch
import torch.utils.benchmark as tb
import fusec
sys.path.insert(0, sys.argv[1])
names, backends = sys.argv[2].split(","), sys.argv[3].split(",")
threads = torch.get_num_threads()
rows = []
for name in names:
    ex = importlib.import_module(f"examples.{name}").example()
    fns = {"eager": ex.fn}
    for b in backends:
        from fusec.codegen import cpp
        wide = cpp.vector_flags
        if b == "cpp256":  # the C++ backend without cpp.vector_flags (gcc's own vector width)
            cpp.vector_flags = lambda: []
        fns[b] = fusec.compile(ex.fn, backend=b.replace("256", ""))
        fns[b](*ex.inputs)
        cpp.vector_flags = wide
    times = {}
    for _ in range(3):  # taking turns
        for label, fn in fns.items():
            t = tb.Timer("f(*a)", globals=dict(f=fn, a=ex.inputs), num_threads=threads)
            times.setdefault(label, []).append(t.blocked_autorange(min_run_time=0.3).median * 1e3)
    rows.append((name, {k: sorted(v)[1] for k, v in times.items()}))
maps = open(f"/proc/{os.getpid()}/maps").read()
gomps = sorted({l.split()[-1] for l in maps.splitlines() if "gomp" in l or "libomp" in l or "iomp" in l})
print(f"threads {threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); OpenMP runtimes loaded: {gomps}")
for name, t in rows:
    print(f"  {name:12}" + "".join(f"  {k} {v:.3f} ms" + (f" ({t['eager'] / v:.2f}x)" if k != "eager" else "")
                                  for k, v in t.items()))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--examples", default="sin4,add_mul,maximum_neg_uint8,strided")
    parser.add_argument("--backends", default="cpp,cpp256,llvm",
                        help="cpp256: the C++ backend at gcc's default vector width")
    args = parser.parse_args()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[-1]
          .splitlines()[0].strip() if sys.platform == "linux" else "")
    for n in args.threads.split(","):
        env = dict(os.environ, OMP_NUM_THREADS=n)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), args.examples, args.backends],
                              capture_output=True, text=True, env=env)
        print(proc.stdout if proc.returncode == 0 else proc.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
