"""A KernelBench-style suite: eager vs torch.compile vs fusec, side by side in one process.

    python benchmarks/kernelbench.py                      # CPU scale, float32, problems + models
    python benchmarks/kernelbench.py --scale gpu --device cuda --dtype bfloat16
    python benchmarks/kernelbench.py --only 2_,31_ --skip-models --json out.json
    python benchmarks/kernelbench.py --threads 1 --markdown table.md   # the run in docs/benchmarks.md

Two kinds of rows:

* **problems** (benchmarks/problems/*.py, written for fusec in the KernelBench level-2 style):
  each file has a small `Model` (a convolution, transposed convolution or GEMM followed by
  pointwise ops, norms, pooling, reductions), `get_model(scale)` and `get_inputs(scale)`;
* **real models** (MODELS below): transformers GPT-2, Llama, BERT, ViT and a T5 encoder, from
  small configs at the "cpu" scale and their real configs at the "gpu" scale, plus torchvision's
  resnet50, vit_b_16, convnext_tiny, mobilenet_v3_large and efficientnet_b0 where torchvision
  imports (rows say "skipped" otherwise). Weights are random; nothing is downloaded.

For every row, under a fixed seed, in eval mode and `torch.no_grad()`: run eager, torch.compile
(default settings: Inductor) and `fusec.compile` (default settings: what a user gets), check both
compilers against eager, then time the three. Correctness is KernelBench's criterion
(`allclose(atol=1e-2, rtol=1e-2)`) plus the relative error ‖out − eager‖ / ‖eager‖, in float32; in
bfloat16 a compiler passes when its error against the float32 model is at most twice eager's plus
1e-3 (benchmarks/problem_set.py explains why). Timing takes turns: `--rounds` rounds, each timing
eager, torch.compile and fusec once (fusec.timing.median_ms: do_bench on CUDA, a perf_counter
median on the CPU), and reports the median over rounds — on a shared machine a noisy spell then
lands on all three, not on one.

The table (rich) shows milliseconds, fusec's speed against eager and against torch.compile, and
the summary gives geomeans over rows where all three ran and matched, and every row slower than
eager. `--json` writes every row. The "cpu" scale is sized so the whole run takes minutes on two
cores; docs/benchmarks.md records a run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROBLEMS = HERE / "problems"
sys.path.insert(0, str(HERE))
from problem_set import _cast, _tensors, _to, compare  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- rows -----------------------------------------------------------------------------------------

def load_problem_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"kernelbench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def problem_rows():
    """(name, builder) for every problem file, in numeric order."""
    paths = sorted(PROBLEMS.glob("*.py"), key=lambda p: int(p.stem.split("_")[0]))
    for path in paths:
        def build(scale, path=path):
            module = load_problem_file(path)
            torch.manual_seed(0)
            model = module.get_model(scale)
            torch.manual_seed(1)
            return model, list(module.get_inputs(scale))
        yield path.stem, build


def _transformers_model(kind: str, scale: str):
    """A transformers model from a config (small at the "cpu" scale, the real one at "gpu") and
    its token inputs."""
    import transformers as tf
    small = scale == "cpu"
    batch, seq = (2, 64) if small else (8, 512)
    tiny = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)
    if kind == "gpt2":
        # small: an 8192-token vocabulary, so the row measures the blocks and not one huge
        # language-model-head matmul (which eager, torch.compile and fusec all run the same way)
        config = tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=8192,
                                                bos_token_id=0, eos_token_id=0) if small else tf.GPT2Config()
        model, vocab = tf.GPT2LMHeadModel(config), config.vocab_size
    elif kind == "llama":
        config = (tf.LlamaConfig(vocab_size=8192, num_key_value_heads=2, **tiny) if small else
                  tf.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                 num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8))
        model, vocab = tf.LlamaForCausalLM(config), config.vocab_size
    elif kind == "bert":
        config = tf.BertConfig(**tiny) if small else tf.BertConfig()
        model, vocab = tf.BertModel(config), config.vocab_size
    elif kind == "t5_encoder":
        config = (tf.T5Config(d_model=128, d_kv=32, d_ff=512, num_layers=2, num_heads=4) if small
                  else tf.T5Config())
        model, vocab = tf.T5EncoderModel(config), config.vocab_size
    elif kind == "vit":
        config = (tf.ViTConfig(image_size=64, patch_size=16, **tiny) if small else tf.ViTConfig())
        model = tf.ViTModel(config)
        return model, [torch.randn(batch, 3, config.image_size, config.image_size)]
    else:
        raise ValueError(kind)
    return model, [torch.randint(0, vocab, (batch, seq))]


def _torchvision_model(name: str, scale: str):
    import torchvision  # noqa: F401 - raises where it does not import
    from torchvision import models
    model = getattr(models, name)()
    size = 224
    batch = 1 if scale == "cpu" else 32
    return model, [torch.randn(batch, 3, size, size)]


MODELS = {
    **{f"hf_{k}": (lambda scale, k=k: _transformers_model(k, scale))
       for k in ("gpt2", "llama", "bert", "vit", "t5_encoder")},
    **{f"tv_{k}": (lambda scale, k=k: _torchvision_model(k, scale))
       for k in ("resnet50", "vit_b_16", "convnext_tiny", "mobilenet_v3_large", "efficientnet_b0")},
}
# `--more-models`: other torchvision architectures, each with ops the five above lack (dense
# concatenation, grouped convolutions, channel shuffle, squeeze-excite, shifted windows)
MORE_MODELS = {f"tv_{k}": (lambda scale, k=k: _torchvision_model(k, scale))
               for k in ("densenet121", "resnext50_32x4d", "shufflenet_v2_x1_0", "regnet_y_1_6gf",
                         "efficientnet_v2_s", "squeezenet1_1", "mnasnet1_0", "swin_t")}


# ---- one row ------------------------------------------------------------------------------------

def check(out, eager, reference, low: bool) -> tuple[bool, float]:
    """(passes, relative error against eager) — see the module docstring for the criterion."""
    ok, err = compare(out, eager)
    if low:
        err_ref, eager_err = compare(out, reference)[1], compare(eager, reference)[1]
        ok = err_ref <= 2 * eager_err + 1e-3
    return ok, err


def time_side_by_side(fns: dict, device: str, rounds: int, budget_s: float) -> dict[str, float]:
    """Median ms of each callable; the callables take turns, one timing each per round."""
    from fusec.timing import median_ms
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, device=device, budget_s=budget_s))
    return {name: statistics.median(ts) for name, ts in times.items()}


def dynamic_batch(compiled, inputs):
    """`compiled`, first called with dim 0 of every input marked dynamic
    (`torch._dynamo.mark_dynamic`): its program is one for every batch size (fusec/dynamic.py),
    and calls at the benchmark's shape run that program."""
    marked = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] >= 2:
            t = t.clone()
            torch._dynamo.mark_dynamic(t, 0)
        marked.append(t)
    with torch.no_grad():
        compiled(*marked)
    return compiled


def run_row(name: str, build, args) -> dict:
    """Build, check and time one problem or model; never raises."""
    import fusec
    row: dict = {"name": name, "status": "error"}
    low = args.dtype != "float32"
    try:
        model, inputs = build(args.scale)
        model = model.to(args.device).eval()
        inputs = _to(inputs, args.device)
        with torch.no_grad():
            reference = model(*inputs)
            if low:
                model, inputs = model.to(getattr(torch, args.dtype)), _cast(inputs, getattr(torch, args.dtype))
            eager = model(*inputs)
        row["shapes"] = [list(t.shape) for t in _tensors(inputs)]
    except ImportError as exc:
        return {**row, "status": "skipped", "detail": f"{type(exc).__name__}: {exc}"[:200]}
    except Exception as exc:  # noqa: BLE001
        return {**row, "status": "eager fails", "detail": f"{type(exc).__name__}: {exc}"[:300]}

    fns = {"eager": lambda: model(*inputs)}
    compilers = {"inductor": lambda: torch.compile(model),
                 "fusec": lambda: fusec.compile(model, backend=args.backend)}
    for other in getattr(args, "also_backends", ()):  # more fusec columns, timed in the same turns
        compilers[f"fusec_{other}"] = lambda other=other: fusec.compile(model, backend=other)
    if getattr(args, "dynamic", False):  # the same, compiled for every batch size (dim 0 a symbol)
        compilers["fusec_dynamic"] = lambda: dynamic_batch(fusec.compile(model, backend=args.backend),
                                                           inputs)
    for key, make in compilers.items():
        try:
            start = time.perf_counter()
            compiled = make()
            with torch.no_grad():
                out = compiled(*inputs)
            if args.device == "cuda":
                torch.cuda.synchronize()
            row[f"{key}_compile_s"] = round(time.perf_counter() - start, 2)
            ok, err = check(out, eager, reference, low)
            row[f"{key}_rel_err"] = err
            row[f"{key}_ok"] = ok
            if ok:
                fns[key] = (lambda c=compiled: c(*inputs))
            if key.startswith("fusec"):
                row["kernels" + key[len("fusec"):]] = len(compiled.kernels)
            if key == "fusec_dynamic":  # did it compile for every batch size, and if not, why
                inner = getattr(compiled, "_compiled", compiled)
                row["dynamic_families"] = len(inner.families)
                row["dynamic_notes"] = inner.recompiles[-2:]
        except Exception as exc:  # noqa: BLE001
            row[f"{key}_ok"] = False
            row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            row.setdefault("where", traceback.format_exc().strip().splitlines()[-3:])
    row["status"] = "ok" if row.get("fusec_ok") else ("error" if "fusec_error" in row else "mismatch")
    if not args.no_time:
        with torch.no_grad():
            for key, ms in time_side_by_side(fns, args.device, args.rounds, args.budget).items():
                row[f"{key}_ms"] = ms
    return row


# ---- report -------------------------------------------------------------------------------------

def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary(rows: list[dict], key: str = "fusec", also: bool = True) -> dict:
    """Geomeans of fusec's speed-up over rows where all three were timed, and the rows slower
    than eager (at all, and by more than 10%). `key`: which fusec column ("fusec_llvm" for
    `--also-backends llvm`); each other backend's summary is under "also"."""
    others = sorted({k[:-3] for r in rows for k in r
                     if k.startswith("fusec_") and k.endswith("_ms") and k != "fusec_ms"})
    if also and others:
        return {**summary(rows, key, False), "also": {o[len("fusec_"):]: summary(rows, o, False)
                                                      for o in others}}
    rows = [{**r, "fusec_ms": r[f"{key}_ms"]} if f"{key}_ms" in r else
            {k: v for k, v in r.items() if k != "fusec_ms"} for r in rows]
    timed = [r for r in rows if all(f"{k}_ms" in r for k in ("eager", "inductor", "fusec"))]
    return {
        "rows": len(rows),
        "fusec_correct": sum(bool(r.get("fusec_ok")) for r in rows),
        "timed": len(timed),
        "geomean_vs_eager": geomean([r["eager_ms"] / r["fusec_ms"] for r in timed]),
        "geomean_vs_inductor": geomean([r["inductor_ms"] / r["fusec_ms"] for r in timed]),
        "inductor_geomean_vs_eager": geomean([r["eager_ms"] / r["inductor_ms"] for r in timed]),
        "slower_than_eager": [r["name"] for r in rows
                              if "fusec_ms" in r and "eager_ms" in r and r["fusec_ms"] > r["eager_ms"]],
        "slower_than_1.1x_eager": [r["name"] for r in rows if "fusec_ms" in r and "eager_ms" in r
                                   and r["fusec_ms"] > 1.1 * r["eager_ms"]],
        "not_ok": {r["name"]: r["status"] for r in rows if r["status"] != "ok"},
        "slower_than_inductor": [r["name"] for r in timed if r["fusec_ms"] > r["inductor_ms"]],
    }


def _also_lines(stats: dict) -> list[str]:
    """One sentence per `--also-backends` backend (its geomeans and slow rows)."""
    return [f"fusec {b}: geomean {s['geomean_vs_eager']:.2f}x eager and "
            f"{s['geomean_vs_inductor']:.2f}x torch.compile over {s['timed']} timed rows. Slower "
            f"than eager: {', '.join(s['slower_than_eager']) or 'none'}; by more than 10%: "
            f"{', '.join(s['slower_than_1.1x_eager']) or 'none'}."
            for b, s in stats.get("also", {}).items()]


def print_table(rows: list[dict], stats: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for col in ("row", "kernels", "fusec err", "eager ms", "compile ms", "fusec ms",
                "vs eager", "vs compile"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in rows:
        def ms(key):
            return f"{r[key]:.3f}" if key in r else "—"
        ratio = (lambda a: f"{r[a] / r['fusec_ms']:.2f}x" if a in r and "fusec_ms" in r else "—")
        status = "" if r["status"] == "ok" else f" [{r['status']}]"
        err = r.get("fusec_rel_err")
        table.add_row(r["name"] + status, str(r.get("kernels", "—")),
                      f"{err:.1e}" if isinstance(err, float) else "—",
                      ms("eager_ms"), ms("inductor_ms"), ms("fusec_ms"),
                      ratio("eager_ms"), ratio("inductor_ms"))
    console = Console(width=120)
    console.print(table)
    console.print(
        f"{stats['fusec_correct']}/{stats['rows']} rows match eager; over {stats['timed']} timed rows "
        f"fusec's geomean speed is {stats['geomean_vs_eager']:.2f}x eager and "
        f"{stats['geomean_vs_inductor']:.2f}x torch.compile (torch.compile: "
        f"{stats['inductor_geomean_vs_eager']:.2f}x eager). Slower than eager: "
        f"{', '.join(stats['slower_than_eager']) or 'none'}; by more than 10%: "
        f"{', '.join(stats['slower_than_1.1x_eager']) or 'none'}.")
    for line in _also_lines(stats):
        console.print(line)
    for name, status in stats["not_ok"].items():
        detail = next(r for r in rows if r["name"] == name)
        console.print(f"  {name}: {status}: "
                      f"{detail.get('fusec_error') or detail.get('detail') or ''}"[:300])


def markdown(rows: list[dict], stats: dict, meta: dict) -> str:
    """The table and summary as Markdown (for docs/benchmarks.md)."""
    def ms(r, key):
        return f"{r[key]:.3f}" if key in r else "—"

    def ratio(r, key, of="fusec"):
        return f"{r[key] / r[f'{of}_ms']:.2f}x" if key in r and f"{of}_ms" in r else "—"
    also = list(stats.get("also", {}))
    head = "".join(f" fusec {b} ms | {b} vs eager | {b} vs torch.compile |" for b in also)
    lines = [f"{meta['device_name']}, {meta['threads']} thread(s), torch {meta['torch']}, "
             f"{meta['scale']} scale, {meta['dtype']}, whole run {meta['wall_s']} s.", "",
             "| row | kernels | fusec rel. err | eager ms | torch.compile ms | fusec ms | fusec vs eager | fusec vs torch.compile |" + head,
             "|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(also)]
    for r in rows:
        err = r.get("fusec_rel_err")
        name = r["name"] + ("" if r["status"] == "ok" else f" ({r['status']})")
        lines.append(f"| {name} | {r.get('kernels', '—')} | "
                     f"{f'{err:.1e}' if isinstance(err, float) else '—'} | {ms(r, 'eager_ms')} | "
                     f"{ms(r, 'inductor_ms')} | {ms(r, 'fusec_ms')} | {ratio(r, 'eager_ms')} | "
                     f"{ratio(r, 'inductor_ms')} |"
                     + "".join(f" {ms(r, f'fusec_{b}_ms')} | {ratio(r, 'eager_ms', f'fusec_{b}')} | "
                               f"{ratio(r, 'inductor_ms', f'fusec_{b}')} |" for b in also))
    lines += ["", f"{stats['fusec_correct']}/{stats['rows']} rows match eager. Geomean over "
                  f"{stats['timed']} timed rows: fusec {stats['geomean_vs_eager']:.2f}x eager, "
                  f"{stats['geomean_vs_inductor']:.2f}x torch.compile (torch.compile "
                  f"{stats['inductor_geomean_vs_eager']:.2f}x eager). Slower than eager: "
                  f"{', '.join(stats['slower_than_eager']) or 'none'}; by more than 10%: "
                  f"{', '.join(stats['slower_than_1.1x_eager']) or 'none'}."]
    lines += ["", *_also_lines(stats)] if also else []
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=["cpu", "gpu"], default=None,
                        help="problem sizes (default: gpu on a CUDA device, else cpu)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="auto", help="fusec backend (auto, cpp, llvm, triton)")
    parser.add_argument("--also-backends", default="", type=lambda s: [b for b in s.split(",") if b],
                        help="more fusec backends as columns, timed in the same turns (llvm)")
    parser.add_argument("--only", default="", help="comma-separated name prefixes")
    parser.add_argument("--dynamic", action="store_true",
                        help="also time fusec compiled for every batch size (dim 0 a symbol)")
    parser.add_argument("--skip-models", action="store_true")
    parser.add_argument("--skip-problems", action="store_true")
    parser.add_argument("--more-models", action="store_true",
                        help="also torchvision's densenet121, resnext50_32x4d, shufflenet_v2, "
                        "regnet_y_1_6gf, efficientnet_v2_s, squeezenet1_1, mnasnet1_0, swin_t")
    parser.add_argument("--no-time", action="store_true", help="check only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timing per round")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for all three (torch.set_num_threads and OpenMP); 0: torch's default")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # fusec's kernels' libgomp reads it on load
    args.scale = args.scale or ("gpu" if args.device == "cuda" else "cpu")

    rows_to_run = [] if args.skip_problems else list(problem_rows())
    rows_to_run += [] if args.skip_models else list(MODELS.items())
    rows_to_run += list(MORE_MODELS.items()) if args.more_models else []
    if args.only:
        rows_to_run = [(n, b) for n, b in rows_to_run if any(n.startswith(o) for o in args.only.split(","))]
    start = time.perf_counter()
    rows = []
    for i, (name, build) in enumerate(rows_to_run, 1):
        row = run_row(name, build, args)
        rows.append(row)
        note = "" if row["status"] == "ok" else f" ({row.get('fusec_error') or row.get('detail', '')})"[:150]
        speed = (f" eager {row['eager_ms']:.3f} compile {row.get('inductor_ms', math.nan):.3f} "
                 f"fusec {row['fusec_ms']:.3f} ms" if "fusec_ms" in row else "")
        print(f"[{i}/{len(rows_to_run)}] {name}: {row['status']}{speed}{note}", flush=True)
        if args.json:  # rewritten after every row: a run cut short keeps its rows
            args.json.write_text(json.dumps({"rows": rows}, indent=1, default=str))
    stats = summary(rows)
    meta = {"scale": args.scale, "device": args.device, "dtype": args.dtype, "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "wall_s": round(time.perf_counter() - start, 1),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name()}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "summary": stats, "rows": rows}, indent=1, default=str))
    if args.markdown:
        args.markdown.write_text(markdown(rows, stats, meta))
    print_table(rows, stats, f"kernelbench ({args.scale} scale, {args.dtype}, {meta['device_name']}, "
                             f"{meta['threads']} thread(s), torch {torch.__version__}, {meta['wall_s']} s)")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    except OSError:
        pass
    return f"CPU, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
