"""Triton backend: PointwiseKernel -> a Python module holding one @triton.jit kernel + launcher.

The kernel follows Triton's vector-add tutorial: the flat iteration space is cut into blocks of
BLOCK_SIZE, `offsets` are this block's positions, `mask` switches off the lanes past the end.
Inputs read through views or broadcasts compute their address from per-dimension coordinates;
plain contiguous inputs read `x_ptr + offsets` directly.

The module is written to the fusec cache (keyed by the hash of its text) and imported from there,
so Triton can read its source; Triton caches the compiled GPU binary itself. On a machine without
a GPU the same module runs under Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import importlib.util
import math
import re
import sys

import torch

from fusec import cache, ops
from fusec.ir import Const, Index, PointwiseKernel, Stmt, Var

from .render import render_template

TL = {
    torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.bool: "tl.int1",
}
MAX_BLOCK = 1024


def block_size(numel: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps): 1024 lanes and 4 warps for large tensors (8 elements per thread,
    wide vector loads), smaller for tiny ones so most lanes do useful work."""
    block = min(MAX_BLOCK, max(128, 1 << max(numel - 1, 0).bit_length()))
    return block, 4 if block >= 512 else (2 if block >= 256 else 1)


def literal(value, dtype: torch.dtype) -> str:
    """A constant of exactly `dtype` (bare literals would be typed int32/float32 by Triton)."""
    if dtype == torch.bool:
        return f"tl.full([1], {1 if value else 0}, tl.int1)"
    if dtype.is_floating_point:
        value = float(value)
        text = f'float("{value}")' if math.isnan(value) or math.isinf(value) else repr(value)
        return text if dtype == torch.float32 else f"tl.full([1], {text}, {TL[dtype]})"
    value = torch.tensor(value).to(dtype).item()
    return f"tl.full([1], {value}, {TL[dtype]})"


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    if src == dst:
        return expr
    if dst == torch.bool:
        return f"({expr} != 0)"
    if src.is_floating_point and not dst.is_floating_point and dst != torch.int64:
        return f"{expr}.to(tl.int64).to({TL[dst]})"
    return f"{expr}.to({TL[dst]})"


def _operand(o, dtype) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(o.name, o.dtype, dtype)


def _stmt(s: Stmt, helpers: set) -> str:
    row = ops.OPS[s.op]
    args = [_operand(o, dt) for o, dt in zip(s.operands, s.operand_dtypes)]
    if s.op == "full":
        expr = f"tl.full([BLOCK_SIZE], {args[0]}, {TL[s.result_dtype]})" if not args[0].startswith(
            "tl.full") else args[0].replace("[1]", "[BLOCK_SIZE]")
    else:
        expr = row.triton.format(*args)
    helpers.update(re.findall(r"\bfusec_\w+", expr))
    if s.result_dtype != s.var.dtype:
        expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to is not None:
        expr = f"({expr}).to({TL[s.round_to]}).to({TL[s.var.dtype]})"
    return f"{s.var.name} = {expr}  # {s.origin}"


def render(kernel: PointwiseKernel) -> str:
    shape = kernel.shape
    numel = kernel.numel
    block, num_warps = block_size(numel)
    flat = [l.index.is_flat(shape) for l in kernel.loads] + \
           [s.index.is_flat(shape) for s in kernel.stores]
    coords = []
    if not all(flat):
        for d in range(len(shape)):
            below = math.prod(shape[d + 1:])
            expr = "offsets" if below == 1 else f"(offsets // {below})"
            coords.append(f"i{d} = {expr}" + ("" if d == 0 else f" % {shape[d]}"))

    def index(idx: Index) -> str:
        if idx.is_flat(shape):
            return "offsets"
        terms = [f"i{d}" if s == 1 else f"i{d} * {s}" for d, s in enumerate(idx.strides) if s]
        if not terms:  # every lane reads one element: still a block of addresses, for the mask
            terms = ["tl.zeros_like(offsets)"]
        return " + ".join(([str(idx.offset)] if idx.offset else []) + terms)

    loads = []
    for l in kernel.loads:
        value = f"tl.load({l.param}_ptr + {index(l.index)}, mask=mask)"
        if ops.register_dtype(l.dtype) != l.dtype or l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        loads.append(f"{l.var.name} = {value}")
    helpers: set = set()
    body = [_stmt(s, helpers) for s in kernel.stmts]
    stores = [f"tl.store({s.param}_ptr + {index(s.index)}, "
              f"{convert(s.var.name, s.var.dtype, s.dtype)}, mask=mask)" for s in kernel.stores]
    big = max([numel] + [_max_address(a.index, shape) for a in [*kernel.loads, *kernel.stores]]) \
        >= 2 ** 31 - 1
    return render_template(
        "triton_pointwise.py.j2",
        name=kernel.name, summary=_summary(kernel), source_shape=kernel.source_shape,
        loop_shape=shape, numel=numel, block=block, blocks=-(-numel // block),
        num_warps=num_warps, helpers=sorted(helpers),
        params=[f"{p.name}_ptr" for p in kernel.params], args=[p.name for p in kernel.params],
        block_start="pid.to(tl.int64) * BLOCK_SIZE" if big else "pid * BLOCK_SIZE",
        coords=coords, loads=loads, body=body, stores=stores)


def _max_address(index: Index, shape: tuple[int, ...]) -> int:
    """The largest element offset an index reaches: decides between 32- and 64-bit arithmetic."""
    return abs(index.offset) + sum((size - 1) * abs(st) for size, st in zip(shape, index.strides))


def _summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


def load(kernel: PointwiseKernel, source: str):
    """Write the module into the cache (if not already there, intact) and import its launcher."""
    key = cache.content_hash(source)
    path = cache.cache_dir("triton") / f"{kernel.name}-{key}.py"
    try:
        intact = path.read_bytes() == source.encode()
    except OSError:
        intact = False
    if intact:
        cache.STATS["hits"] += 1
    else:
        if path.exists():
            cache.STATS["corrupt"] += 1
            cache.log(f"corrupt cache entry {path.name}: rewriting")
        cache.STATS["misses"] += 1
        cache.atomic_write(path, source)
    module_name = f"fusec_kernels.{kernel.name}_{key}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    return module.launch
