"""The `fusec` command.

    fusec demo [--backend cpp|triton]     run the seed examples, show kernels, errors and times
    fusec run examples/sin4.py            run one example file (or a name: `fusec run sin4`)
    fusec explain examples/sin4.py        print every stage of the pipeline for one example
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the seed examples")
    demo.add_argument("--backend", default="auto", choices=["auto", "cpp", "triton"])
    for name in ("run", "explain"):
        p = sub.add_parser(name, help=f"{name} one example (a file path or a name)")
        p.add_argument("example")
        p.add_argument("--backend", default="auto", choices=["auto", "cpp", "triton"])
    args = parser.parse_args(argv)

    import torch
    if args.backend == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from fusec.demo import load_example, run_demo, run_example
    from fusec.errors import FusecError
    try:
        if args.command == "demo":
            run_demo(args.backend)
        elif args.command == "run":
            run_example(load_example(args.example).example(), args.backend)
        else:
            import fusec
            ex = load_example(args.example).example()
            print(fusec.explain(ex.fn, *ex.inputs, backend=args.backend))
    except FusecError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
