"""Every PyTorch op on PyTorch's own test samples, through fusec: code nobody here wrote.

PyTorch describes each public op with an OpInfo (torch.testing._internal): how to call it and a
list of sample inputs (odd shapes, broadcasting, scalars, empty tensors, keyword arguments). This
script compiles each sample as a one-op program, `fusec.compile(lambda *t: op(*t, ...))`, runs
it, and compares with eager:

    python benchmarks/opinfo_sweep.py                          # every op, float32, C++ backend
    python benchmarks/opinfo_sweep.py --dtypes float32,int64,bfloat16 --backend llvm
    python benchmarks/opinfo_sweep.py --only sum,softmax --samples 8 -v
    python benchmarks/opinfo_sweep.py --grad                   # training: gradients too
    python benchmarks/opinfo_sweep.py --backend triton --device cuda   # on a GPU
    TRITON_INTERPRET=1 python benchmarks/opinfo_sweep.py --backend triton   # Triton's interpreter

Each (op, dtype) gets one verdict, the worst over its samples:

    PASS      every sample matches eager (fusec's error against a float64 run at most eager's
              own error plus the dtype's tolerance; exact for integers, bools and complex)
    MISMATCH  fusec returned a different value, shape, dtype or structure: the worst bug
    CRASH     fusec raised where eager did not (a clean `fusec:` refusal included: a program
              eager runs should compile)
    SKIP      eager itself fails, or is not deterministic (random ops), or no sample fits

The tensors of a sample are the compiled function's arguments; everything else (ints, dims,
flags) is baked into the program, as a user's code would have it. Exit status 1 when any
MISMATCH or CRASH is found.
"""
from __future__ import annotations

import argparse
import collections
import math
import signal
import sys
import time
import traceback
import warnings

import torch
import torch.utils._pytree as pytree

# ops whose result is not a function of their inputs (random), or that change global state
NOT_A_FUNCTION = ("rand", "normal", "bernoulli", "multinomial", "dropout", "empty", "uniform",
                  "randint", "randn", "poisson", "exponential", "geometric", "cauchy",
                  "log_normal", "new_empty", "empty_like", "empty_strided", "item", "tolist",
                  "nn.functional.rrelu", "nn.functional.feature_alpha_dropout", "bfloat16",
                  "seed", "manual_seed", "nn.functional.fractional_max_pool2d",
                  "nn.functional.fractional_max_pool3d")


def seeds_rng(fn) -> bool:
    """OpInfo wraps random ops in `wrapper_set_seed` (the same stream on every eager call): their
    values follow torch's generator, which compiled code does not replay bit for bit."""
    code = getattr(fn, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


# the dtype's tolerance (torch.testing's default rtol): fusec's error may exceed eager's, both
# measured against a float64 run, by this much (the sweep and tests/test_opinfo.py both judge by it)
RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def flatten_sample(sample) -> tuple[list[torch.Tensor], callable]:
    """The sample's tensors (the program's arguments) and a function that rebuilds the call."""
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(tensors):
        new = list(leaves)
        for i, t in zip(where, tensors):
            new[i] = t
        return pytree.tree_unflatten(new, spec)
    return [leaves[i] for i in where], rebuild


def compare(got, want, ref) -> str | None:
    """None when `got` matches `want` (see the module docstring), else what differs."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    r_leaves = pytree.tree_leaves(ref) if ref is not None else [None] * len(w_leaves)
    if g_spec != w_spec or len(r_leaves) != len(w_leaves):
        return f"structure {g_spec} != {w_spec}"
    for k, (g, w, r) in enumerate(zip(g_leaves, w_leaves, r_leaves)):
        if not isinstance(w, torch.Tensor):
            same = (g == w) or (isinstance(w, float) and math.isnan(w) and math.isnan(g))
            if type(g) is not type(w) or not same:
                return f"output {k}: {g!r} != {w!r}"
            continue
        if not isinstance(g, torch.Tensor):
            return f"output {k}: {type(g).__name__} where eager returns a tensor"
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {k}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        if g.device != w.device:
            return f"output {k}: on {g.device}, eager's on {w.device}"
        if w.is_complex():  # (complex32 has no comparisons): compared as real pairs, exactly
            g, w = (torch.view_as_real(t.to(torch.complex128).resolve_conj().resolve_neg())
                    for t in (g, w))
        if w.is_complex() or not w.is_floating_point():
            if not torch.equal(g, w):
                bad = (g != w).sum().item()
                return f"output {k}: {bad} of {w.numel()} elements differ"
            continue
        g64, w64 = g.double(), w.double()
        if not torch.equal(g64.isnan(), w64.isnan()):
            return f"output {k}: NaN where eager has none, or none where eager has NaN"
        ok = ~w64.isnan()
        if not torch.equal(g64[ok].isinf(), w64[ok].isinf()) or \
                not torch.equal(g64[ok & w64.isinf()], w64[ok & w64.isinf()]):
            return f"output {k}: infinities differ"
        fin = ok & ~w64.isinf()
        if not fin.any():
            continue
        resolution = torch.finfo(w.dtype).eps
        scale = w64[fin].abs().clamp(min=1.0)
        err = ((g64[fin] - w64[fin]).abs() / scale).max().item()
        allowed = 4 * resolution
        if isinstance(r, torch.Tensor) and r.shape == w.shape and r.is_floating_point():
            r64 = r.double()[fin]
            eager_err = ((w64[fin] - r64).abs() / scale).max().item()
            allowed = max(allowed, eager_err + RTOL.get(w.dtype, resolution))
        if err > allowed:
            return f"output {k}: error {err:.2e} > allowed {allowed:.2e}"
    return None


def evaluate(fn, tensors: list, grad: bool):
    """fn's result on copies of `tensors`; with `grad`, also the gradients of a fixed weighted
    sum of its floating-point outputs with respect to every input that requires grad (the
    weights come from a seeded generator: the same for eager, float64 and fusec)."""
    ts = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    if not grad:
        with torch.no_grad():
            return fn(*ts)
    out = fn(*ts)
    wants = [t for t in ts if t.requires_grad]
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    detached = pytree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
    if not outs or not wants:
        return detached, ()
    g = torch.Generator().manual_seed(0)
    total = sum((o * torch.randn(o.shape, generator=g).to(o.device, o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(total, wants, allow_unused=True)
    return detached, tuple(torch.zeros_like(w) if d is None else d for d, w in zip(grads, wants))


def run_sample(op, sample, backend: str, seconds: int, grad: bool = False) -> tuple[str, str]:
    """(verdict, detail) for one sample (with `grad`: its outputs and its input gradients)."""
    import fusec
    tensors, rebuild = flatten_sample(sample)

    def fn(*ts):
        inp, args, kwargs = rebuild(list(ts))
        return op.op(inp, *args, **kwargs)
    try:
        want = evaluate(fn, tensors, grad)
        again = evaluate(fn, tensors, grad)
    except Exception as err:  # noqa: BLE001
        return "SKIP", f"eager fails: {type(err).__name__}"
    if any(isinstance(t, torch.Tensor) and t.layout != torch.strided
           for t in [*tensors, *pytree.tree_leaves(want)]):
        return "SKIP", "sparse tensors"
    if compare(again, want, None) is not None:
        return "SKIP", "eager is not deterministic"
    try:
        ref = evaluate(fn, [t.double() if t.is_floating_point() else t for t in tensors], grad)
    except Exception:  # noqa: BLE001
        ref = None
    signal.alarm(seconds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = evaluate(fusec.compile(fn, backend=backend), tensors, grad)
    except Timeout:
        return "CRASH", f"no result after {seconds} s"
    except Exception as err:  # noqa: BLE001
        where = traceback.extract_tb(err.__traceback__)[-1]
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        return "CRASH", f"{type(err).__name__}: {first} [{where.filename.split('/')[-1]}:{where.lineno}]"
    finally:
        signal.alarm(0)
    problem = compare(got, want, ref)
    return ("MISMATCH", problem) if problem else ("PASS", "")


def describe(sample) -> str:
    tensors, _ = flatten_sample(sample)
    shapes = ", ".join(f"{list(t.shape)}" for t in tensors)
    others = [a for a in (*sample.args, *sample.kwargs.items()) if not isinstance(a, torch.Tensor)]
    return f"({shapes}){' ' + repr(others)[:80] if others else ''}"


RANK = {"PASS": 0, "SKIP": 1, "MISMATCH": 3, "CRASH": 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--samples", type=int, default=4, help="samples per op and dtype")
    parser.add_argument("--only", help="comma-separated op names (exact, or a prefix ending in .)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per sample")
    parser.add_argument("--start", help="begin at the op of this name (op_db's order): resume a sweep")
    parser.add_argument("--grad", action="store_true",
                        help="inputs require grad: compare outputs and input gradients (training)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every sample")
    args = parser.parse_args()
    torch.manual_seed(0)
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_methods_invocations import op_db
    only = args.only.split(",") if args.only else None
    signal.signal(signal.SIGALRM, _alarm)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    counts, bad = collections.Counter(), []
    start = time.perf_counter()
    names = [op.name for op in op_db]
    for op in op_db[names.index(args.start) if args.start else 0:]:
        if only and not any(op.name == o or (o.endswith(".") and op.name.startswith(o)) for o in only):
            continue
        if any(op.name == n or op.name.startswith(n + "_") or op.name.endswith("." + n)
               for n in NOT_A_FUNCTION) or seeds_rng(op.op):
            continue
        for dtype in dtypes:
            if dtype not in op.supported_dtypes(args.device):
                continue
            verdict, detail, what = "SKIP", "no sample", ""
            try:
                if args.grad and not (op.supports_autograd and dtype.is_floating_point):
                    continue
                samples = list(op.sample_inputs(args.device, dtype,
                                                requires_grad=args.grad))[:args.samples]
            except Exception as err:  # noqa: BLE001
                samples, detail = [], f"samples fail: {type(err).__name__}"
            for sample in samples:
                v, d = run_sample(op, sample, args.backend, args.timeout, args.grad)
                if args.verbose:
                    print(f"  {op.name} {dtype} {describe(sample)}: {v} {d}", flush=True)
                if RANK[v] > RANK[verdict] or (verdict == "SKIP" and v == "PASS"):
                    verdict, detail, what = v, d, describe(sample)
            counts[verdict] += 1
            if verdict in ("MISMATCH", "CRASH"):
                bad.append(f"{verdict:8} {op.name} {str(dtype).replace('torch.', '')} {what}: {detail}")
                print(bad[-1], flush=True)
    print(f"\n{sum(counts.values())} op/dtype pairs in {time.perf_counter() - start:.0f} s "
          f"({args.backend} on {args.device}): " + ", ".join(f"{counts[k]} {k}" for k in RANK if counts[k]))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
