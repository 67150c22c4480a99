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
    # bfloat16 through exact bit-level helpers: the interpreter's own casts truncate
    if dst == torch.bfloat16:
        return f"fusec_f32_to_bf16({convert(expr, src, torch.float32)})"
    if src == torch.bfloat16:
        return convert(f"fusec_bf16_to_f32({expr})", torch.float32, dst)
    if dst == torch.bool:
        return f"({expr} != 0)"
    if src.is_floating_point and not dst.is_floating_point and dst != torch.int64:
        return f"{expr}.to(tl.int64).to({TL[dst]})"
    return f"{expr}.to({TL[dst]})"


def _operand(o, dtype) -> str:
    if isinstance(o, Const):
        return literal(o.value, dtype)
    return convert(o.name, o.dtype, dtype)


def _stmt(s: Stmt, helpers: set, block: str = "[BLOCK_SIZE]") -> str:
    row = ops.OPS[s.op]
    args = [_operand(o, dt) for o, dt in zip(s.operands, s.operand_dtypes)]
    if s.op == "full":
        expr = f"tl.full({block}, {args[0]}, {TL[s.result_dtype]})" if not args[0].startswith(
            "tl.full") else args[0].replace("[1]", block)
    else:
        expr = row.triton.format(*args)
    helpers.update(re.findall(r"\bfusec_\w+", expr))
    if s.result_dtype != s.var.dtype:
        expr = convert(f"({expr})", s.result_dtype, s.var.dtype)
    if s.round_to is not None:
        expr = convert(convert(f"({expr})", s.var.dtype, s.round_to), s.round_to, s.var.dtype)
    return f"{s.var.name} = {expr}  # {s.origin}"


def render(kernel) -> str:
    if not isinstance(kernel, PointwiseKernel):
        return render_reduction(kernel)
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
    helpers = _helpers_in(loads + body + stores)
    return render_template(
        "triton_pointwise.py.j2",
        name=kernel.name, summary=_summary(kernel), source_shape=kernel.source_shape,
        loop_shape=shape, numel=numel, block=block, blocks=-(-numel // block),
        num_warps=num_warps, helpers=sorted(helpers),
        params=[f"{p.name}_ptr" for p in kernel.params], args=[p.name for p in kernel.params],
        block_start="pid.to(tl.int64) * BLOCK_SIZE" if big else "pid * BLOCK_SIZE",
        coords=coords, loads=loads, body=body, stores=stores)


def _helpers_in(lines: list[str]) -> set[str]:
    """The fusec_* helpers a kernel's lines call: the module imports exactly those."""
    return {name for line in lines for name in re.findall(r"\bfusec_\w+", line)}


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


# ---- reductions ------------------------------------------------------------------------------

PERSISTENT_MAX_K = 8192  # rows up to this long stay in registers; longer ones are looped over
LOOP_RBLOCK = 2048


def reduction_blocks(rows: int, k: int) -> tuple[bool, int, int, int]:
    """(persistent, XBLOCK, RBLOCK, num_warps): a whole short row per program when it fits,
    several rows per program when rows are short, 2048-wide chunks for long rows."""
    persistent = k <= PERSISTENT_MAX_K
    rblock = max(1 << max(k - 1, 0).bit_length(), 2) if persistent else LOOP_RBLOCK
    xblock = max(1, min(4096 // rblock, 1 << max(rows - 1, 0).bit_length()))
    num_warps = max(1, min(16, (xblock * rblock) // 512))
    return persistent, xblock, rblock, num_warps


def render_reduction(kernel) -> str:
    from fusec.ir import Reduce
    persistent, xblock, rblock, num_warps = reduction_blocks(kernel.rows, kernel.k)
    n_rows = len(kernel.row_shape)
    helpers: set = set()

    def coords(prefix: str, var: str, shape) -> list[str]:
        out = []
        for d in range(len(shape)):
            below = math.prod(shape[d + 1:])
            expr = var if below == 1 else f"({var} // {below})"
            out.append(f"{prefix}{d} = {expr}" + ("" if d == 0 else f" % {shape[d]}"))
        return out

    def index(idx: Index) -> tuple[str, str]:
        """(address expression, mask) for an index over (row dims..., k dims...)."""
        terms = [f"r{d}" if s == 1 else f"r{d} * {s}" for d, s in enumerate(idx.strides[:n_rows]) if s]
        kterms = [f"k{d}" if s == 1 else f"k{d} * {s}"
                  for d, s in enumerate(idx.strides[n_rows:]) if s]
        mask = "mask" if terms and kterms else ("k_mask" if kterms else "row_mask")
        terms = terms + kterms or ["tl.zeros_like(rows)"]
        return " + ".join(([str(idx.offset)] if idx.offset else []) + terms), mask

    load_lines = {}
    for l in kernel.loads:
        addr, mask = index(l.index)
        value = f"tl.load({l.param}_ptr + {addr}, mask={mask})"
        if l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        load_lines[l.var.name] = f"{l.var.name} = {value}"

    producers = {l.var.name: ("load", l) for l in kernel.loads}
    for item in kernel.body:
        producers[item.var.name] = ("body", item)

    def reduce_block(r: Reduce, operand: str) -> str:
        red = ops.REDUCTIONS[r.op]
        init = literal(red.init(r.acc_dtype), r.acc_dtype)
        masked = f"tl.where(mask, {convert(operand, r.operand.dtype, r.acc_dtype)}, {init})"
        if red.returns_index:
            expr = red.triton_block.format(x=masked, k="ks")
        else:
            expr = red.triton_block.format(x=masked)
        helpers.update(re.findall(r"\bfusec_\w+", expr))
        out = convert(f"({expr})", torch.int64 if red.returns_index else r.acc_dtype, r.var.dtype)
        if r.round_to is not None:
            out = convert(convert(out, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
        return f"({out})[:, None]"

    def line(name: str) -> str:
        kind, item = producers[name]
        if kind == "load":
            return load_lines[name]
        return _stmt(item, helpers, block="[1, 1]")

    order = [l.var.name for l in kernel.loads] + [item.var.name for item in kernel.body]

    def closure(targets: set[str], only_varying: bool) -> list[str]:
        """The values needed to compute `targets`, in program order."""
        need: set[str] = set()
        stack = list(targets)
        while stack:
            name = stack.pop()
            if name in need or (only_varying and name not in kernel.varying):
                continue
            need.add(name)
            kind, item = producers[name]
            if kind == "body" and not isinstance(item, Reduce):
                stack += [o.name for o in item.operands if isinstance(o, Var)]
        return [n for n in order if n in need]

    k_setup = lambda start: [f"ks = {start}tl.arange(0, RBLOCK)[None, :]", "k_mask = ks < n_k",
                             "mask = row_mask & k_mask", *coords("k", "ks", kernel.k_shape)]
    stores_elem, stores_row = [], []
    for s in kernel.stores:
        addr, mask = index(s.index)
        text = f"tl.store({s.param}_ptr + {addr}, {convert(s.var.name, s.var.dtype, s.dtype)}, mask={mask})"
        (stores_elem if s.var.name in kernel.varying else stores_row).append(text)

    row_lines = coords("r", "rows", kernel.row_shape)
    loops = []
    if persistent:
        body = list(k_setup(""))
        for name in order:
            kind, item = producers[name]
            body.append(reduce_line(item, reduce_block) if isinstance(item, Reduce) else line(name))
        loops.append({"comment": "The whole row fits in one block: load it once, reduce, finish.",
                      "before": [], "header": "", "body": body + stores_elem + stores_row,
                      "after": []})
    else:
        done: set[str] = set()
        # row values that need no reduction: computed once, before the loops
        for name in order:
            kind, item = producers[name]
            if name not in kernel.varying and not isinstance(item, Reduce) \
                    and kernel.level.get(name, 0) == 0:
                row_lines.append(line(name))
                done.add(name)
        for phase in range(kernel.phases):
            reds = [i for i in kernel.body if isinstance(i, Reduce) and i.phase == phase]
            before, body, after = [], list(k_setup("k_start + ")), []
            for r in reds:
                red = ops.REDUCTIONS[r.op]
                init = literal(red.init(r.acc_dtype), r.acc_dtype).replace("[1]", "[XBLOCK, RBLOCK]")
                if not init.startswith("tl.full"):
                    init = f"tl.full([XBLOCK, RBLOCK], {init}, {TL[r.acc_dtype]})"
                before.append(f"acc_{r.var.name} = {init}")
                if red.returns_index:  # each lane keeps its best value and where it saw it
                    before.append(f"acc_{r.var.name}_at = tl.full([XBLOCK, RBLOCK], -1, tl.int32)")
            for name in closure({r.operand.name for r in reds}, True):
                body.append(line(name))
            for r in reds:
                red = ops.REDUCTIONS[r.op]
                x = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
                if red.returns_index:
                    acc = f"acc_{r.var.name}"
                    helpers.update(["fusec_arg_update", "fusec_arg_finish"])
                    body.append(f"{acc}, {acc}_at = fusec_arg_update({acc}, {acc}_at, {x}, ks, mask, "
                                f"{r.op == 'argmax'})")
                    after.append(f"{r.var.name} = " + convert(
                        f"fusec_arg_finish({acc}, {acc}_at, {r.op == 'argmax'})", torch.int32,
                        r.var.dtype) + "[:, None]  # " + r.origin)
                    done.add(r.var.name)
                    continue
                combine = red.combine.format(acc=f"acc_{r.var.name}", x=x)
                helpers.update(re.findall(r"\bfusec_\w+", combine))
                body.append(f"acc_{r.var.name} = tl.where(mask, {combine}, acc_{r.var.name})")
                block = red.triton_block.format(x=f"acc_{r.var.name}")
                helpers.update(re.findall(r"\bfusec_\w+", block))
                value = convert(f"({block})", r.acc_dtype, r.var.dtype)
                if r.round_to is not None:
                    value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
                after.append(f"{r.var.name} = ({value})[:, None]  # " + r.origin)
                done.add(r.var.name)
            for name in order:  # row values that became computable after this phase
                kind, item = producers[name]
                if name not in done and name not in kernel.varying \
                        and kernel.level.get(name, 0) == phase + 1 and not isinstance(item, Reduce):
                    after.append(line(name))
                    done.add(name)
            loops.append({"comment": f"Phase {phase}: one pass over the row for "
                                     + ", ".join(r.op for r in reds) + ".",
                          "before": before, "header": "for k_start in range(0, n_k, RBLOCK):",
                          "body": body, "after": after})
        if stores_elem:
            targets = {s.var.name for s in kernel.stores if s.var.name in kernel.varying}
            body = list(k_setup("k_start + "))
            body += [line(n) for n in closure(targets, True)] + stores_elem
            loops.append({"comment": "Last pass: recompute the element values and store them.",
                          "before": [], "header": "for k_start in range(0, n_k, RBLOCK):",
                          "body": body, "after": []})
        if stores_row:
            loops.append({"comment": "", "before": stores_row, "header": "", "body": [], "after": []})

    helpers = _helpers_in(row_lines + [l for sec in loops for part in ("before", "body", "after")
                                       for l in sec[part]])
    big = max([kernel.numel] + [_max_address(a.index, kernel.row_shape + kernel.k_shape)
                                for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1
    return render_template(
        "triton_reduction.py.j2", name=kernel.name, summary=_summary(kernel),
        source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims, rows=kernel.rows,
        k=kernel.k, xblock=xblock, rblock=rblock, num_warps=num_warps, persistent=persistent,
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params],
        row_start="pid.to(tl.int64) * XBLOCK" if big else "pid * XBLOCK",
        row_lines=row_lines, sections=loops)


def reduce_line(r, reduce_block) -> str:
    return f"{r.var.name} = {reduce_block(r, r.operand.name)}  # {r.origin}"
