"""Run a folder of KernelBench-style problems through fusec.compile and check them against eager.

    python benchmarks/problem_set.py DIR [DIR ...] [--device cuda] [--dtype bfloat16] [--small]
                                     [--time] [--jobs N] [--only 12_,31_] [--json out.json]

A *problem file* is a plain Python module in the KernelBench style: a `Model(nn.Module)`, a
`get_init_inputs()` that returns Model's constructor arguments and a `get_inputs()` that returns
the forward's arguments, sized by module-level globals (`batch_size = 128`, ...). Nothing here
knows any problem: this is how fusec is checked on programs nobody on the project wrote (the
public KernelBench suite is one such folder; keep it out of the repository, e.g. in .external/).

For each problem: build the model under a fixed seed, run eager, run `fusec.compile(model)`
(default settings, the way a user would), and compare with KernelBench's own criterion
(`torch.allclose(fused, eager, atol=1e-2, rtol=1e-2)`), also reporting the relative error
‖fused − eager‖ / ‖eager‖. Where allclose fails (values that cancel to near zero defeat any fixed
tolerance), the problem also runs in float64, and fusec passes when its relative error against
that is at most twice eager's plus 1e-6: it computes no worse than eager. `--time` adds eager / torch.compile / fusec medians side by side; `--profile DIR` writes
fusec.profile's eager-vs-fused report of each problem to DIR.

`--dtype bfloat16` (or float16) converts the model and its floating-point inputs. Two programs
that round differently in bf16 drift apart in a deep model by more than any fixed tolerance, so
then both are compared with the same model run in float32: fusec passes when its relative error
is at most twice eager's plus 1e-3 (it rounds no worse than eager does).

`--small` makes a problem fit a small CPU: batch sizes become at most 2, and image, volume and
sequence sizes at most 32 / 16 / 64, unless eager then fails (a classifier head sized for 224²
images), in which case only the batch shrinks.

Problems run in `--jobs` worker processes (default 1 on CPU, 8 on CUDA), each importing fusec
once and taking problems one at a time, so a problem that kills its process (it must not, but
that is what this checks) is reported as `crashed` and the worker is replaced.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SPATIAL = {"height": 32, "width": 32, "image_size": 32, "H": 32, "W": 32, "img_size": 32,
           "depth": 16, "D": 16}
SEQUENCE = {"seq_len": 64, "sequence_length": 64, "seq_length": 64, "max_seqlen": 64}


def load_problem(path: Path, small: bool, shrink_spatial: bool = True):
    """Execute a problem file and return (module namespace, model, inputs)."""
    import torch
    namespace: dict = {"__name__": f"problem_{path.stem}", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    if small:
        if isinstance(namespace.get("batch_size"), int):
            namespace["batch_size"] = min(namespace["batch_size"], 2)
        if shrink_spatial:
            for table in (SPATIAL, SEQUENCE):
                for name, limit in table.items():
                    if isinstance(namespace.get(name), int):
                        namespace[name] = min(namespace[name], limit)
    torch.manual_seed(0)
    model = namespace["Model"](*namespace["get_init_inputs"]())
    torch.manual_seed(1)
    inputs = list(namespace["get_inputs"]())
    return model, inputs


def _to(obj, device):
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    return obj


def _tensors(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def compare(fused, eager) -> tuple[bool, float]:
    """KernelBench's criterion (allclose at 1e-2) on every output tensor, and the worst
    relative error."""
    import torch
    got, want = _tensors(fused), _tensors(eager)
    if len(got) != len(want):
        return False, math.inf
    ok, worst = True, 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return False, math.inf
        g64, w64 = g.detach().double().cpu(), w.detach().double().cpu()
        if not torch.allclose(g64, w64, atol=1e-2, rtol=1e-2, equal_nan=True):
            ok = False
        denom = w64.norm().item()
        err = (g64 - w64).norm().item() / denom if denom else (g64 - w64).norm().item()
        worst = max(worst, err if not math.isnan(err) else math.inf)
    return ok, worst


def _cast(obj, dtype):
    import torch
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return obj.to(dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


def run_one(path: Path, device: str, small: bool, timed: bool, dtype: str = "float32") -> dict:
    """Check (and optionally time) one problem; never raises."""
    import torch
    import fusec
    row = {"problem": f"{path.parent.name}/{path.stem}", "status": "error"}
    low = getattr(torch, dtype) if dtype != "float32" else None
    try:
        for shrink_spatial in (True, False):
            try:
                model, inputs = load_problem(path, small, shrink_spatial)
                model = model.to(device).eval()
                inputs = _to(inputs, device)
                with torch.no_grad():
                    reference = model(*inputs)
                    if low is not None:
                        model, inputs = model.to(low), _cast(inputs, low)
                    eager = model(*inputs)
                break
            except Exception:  # noqa: BLE001 - a shrunken size the model cannot take
                if not (small and shrink_spatial):
                    raise
        row["shapes"] = [list(t.shape) for t in _tensors(inputs)]
    except Exception as exc:  # noqa: BLE001
        row.update(status="eager fails", detail=f"{type(exc).__name__}: {exc}"[:300])
        return row
    try:
        start = time.perf_counter()
        cf = fusec.compile(model)
        with torch.no_grad():
            fused = cf(*inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        row["compile_s"] = round(time.perf_counter() - start, 2)
        row["kernels"] = len(cf.kernels)
        if low is None:
            ok, err = compare(fused, eager)
            if not ok:  # cancellation can defeat a fixed tolerance: ask float64 who is closer
                ok, row["eager_rel_err"], row["f64_rel_err"] = closer_than_eager(
                    model, inputs, fused, eager)
        else:
            err, eager_err = compare(fused, reference)[1], compare(eager, reference)[1]
            ok = err <= 2 * eager_err + 1e-3
            row["eager_rel_err"] = eager_err
        row.update(status="ok" if ok else "mismatch", rel_err=err)
        if timed and ok:
            row.update(time_all(model, cf, inputs, device))
        if PROFILE_DIR and ok:  # eager vs fused, op by op and kernel by kernel (fusec.profile)
            report = fusec.profile(model, *inputs)
            (PROFILE_DIR / f"{path.parent.name}_{path.stem}.txt").write_text(str(report))
    except Exception as exc:  # noqa: BLE001
        row.update(status="error", detail=f"{type(exc).__name__}: {exc}"[:500],
                   where=traceback.format_exc().strip().splitlines()[-3:])
    return row


def closer_than_eager(model, inputs, fused, eager) -> tuple[bool, float, float]:
    """Run the problem in float64 and compare both float32 results with it: fusec passes when
    its relative error is at most twice eager's plus 1e-6."""
    import copy
    import torch
    try:
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(*_cast(inputs, torch.float64))
    except Exception:  # noqa: BLE001 - a model that cannot run in float64
        return False, math.nan, math.nan
    fused_err, eager_err = compare(fused, ref)[1], compare(eager, ref)[1]
    return fused_err <= 2 * eager_err + 1e-6, eager_err, fused_err


def time_all(model, cf, inputs, device: str) -> dict:
    """Medians (ms) of eager, torch.compile (default mode) and fusec, side by side."""
    import torch
    from fusec.timing import median_ms
    out = {}
    with torch.no_grad():
        inductor = torch.compile(model)
        inductor(*inputs)
        for name, fn in (("eager_ms", model), ("inductor_ms", inductor), ("fusec_ms", cf)):
            out[name] = round(median_ms(lambda: fn(*inputs), device=device), 4)
    return out


PROFILE_DIR: Path | None = None


def worker(args) -> None:
    """Read problem paths from stdin, write one JSON line per problem to stdout."""
    global PROFILE_DIR
    PROFILE_DIR = args.profile
    for line in sys.stdin:
        path = Path(line.strip())
        print(json.dumps({"started": str(path)}), flush=True)
        row = run_one(path, args.device, args.small, args.time, args.dtype)
        print(json.dumps(row, default=str), flush=True)


def drive(paths: list[Path], args) -> list[dict]:
    """Share the problems among worker processes; a worker that dies is replaced and its
    problem reported as crashed."""
    import threading
    queue = list(paths)
    lock = threading.Lock()
    rows: list[dict] = []
    cmd = [sys.executable, __file__, "--worker", "--device", args.device, "--dtype", args.dtype]
    cmd += ["--small"] * args.small + ["--time"] * args.time
    cmd += ["--profile", str(args.profile)] if args.profile else []

    def run_worker():
        while True:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, bufsize=1)
            while True:
                with lock:
                    if not queue:
                        proc.stdin.close()
                        proc.wait()
                        return
                    path = queue.pop(0)
                proc.stdin.write(f"{path}\n")
                proc.stdin.flush()
                result = None
                for line in proc.stdout:
                    msg = json.loads(line)
                    if "started" not in msg:
                        result = msg
                        break
                if result is None:  # the process died while running this problem
                    proc.wait()
                    result = {"problem": f"{path.parent.name}/{path.stem}", "status": "crashed",
                              "detail": f"worker exited with {proc.returncode}"}
                with lock:
                    rows.append(result)
                    if args.json:  # rewritten after every problem: a run cut short keeps its rows
                        args.json.write_text(json.dumps(rows, indent=1, default=str))
                    print(f"[{len(rows)}/{len(paths)}] {result['problem']}: {result['status']}"
                          + (f" ({result.get('detail', '')[:120]})" if result["status"] != "ok" else ""),
                          flush=True)
                if result["status"] == "crashed":
                    break  # start a new worker

    threads = [threading.Thread(target=run_worker) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = {f"{p.parent.name}/{p.stem}": i for i, p in enumerate(paths)}
    return sorted(rows, key=lambda r: order.get(r["problem"], 0))


def summarize(rows: list[dict]) -> str:
    from collections import Counter
    counts = Counter(r["status"] for r in rows)
    lines = [f"{len(rows)} problems: " + ", ".join(f"{n} {s}" for s, n in counts.most_common())]
    timed = [r for r in rows if "fusec_ms" in r]
    if timed:
        def geo(key):
            return math.exp(sum(math.log(r[key] / r["fusec_ms"]) for r in timed) / len(timed))
        lines.append(f"geomean speed-up of fusec over {len(timed)} timed problems: "
                     f"{geo('eager_ms'):.2f}x eager, {geo('inductor_ms'):.2f}x torch.compile; "
                     f"slower than eager: {sum(r['fusec_ms'] > r['eager_ms'] for r in timed)}")
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"  {r['problem']}: {r['status']}: {r.get('detail', '')[:200]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="*", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--jobs", type=int, default=0)
    parser.add_argument("--only", default="")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="write fusec.profile's report per problem here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.worker:
        return worker(args)
    args.jobs = args.jobs or (8 if args.device == "cuda" else 1)
    paths = sorted((p for d in args.dirs for p in d.glob("*.py")),
                   key=lambda p: (p.parent.name, int(p.stem.split("_")[0]) if p.stem.split("_")[0].isdigit() else 0))
    if args.only:
        paths = [p for p in paths if any(p.stem.startswith(o) or f"{p.parent.name}/{p.stem}".startswith(o)
                                         for o in args.only.split(","))]
    rows = drive(paths, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    print(summarize(rows))


if __name__ == "__main__":
    main()
