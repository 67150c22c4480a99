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
from pathlib import Path

import torch

from fusec import cache, ops
from fusec.ir import Const, Index, PointwiseKernel, Reduce, Stmt, Var, short_dtype as short

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


SMALL_INTS = (torch.int8, torch.uint8, torch.int16)  # exact in float32 through the bit trick


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
    if src in SMALL_INTS and dst == torch.float32:
        return f"fusec_small_int_to_f32({expr})"  # exact, and 4x the rate of a cast on a GPU
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
    tiles = tiling(kernel)
    if tiles is not None:
        return render_tiled(kernel, *tiles)
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

    loads, body, stores = pointwise_lines(kernel, index, "[BLOCK_SIZE]")
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


# Note (tiled pointwise kernels): a 1-D block of consecutive positions suits tensors that are
# contiguous along the loop's last dimension. A transposing copy (attention's k.transpose(-2, -1)
# made contiguous, say) reads along one dimension and writes along another, and one side then
# moves one element per 32-byte memory transaction: on an H200 the q/k/v copy of a GPT-2 block
# ran 3x slower than its bytes allow. `tiling` spots such kernels and `render_tiled` walks them
# in 2-D tiles (triton_pointwise_tiled.py.j2), which Triton turns into coalesced loads and stores
# on both sides. The choice is made here, from the strides; the template only lays it out.

TILE_MIN = 16  # both tiled dimensions at least this long, or tiling buys nothing


def tiling(kernel: PointwiseKernel) -> tuple[int, int] | None:
    """(ydim, xdim) when the kernel's loads and stores disagree about which loop dimension is
    contiguous: some along the last (xdim), some along another (ydim); else None."""
    shape = kernel.shape
    if len(shape) < 2:
        return None
    xdim = len(shape) - 1
    along: list[int] = []  # for each access, the loop dim along which it is contiguous
    for a in [*kernel.loads, *kernel.stores]:
        unit = [d for d, st in enumerate(a.index.strides) if st == 1 and shape[d] > 1]
        if unit:
            along.append(unit[-1])
    others = [d for d in along if d != xdim]
    if not others or xdim not in along or shape[xdim] < TILE_MIN:
        return None
    ydim = max(set(others), key=others.count)
    if shape[ydim] < TILE_MIN:
        return None
    return ydim, xdim


def render_tiled(kernel: PointwiseKernel, ydim: int, xdim: int) -> str:
    shape = kernel.shape
    ysize, xsize = shape[ydim], shape[xdim]
    yblock = min(64, 1 << (ysize - 1).bit_length())
    xblock = min(64, 1 << (xsize - 1).bit_length())
    y_tiles, x_tiles = -(-ysize // yblock), -(-xsize // xblock)
    others = [d for d in range(len(shape)) if d not in (ydim, xdim)]
    rest = []
    for j, d in enumerate(others):
        below = math.prod(shape[o] for o in others[j + 1:])
        expr = "rest" if below == 1 else f"(rest // {below})"
        rest.append(f"i{d} = {expr}" + ("" if j == 0 else f" % {shape[d]}"))
    big = max([kernel.numel] + [_max_address(a.index, shape)
                                for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1
    block = "[YBLOCK, XBLOCK]"

    def index(idx: Index) -> str:
        terms = [f"i{d}" if st == 1 else f"i{d} * {st}" for d, st in enumerate(idx.strides) if st]
        if not any(t.split(" ")[0] in (f"i{ydim}", f"i{xdim}") for t in terms):
            terms.append(f"tl.zeros({block}, tl.int32)")  # the same element in every lane
        return " + ".join(([str(idx.offset)] if idx.offset else []) + terms)

    loads, body, stores = pointwise_lines(kernel, index, block)
    names = [p.name for p in kernel.params]
    along = {d: [a.param for a in [*kernel.loads, *kernel.stores] if a.index.strides[d] == 1]
             for d in (ydim, xdim)}
    why = "; ".join(f"dim {d}: {', '.join(dict.fromkeys(along[d]))}" for d in (ydim, xdim))
    return render_template(
        "triton_pointwise_tiled.py.j2",
        name=kernel.name, summary=_summary(kernel), source_shape=kernel.source_shape,
        loop_shape=shape, numel=kernel.numel, ydim=ydim, xdim=xdim, ysize=ysize, xsize=xsize,
        yblock=yblock, xblock=xblock, y_tiles=y_tiles, x_tiles=x_tiles,
        programs=y_tiles * x_tiles * math.prod(shape[d] for d in others),
        pid="tl.program_id(axis=0).to(tl.int64)" if big else "tl.program_id(axis=0)",
        rest=rest, why=why, num_warps=4, helpers=sorted(_helpers_in(loads + body + stores)),
        params=[f"{n}_ptr" for n in names], args=names, loads=loads, body=body, stores=stores)


def pointwise_lines(kernel: PointwiseKernel, index, block: str) -> tuple[list, list, list]:
    """(loads, statements, stores) of a pointwise kernel, with `index` writing an Index as an
    address expression: shared by the 1-D and the tiled template, which differ only there."""
    loads = []
    for l in kernel.loads:
        value = f"tl.load({l.param}_ptr + {index(l.index)}, mask=mask)"
        if ops.register_dtype(l.dtype) != l.dtype or l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        loads.append(f"{l.var.name} = {value}")
    body = [_stmt(s, set(), block) for s in kernel.stmts]
    stores = [f"tl.store({s.param}_ptr + {index(s.index)}, "
              f"{convert(s.var.name, s.var.dtype, s.dtype)}, mask=mask)" for s in kernel.stores]
    return loads, body, stores


def _helpers_in(lines: list[str]) -> set[str]:
    """The fusec_* helpers a kernel's lines call: the module imports exactly those."""
    return {name for line in lines for name in re.findall(r"\bfusec_\w+", line)}


def _max_address(index: Index, shape: tuple[int, ...]) -> int:
    """The largest element offset an index reaches: decides between 32- and 64-bit arithmetic."""
    return abs(index.offset) + sum((size - 1) * abs(st) for size, st in zip(shape, index.strides))


def _summary(kernel: PointwiseKernel) -> str:
    names = [op.replace("aten.", "").split(".")[0] for op in kernel.ops]
    return f"fuses {len(names)} ATen op(s): {', '.join(names)}"


def build(source: str, name: str) -> Path:
    """Write the module into the cache (unless it is there, intact). Triton compiles the kernel
    when it first launches it; a module is only text until then."""
    key = cache.content_hash(source)
    path = cache.cache_dir("triton") / f"{name}-{key}.py"
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
    return path


def launcher(path: Path, name: str, n_params: int):
    """Import a written module (once per process) and wrap its `launch` in a TritonLauncher."""
    module_name = f"fusec_kernels.{path.stem.replace('-', '_')}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[module_name] = module
    from .triton_launch import TritonLauncher
    return TritonLauncher(module, path, name, n_params)


def load(kernel: PointwiseKernel, source: str):
    """Write the module into the cache (if not already there, intact) and import its launcher."""
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params))


# ---- reductions ------------------------------------------------------------------------------

PERSISTENT_MAX_K = 8192  # rows up to this long stay in registers; longer ones are looped over
LOOP_RBLOCK = 2048


# Note (column reductions): a channels-last tensor reduced over its pixels (a global average pool,
# batch-norm statistics) has its rows (channels) next to each other in memory and each row's
# elements C apart. One row per program would read one float out of every 32-byte sector it
# fetches; instead a program takes COLUMN_XBLOCK neighbouring rows and walks k in steps of
# COLUMN_RBLOCK, so every load of the [XBLOCK, RBLOCK] tile reads XBLOCK consecutive floats.
COLUMN_XBLOCK = 64
COLUMN_RBLOCK = 64


def is_column_reduction(kernel) -> bool:
    """True when every load that varies along k is contiguous across rows and strided along k."""
    n_rows = len(kernel.row_shape)
    varying = [l.index.strides for l in kernel.loads if any(l.index.strides[n_rows:])]
    return bool(varying) and n_rows > 0 and all(
        st[n_rows - 1] == 1 and st[-1] not in (0, 1) for st in varying)


def reduction_blocks(rows: int, k: int, column: bool = False) -> tuple[bool, int, int, int]:
    """(persistent, XBLOCK, RBLOCK, num_warps): a whole short row per program when it fits,
    several rows per program when rows are short, 2048-wide chunks for long rows; a warp per
    1024 elements of the tile (32 per thread: on an H200, 4 warps ran a 4096-wide softmax 2-4%
    faster than 8 or 16, and a 4096-wide layer norm 1% faster). L2 eviction hints (evict_first
    for rows read once, evict_last for a weight every row reads) made that layer norm 1.5%
    slower there, so there are none."""
    persistent = k <= PERSISTENT_MAX_K
    if column and rows >= COLUMN_XBLOCK and k > COLUMN_RBLOCK:
        # see the note on column reductions above
        return False, COLUMN_XBLOCK, COLUMN_RBLOCK, 4
    rblock = max(1 << max(k - 1, 0).bit_length(), 2) if persistent else LOOP_RBLOCK
    xblock = max(1, min(4096 // rblock, 1 << max(rows - 1, 0).bit_length()))
    num_warps = max(1, min(16, (xblock * rblock) // 1024))
    return persistent, xblock, rblock, num_warps


def render_reduction(kernel) -> str:
    if gemv_fits(kernel):
        return render_gemv(kernel)
    persistent, xblock, rblock, num_warps = reduction_blocks(kernel.rows, kernel.k,
                                                             is_column_reduction(kernel))
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
        return kernel.values_needed(targets, only_varying=only_varying)

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
        for phase, online in looped_passes(kernel):
            reds = [i for i in kernel.body if isinstance(i, Reduce) and i.phase == phase]
            peaks: dict[str, list] = {}  # amax -> the online sums that share its running max
            for o in online:
                peaks.setdefault(o.peak, []).append(o)
            before, body, after = [], list(k_setup("k_start + ")), []
            for r in reds:
                red = ops.REDUCTIONS[r.op]
                init = literal(red.init(r.acc_dtype), r.acc_dtype).replace("[1]", "[XBLOCK, RBLOCK]")
                if not init.startswith("tl.full"):
                    init = f"tl.full([XBLOCK, RBLOCK], {init}, {TL[r.acc_dtype]})"
                before.append(f"acc_{r.var.name} = {init}")
                if red.returns_index:  # each lane keeps its best value and where it saw it
                    before.append(f"acc_{r.var.name}_at = tl.full([XBLOCK, RBLOCK], -1, tl.int32)")
                for o in peaks.get(r.var.name, []):
                    before.append(f"acc_{o.total} = tl.full([XBLOCK, RBLOCK], 0.0, {TL[r.acc_dtype]})"
                                  f"  # sum of exp(x - running max), per lane")
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
                if r.var.name in peaks:
                    body += online_update(r, x, combine, peaks[r.var.name])
                else:
                    body.append(f"acc_{r.var.name} = tl.where(mask, {combine}, acc_{r.var.name})")
                block = red.triton_block.format(x=f"acc_{r.var.name}")
                helpers.update(re.findall(r"\bfusec_\w+", block))
                value = convert(f"({block})", r.acc_dtype, r.var.dtype)
                if r.round_to is not None:
                    value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
                after.append(f"{r.var.name} = ({value})[:, None]  # " + r.origin)
                done.add(r.var.name)
            # row values that became computable after this pass (a merged pass ends two phases)
            for level in range(phase + 1, phase + 2 + bool(online)):
                if level == phase + 2:
                    after += online_finish(online, producers)
                    done.update(o.total for o in online)
                for name in order:
                    kind, item = producers[name]
                    if name not in done and name not in kernel.varying \
                            and kernel.level.get(name, 0) == level and not isinstance(item, Reduce):
                        after.append(line(name))
                        done.add(name)
            names = ", ".join(r.op for r in reds)
            comment = f"Phase {phase}: one pass over the row for {names}."
            if online:
                comment = (f"Phases {phase} and {phase + 1} in one pass over the row: {names}, and "
                           + ", ".join(f"the sum of exp(x - {o.peak})" for o in online)
                           + " (online softmax).")
            loops.append({"comment": comment, "before": before,
                          "header": "for k_start in range(0, n_k, RBLOCK):",
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

    passes = ""
    if not persistent:
        online = any(o for _, o in looped_passes(kernel))
        passes = (f"{sum(bool(sec['header']) for sec in loops)} pass(es) over each row"
                  + (" (online softmax: the max and the sum of exponentials share one)."
                     if online else "."))
    helpers = _helpers_in(row_lines + [l for sec in loops for part in ("before", "body", "after")
                                       for l in sec[part]])
    big = max([kernel.numel] + [_max_address(a.index, kernel.row_shape + kernel.k_shape)
                                for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1
    return render_template(
        "triton_reduction.py.j2", name=kernel.name, summary=_summary(kernel),
        source_shape=kernel.source_shape, reduce_dims=kernel.reduce_dims, rows=kernel.rows,
        k=kernel.k, xblock=xblock, rblock=rblock, num_warps=num_warps, persistent=persistent,
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params], passes=passes,
        row_start="pid.to(tl.int64) * XBLOCK" if big else "pid * XBLOCK",
        row_lines=row_lines, sections=loops)


def looped_passes(kernel) -> list[tuple[int, list]]:
    """The passes a looped kernel makes over each row before its store pass, as (phase, online
    sums folded into that pass). Phase p + 1 folds into phase p's pass when every reduction of
    p + 1 is a sum of exp(v - max) whose max is reduced in phase p (`kernel.online`, found by
    codegen/lower.py): softmax then reads its row twice (max and sum together, then the store
    pass) instead of three times, logsumexp once instead of twice. Layer norm's variance needs the
    mean first and keeps its two passes.
    """
    by_total = {o.total: o for o in kernel.online}
    reductions = [i for i in kernel.body if isinstance(i, Reduce)]
    passes, phase = [], 0
    while phase < kernel.phases:
        folded = [r for r in reductions if r.phase == phase + 1]
        if folded and all(r.var.name in by_total for r in folded):
            passes.append((phase, [by_total[r.var.name] for r in folded]))
            phase += 2
        else:
            passes.append((phase, []))
            phase += 1
    return passes


# Note (online softmax): each lane of the [XBLOCK, RBLOCK] tile keeps its running max m and the
# sum s of exp(x - m) over the values it has seen. When a new value raises the max to m', the old
# sum is rescaled, s' = s * exp(m - m') + exp(x - m'), so max and sum come out of one pass over
# the row. At the end the lanes are combined the same way: M = max over lanes, S = sum over lanes
# of s * exp(m - M). fusec_exp_shift(x, m) is exp(x - m) except that x == m gives 1 even when
# both are infinite: a lane whose values are all -inf counts them (instead of turning NaN from
# -inf - -inf), and a +inf max counts as one term of 1. S is then moved to the shift c that the
# program subtracts, S * exp(M - c): exactly 1 when c is the max, and NaN when the max is
# infinite (exp(inf - inf)), which is what the two-pass sum of exp(x - M) gives; logsumexp's
# c = where(|M| == inf, 0, M) gets 0 for an all -inf row and inf for a row holding +inf, as eager.
# NaN propagates through fusec_maximum into m and from there into s.

def online_update(peak, x: str, combine: str, online: list) -> list[str]:
    """Loop body lines: raise the running max `acc_<peak>` and rescale the sums that share it."""
    acc, new = f"acc_{peak.var.name}", f"max_{peak.var.name}"
    lines = ["# online softmax: where a lane's max grows, rescale the sum it kept against the old one",
             f"{new} = tl.where(mask, {combine}, {acc})"]
    for o in online:
        total = f"acc_{o.total}"
        lines += [f"{total} = {total} * fusec_exp_shift({acc}, {new})",
                  f"{total} = {total} + tl.where(mask, fusec_exp_shift({x}, {new}), 0.0)"]
    return lines + [f"{acc} = {new}"]


def online_finish(online: list, producers: dict) -> list[str]:
    """Lines after the loop: each online sum's lanes rescaled to the row's max, added up, and
    moved from the max to the program's shift (see the note above)."""
    lines = []
    for o in online:
        lines.append(f"# every lane's sum rescaled to the row's max {o.peak} and added up, then times")
        if o.shift == o.peak:
            lines.append(f"# exp({o.peak} - {o.peak}): 1, or NaN for an infinite max as in exp(x - max)")
        else:
            lines.append(f"# exp({o.peak} - {o.shift}): the program subtracts {o.shift}, not the max")
        lines.append(f"{o.total} = tl.sum(acc_{o.total} * fusec_exp_shift(acc_{o.peak}, {o.peak}), 1)"
                     f"[:, None] * fusec_exp({o.peak} - {o.shift})  # {producers[o.total][1].origin}")
    return lines


def reduce_line(r, reduce_block) -> str:
    return f"{r.var.name} = {reduce_block(r, r.operand.name)}  # {r.origin}"


# ---- GEMV: a small-M matmul with its dequantization prologue (passes/small_matmul.py) --------
#
# Note (GEMV kernels): the generic reduction template gives each row of the output, here each
# (m, n) pair, its own pass over K, so with M rows the weight is streamed M times. A GEMV keeps
# all M rows of a block of output columns in one program instead: the weight tile is loaded (and
# dequantized) once and multiplied by every activation row while it sits in registers. The
# kernel IR is the same ReductionKernel; only the walk differs, so the CPU backends (which
# already read a row's K elements contiguously) keep their reduction templates.

GEMV_MAX_M = 16  # activation rows kept in registers; passes/small_matmul.py stays below this
GEMV_TILE = 8192  # f32 partial sums per program, [BLOCK_M, BLOCK_N, BLOCK_K]: 64 per thread
GEMV_WEIGHT_TILE = 4096  # weight elements per program per iteration, [BLOCK_N, BLOCK_K]


def gemv_fits(kernel) -> bool:
    """A GEMV-shaped reduction: one sum over K, rows (M, N) or (N,) with M small, no element
    values stored (those need the generic walk)."""
    reds = [i for i in kernel.body if isinstance(i, Reduce)]
    return (kernel.gemv is not None and len(reds) == 1 and reds[0].op == "sum"
            and 1 <= len(kernel.row_shape) <= 2 and kernel.k > 0 and kernel.rows > 0
            and (len(kernel.row_shape) == 1 or kernel.row_shape[0] <= GEMV_MAX_M)
            and not any(s.var.name in kernel.varying for s in kernel.stores))


SMS = 132  # streaming multiprocessors of an H100/H200: the grid should cover each at least twice


def gemv_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). All M rows in one block; 4 warps. Output columns
    per program: 8 at M = 1, fewer as M grows (the partial sums are M x BLOCK_N x BLOCK_K
    registers), and fewer for narrow layers so that there are about 2 programs per SM (a
    1024-wide key/value projection gets 2 columns per program, 512 programs, rather than 64
    programs that leave half the GPU idle). BLOCK_K: a 4096-element weight tile per iteration
    within the partial-sum budget. Chosen from `benchmarks/quant_linear.py --sweep` on an H100
    (docs/gpu.md): at M = 1, K = N = 8192, 8 x 512 x 4 warps streamed int8 weights at 1.65 TB/s,
    16 x 1024 x 8 warps at 1.47 and 32 columns at under 1.0."""
    block_m = 1 << max(m - 1, 0).bit_length()
    block_n = min(8 if block_m == 1 else max(2, 16 // block_m),
                  1 << max(n // (2 * SMS), 1).bit_length() - 1)
    block_k = min(max(16, GEMV_WEIGHT_TILE // block_n), max(16, GEMV_TILE // (block_m * block_n)),
                  max(16, 1 << max(k - 1, 0).bit_length()))
    num_warps = 4
    return block_m, block_n, block_k, num_warps


def gemv_dot_blocks(m: int, n: int, k: int, terms: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core GEMV (M > 1).
    tl.dot needs every dim >= 16, so the M rows are padded to 16 (the padding rows cost tensor-core
    time, which a weight-streaming kernel has plenty of). A 32 x 256 weight tile per iteration:
    BLOCK_K counts stored elements, so a packed int4 byte (two dots, `terms` = 2) gets 128. 16
    columns per program when 32 would leave SMs idle. From `benchmarks/quant_linear.py --sweep`
    on an H200 (docs/gpu.md), K = N = 8192: int8 at M = 4 and 16 streamed 1.39 TB/s with 32 x 256
    (16 x 256: 1.04, 64 x 128: 1.16-1.20), packed int4 0.30-0.45 with 32 or 64 x 128."""
    block_m = max(16, 1 << max(m - 1, 0).bit_length())
    block_n = 32 if n >= 32 * SMS else 16
    block_k = max(16, min(256 // terms, 1 << max(k - 1, 0).bit_length()))
    return block_m, block_n, block_k, 4, 3


GEMV_STAGES = 3  # software-pipelining depth of the lane version's K loop (Triton's default)
GEMV_DOT_MIN_M = 2  # from this many rows on, tensor-core dots (benchmarks/quant_linear.py --sweep)
BF16_EXACT_INTS = (torch.int8, torch.uint8)  # every value of these is a bf16 number


def dot_terms(kernel, operand: str, producers: dict, n_rows: int) -> list[tuple[str, str]] | None:
    """The reduction's operand as a sum of products x * w, with x varying along (m, k) only and
    w along (n, k) only, both exactly bf16 numbers: then a tensor-core dot of bf16 tiles with a
    float32 accumulator computes exactly the products the lanes version adds (bf16 x bf16 fits
    a float32 mantissa), in another order. None when the operand has another form."""
    axes_of: dict[str, frozenset] = {}

    def axes(name: str) -> frozenset:
        if name not in axes_of:
            item = producers[name]
            if isinstance(item, Stmt):
                out = frozenset().union(*[axes(o.name) for o in item.operands
                                          if not isinstance(o, Const)])
            else:
                st = item.index.strides
                out = frozenset(ax for ax, s in zip("mn"[2 - n_rows:], st[:n_rows]) if s)
                out |= {"k"} if any(st[n_rows:]) else frozenset()
            axes_of[name] = out
        return axes_of[name]

    def exact(name: str) -> bool:
        item = producers[name]
        if not isinstance(item, Stmt):
            return item.dtype == torch.bfloat16 or item.dtype in BF16_EXACT_INTS
        if item.round_to == torch.bfloat16 or item.var.dtype in (torch.bfloat16, *BF16_EXACT_INTS):
            return True
        return item.op in ("to", "copy") and not isinstance(item.operands[0], Const) \
            and exact(item.operands[0].name)

    def terms(name: str):
        item = producers[name]
        if not isinstance(item, Stmt) or any(isinstance(o, Const) for o in item.operands):
            return None
        if item.op == "add":
            a, b = (terms(o.name) for o in item.operands)
            return None if a is None or b is None else a + b
        if item.op != "mul":
            return None
        a, b = (o.name for o in item.operands)
        x_axes = frozenset("mk") if n_rows == 2 else frozenset("k")
        if axes(b) <= x_axes and "n" in axes(a):
            a, b = b, a
        if not (axes(a) <= x_axes and axes(b) <= frozenset("nk") and exact(a) and exact(b)):
            return None
        return [(a, b)]

    return terms(operand)


def k_terms(strides: tuple[int, ...], k_shape: tuple[int, ...]) -> list[str]:
    """Address terms along K. A tensor whose K dims are back to back in memory (the packed
    weight, viewed as (K/G, G/2) groups) is addressed by the flat `ks` itself, so Triton sees
    consecutive addresses and emits wide vector loads; others (a per-group scale) by coordinates.
    """
    whole = all(strides[d] == strides[d + 1] * k_shape[d + 1] for d in range(len(k_shape) - 1))
    if whole and strides[-1]:
        return ["ks" if strides[-1] == 1 else f"ks * {strides[-1]}"]
    return [f"k{d}" if st == 1 else f"k{d} * {st}" for d, st in enumerate(strides) if st]


def render_gemv(kernel) -> str:
    (r,) = [i for i in kernel.body if isinstance(i, Reduce)]
    two = len(kernel.row_shape) == 2
    m, n = (kernel.row_shape if two else (1, kernel.row_shape[0]))
    producers = {l.var.name: l for l in kernel.loads}
    producers.update((item.var.name, item) for item in kernel.body)
    # M > 1: the products as tensor-core dots, when the operand is a sum of exact bf16 products
    dot = dot_terms(kernel, r.operand.name, producers, 2) if two and m >= GEMV_DOT_MIN_M else None
    if dot:
        block_m, block_n, block_k, num_warps, num_stages = gemv_dot_blocks(m, n, kernel.k, len(dot))
    else:
        (block_m, block_n, block_k, num_warps), num_stages = gemv_blocks(m, n, kernel.k), GEMV_STAGES
    n_rows = len(kernel.row_shape)
    row_axes = ["m", "n"] if two else ["n"]
    k_coords = []
    for d in range(len(kernel.k_shape)):
        below = math.prod(kernel.k_shape[d + 1:])
        expr = "ks" if below == 1 else f"(ks // {below})"
        k_coords.append(f"k{d} = {expr}" + ("" if d == 0 else f" % {kernel.k_shape[d]}"))

    def index(idx: Index) -> tuple[str, str | None]:
        terms, masks = [], []
        for axis, st in zip(row_axes, idx.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks.append(f"{axis}_mask")
        kterms = k_terms(idx.strides[n_rows:], kernel.k_shape)
        if kterms:
            masks.append("k_mask")
        terms += kterms
        if not terms:
            terms = ["tl.zeros([1, 1, 1], tl.int32)"]  # one element, the same for every lane
        addr = " + ".join(([str(idx.offset)] if idx.offset else []) + terms)
        return addr, (" & ".join(masks) or None)

    group = kernel.k_shape[-1] if len(kernel.k_shape) == 2 else 0

    def per_group(idx: Index) -> bool:
        """A value constant within each group of K (a per-group scale or zero point: it varies
        along the group dim k0 only), when the chunk holds whole groups."""
        ks_ = idx.strides[n_rows:]
        return bool(group > 1 and len(ks_) == 2 and ks_[0] and not ks_[1]
                    and block_k % group == 0)

    def load_line(l) -> str:
        if l.var.name in kernel.varying and per_group(l.index):
            return group_load_lines(l)
        addr, mask = index(l.index)
        value = f"tl.load({l.param}_ptr + {addr}" + (f", mask={mask})" if mask else ")")
        if l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        return f"{l.var.name} = {value}"

    def group_load_lines(l) -> str:
        # one load per group of the chunk, then each value repeated over its group's lanes
        terms, masks = [], ["g_mask"]
        for axis, st in zip(row_axes, l.index.strides[:n_rows]):
            if st:
                terms.append(axis if st == 1 else f"{axis} * {st}")
                masks.append(f"{axis}_mask")
        st = l.index.strides[n_rows]
        terms.append("gs" if st == 1 else f"gs * {st}")
        addr = " + ".join(([str(l.index.offset)] if l.index.offset else []) + terms)
        value = f"tl.load({l.param}_ptr + {addr}, mask={' & '.join(masks)})"
        if l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        lead = ["BLOCK_M" if two and l.index.strides[0] else "1",
                "BLOCK_N" if l.index.strides[n_rows - 1] else "1"]
        return (f"{l.var.name} = tl.reshape(tl.broadcast_to(({value})[:, :, :, None], "
                f"[{lead[0]}, {lead[1]}, BLOCK_K // {group}, {group}]), "
                f"[{lead[0]}, {lead[1]}, BLOCK_K])")

    order = [l.var.name for l in kernel.loads] + [item.var.name for item in kernel.body]
    helpers: set = set()

    def line(name: str) -> str:
        item = producers[name]
        if isinstance(item, Stmt):
            return _stmt(item, helpers, block="[1, 1, 1]")
        return load_line(item)

    row_lines, epilogue = [], []
    for name in order:
        item = producers[name]
        if name in kernel.varying or isinstance(item, Reduce):
            continue
        (row_lines if kernel.level.get(name, 0) == 0 else epilogue).append(line(name))
    value = convert("sums", r.acc_dtype, r.var.dtype)
    if r.round_to is not None:
        value = convert(convert(value, r.var.dtype, r.round_to), r.round_to, r.var.dtype)
    epilogue.insert(0, f"{r.var.name} = {value}  # {r.origin}")

    wanted = {name for pair in dot for name in pair} if dot else {r.operand.name}
    needed = kernel.values_needed(wanted, only_varying=True)
    loop_lines = ["# load this chunk of K: each value with the extent it varies along"]
    loop_lines += [line(n) for n in needed if not isinstance(producers[n], Stmt)]
    stmts = [n for n in needed if isinstance(producers[n], Stmt)]
    unpack = any(producers[n].op in ("rshift", "bitwise_and") for n in stmts)
    loop_lines.append("# prologue: dequantize the weight tile in registers, then multiply")
    if unpack:
        loop_lines.append("# (this is where the int4 nibbles are unpacked: w & 0x0F is the low "
                          "4-bit weight of each byte, w >> 4 the high one)")
    loop_lines += [line(n) for n in stmts]
    operand = convert(r.operand.name, r.operand.dtype, r.acc_dtype)
    dot_lines = []
    for i, (x, w) in enumerate(dot or []):
        dot_lines += [
            f"x_tile{i} = tl.reshape(tl.broadcast_to(tl.where(k_mask, {x}, 0.0), "
            f"[BLOCK_M, 1, BLOCK_K]), [BLOCK_M, BLOCK_K])",
            f"w_tile{i} = tl.reshape(tl.broadcast_to(tl.where(k_mask, {w}, 0.0), "
            f"[1, BLOCK_N, BLOCK_K]), [BLOCK_N, BLOCK_K])",
            f"acc += fusec_dot_bf16(x_tile{i}, w_tile{i})"]
    helpers |= {"fusec_dot_bf16"} if dot else set()

    stores = []
    for s in kernel.stores:
        addr, mask = index(s.index)
        stores.append(f"tl.store({s.param}_ptr + {addr}, {convert(s.var.name, s.var.dtype, s.dtype)}"
                      + (f", mask={mask})" if mask else ")"))
    # the weight: what varies along n and k but not m
    weights = sorted({short(l.dtype) for l in kernel.loads if l.var.name in kernel.varying
                      and l.index.strides[n_rows - 1] and not (two and l.index.strides[0])})
    big = max([kernel.numel] + [_max_address(a.index, kernel.row_shape + kernel.k_shape)
                                for a in [*kernel.loads, *kernel.stores]]) >= 2 ** 31 - 1
    group_lines = []
    if any("gs" in line for line in loop_lines):
        group_lines = [f"# the groups of {group} along K in this chunk: their scales and zero points "
                       f"are loaded once each",
                       f"gs = k_start // {group} + tl.arange(0, BLOCK_K // {group})[None, None, :]",
                       f"g_mask = gs < {kernel.k_shape[0]}"]
    programs = -(-n // block_n)
    helpers |= _helpers_in(row_lines + loop_lines + epilogue + stores)
    return render_template(
        "triton_gemv.py.j2", name=kernel.name, summary=_summary(kernel), m=m, n=n, k=kernel.k,
        block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, programs=programs,
        num_stages=num_stages, dot_lines=dot_lines,
        weight_dtypes=", ".join(weights) or "as stored",
        unpack_note=" (unpacking the int4 nibbles)" if unpack else "",
        acc_dtype=short(r.acc_dtype), acc_tl=TL[r.acc_dtype],
        n_start="pid.to(tl.int64) * BLOCK_N" if big else "pid * BLOCK_N",
        helpers=sorted(helpers), params=[f"{p.name}_ptr" for p in kernel.params],
        args=[p.name for p in kernel.params], row_lines=row_lines,
        loop_lines=[c for c in k_coords if re.search(rf"\b{c.split(' ')[0]}\b", "\n".join(
            row_lines + loop_lines + epilogue + stores))] + group_lines + loop_lines,
        operand=operand, epilogue=epilogue, stores=stores)

