"""The `fusec` command.

    fusec demo [--backend cpp|llvm|triton]  run the seed examples, show kernels, errors and times
    fusec run examples/sin4.py            run one example file (or a name: `fusec run sin4`)
    fusec explain examples/sin4.py        print every stage of the pipeline for one example
                [--json] [--dot DIR]      ... as JSON; write the graph pictures (.dot, .svg)
    fusec kernels examples/sin4.py        print just the generated kernel sources
                [--optimized] [--asm [--target CPU|GPU]]
                                         llvm backend: after LLVM's optimizer; as assembly;
                                         triton backend: --asm is the SASS for sm_90 (or GPU)
    fusec profile examples/sin4.py        eager vs fused under torch.profiler, as tables
                [--html report.html] [--traces DIR] [--iters N] [--device cpu|cuda]

    common options: --backend auto|cpp|llvm|triton, --small (the file's SMALL sizes),
                    --inputs "randn(8, 64), randint(0, 10, (8,))" (the program's inputs),
                    --progress / --no-progress (default: a progress bar when stderr is a terminal)

Any program, not only the examples (fusec/load.py):

    fusec explain my_model.py:Net --inputs "randn(8, 64)"     a class, function or module object
    fusec kernels my_kernelbench_problem.py                   Model + get_inputs(), KernelBench's
    fusec profile mypackage.layers:attention                  importable: package.module:name

An example file defines `example(device="cpu") -> fusec.demo.Example` (the function, its inputs
and a sentence about it); every file in examples/ does, the training scripts included (their
model's forward on one batch). It may define `SMALL`, a dict of example() keyword arguments that
`--small` passes (small sizes, for a quick look). Other files give their inputs with --inputs,
`example_inputs()` or `get_inputs()`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import fusec
from fusec.errors import FusecError

# torch and the compiler are imported by the command that needs them, after its arguments are
# parsed: `fusec --help` and a mistyped option answer at once (fusec/__init__.py's "lazy face").


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the seed examples")
    demo.add_argument("--backend", default="auto", choices=["auto", "cpp", "llvm", "triton"])
    helps = {"run": "run one example (a file path or a name)",
             "explain": "print every stage of the pipeline for one example",
             "kernels": "print the generated kernel sources of one example",
             "profile": "profile one example eagerly and fused, side by side"}
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("example", metavar="program",
                       help="an example's name (sin4), a file (model.py, model.py:Net), or "
                            "package.module:name")
        p.add_argument("--inputs", metavar="EXPR",
                       help='the inputs, as torch calls: "randn(8, 64), randint(0, 10, (8,))" '
                            "(parsed, not run as Python: torch's tensor factories, dtypes and "
                            "literals only; default: the file's example(), example_inputs() or "
                            "get_inputs())")
        p.add_argument("--backend", default="auto", choices=["auto", "cpp", "llvm", "triton"])
        p.add_argument("--device", default=None if name != "profile" else "auto",
                       choices=["auto", "cpu", "cuda"],
                       help="where the example's inputs live (auto: a GPU if there is one; "
                            "default: the CPU, or for --backend triton a GPU if there is one)")
        p.add_argument("--small", action="store_true",
                       help="use the example's SMALL sizes (its SMALL dict of example() kwargs)")
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="draw progress bars on stderr (default: when stderr is a terminal)")
        if name == "explain":
            p.add_argument("--json", action="store_true", help="print to_dict() as JSON")
            p.add_argument("--dot", metavar="DIR",
                           help="write graph_before_fusion.dot/.svg and graph_after_fusion.dot/.svg")
        if name == "kernels":
            p.add_argument("--optimized", action="store_true",
                           help="llvm backend: print the IR after LLVM's O3 pipeline")
            p.add_argument("--asm", action="store_true",
                           help="llvm backend: print the host assembly; triton backend: the "
                                "SASS for an NVIDIA GPU (no GPU needed)")
            p.add_argument("--target", metavar="CPU|GPU", default=None,
                           help="with --asm: assembly for another CPU (x86-64, haswell, "
                                "skylake-avx512, sapphirerapids, znver4, aarch64) or for a GPU "
                                "(sm_80, sm_86, sm_89, sm_90: the default for triton)")
        if name == "profile":
            p.add_argument("--html", metavar="FILE", help="also write the HTML report here")
            p.add_argument("--traces", metavar="DIR", help="also write eager/fused Chrome traces")
            p.add_argument("--iters", type=int, default=10, help="profiled iterations (default 10)")
    args = parser.parse_args(argv)
    try:
        return _with_progress_flag(args)
    except BrokenPipeError:  # `fusec kernels sin4 | head`: the reader left; so do we, quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (Python would complain again at exit)
        return 0


def _with_progress_flag(args) -> int:
    flag = getattr(args, "progress", None)
    if flag is None:
        return _run(args)
    saved = os.environ.get("FUSEC_PROGRESS")  # --progress / --no-progress: for this command only
    os.environ["FUSEC_PROGRESS"] = "1" if flag else "0"
    try:
        return _run(args)
    finally:
        if saved is None:
            del os.environ["FUSEC_PROGRESS"]
        else:
            os.environ["FUSEC_PROGRESS"] = saved


def _run(args) -> int:
    from fusec.demo import run_demo, run_example

    try:
        if args.command == "demo":
            run_demo(args.backend)
            return 0
        ex = _example(args.example, args.device, args.small, args.backend, args.inputs)
        if args.command == "run":
            run_example(ex, args.backend)
        elif args.command == "explain":
            _explain(ex, args)
        elif args.command == "kernels":
            e = fusec.explain(ex.fn, *ex.inputs, backend=args.backend)
            for k in e.kernels:  # every region's, for a program with graph breaks
                text = e.assembly(k.name, args.target) if args.asm else \
                    e.optimized_ir(k.name) if args.optimized else k.source
                print(f"# ===== {k.name} ({k.backend}) =====\n{text}")
        else:
            _profile(ex, args)
    except FusecError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


def _example(spec: str, device: str | None, small: bool = False, backend: str = "auto",
             inputs: str | None = None):
    import torch

    from fusec.codegen import backends
    from fusec.device import default_device
    from fusec.load import load

    if device is None:  # a GPU backend named on a GPU machine: its tensors on the GPU
        device = default_device() if backends.runs_on_gpus(backend) else "cpu"
    if device == "auto":  # the CPU backends' examples live on the CPU, also on a GPU machine
        device = "cpu" if backends.cpu_only(backend) else default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fusec: --device cuda, but torch sees no GPU on this machine")
    return load(spec, device=device, inputs=inputs, small=small)


def _explain(ex, args) -> None:
    e = fusec.explain(ex.fn, *ex.inputs, backend=args.backend)
    if args.dot:
        out = Path(args.dot)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for stage in ("before", "after"):
            (out / f"graph_{stage}_fusion.dot").write_text(e.dot(stage))
            written.append(f"graph_{stage}_fusion.dot")
            svg = e.svg(stage)
            if svg:
                (out / f"graph_{stage}_fusion.svg").write_text(svg)
                written.append(f"graph_{stage}_fusion.svg")
        said = f"fusec: wrote {', '.join(written)} to {out}"
        if shutil.which("dot") is None:
            said += (" (no .svg pictures: Graphviz's `dot` is not installed; install graphviz "
                     "and run `dot -Tsvg graph_after_fusion.dot -o graph_after_fusion.svg`, "
                     "or paste a .dot file into any Graphviz viewer)")
        elif len(written) < 4:
            said += " (Graphviz's `dot` is installed but failed on a graph: no .svg for it)"
        print(said, file=sys.stderr)
    print(json.dumps(e.to_dict(), indent=1) if args.json else e)


def _profile(ex, args) -> None:
    from fusec import progress as bars
    from fusec.inspect.report import STAGES

    with bars.session() as bar:  # None unless stderr is a terminal or --progress
        task = bar.add_task("profile", total=len(STAGES)) if bar else None
        seen: list[str] = []

        def progress(stage: str) -> None:
            if bar is None:
                return
            if seen:
                bar.advance(task)
            seen.append(stage)
            bar.update(task, description=f"profile: {stage}")

        report = fusec.profile(ex.fn, *ex.inputs, backend=args.backend, iters=args.iters,
                               progress=progress, name=ex.name)
    print(report)
    if args.traces:
        paths = report.export_chrome_traces(args.traces)
        print("chrome traces: " + ", ".join(str(p) for p in paths))
    if args.html:
        print(f"html report: {report.save_html(args.html)}")


if __name__ == "__main__":
    sys.exit(main())
