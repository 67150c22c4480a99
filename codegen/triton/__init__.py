"""Triton backend: PointwiseKernel -> a Python module holding one @triton.jit kernel + launcher.

The kernel follows Triton's vector-add tutorial: the flat iteration space is cut into blocks of
BLOCK_SIZE, `offsets` are this block's positions, `mask` switches off the lanes past the end.
Inputs read through views or broadcasts compute their address from per-dimension coordinates;
plain contiguous inputs read `x_ptr + offsets` directly.

The module is written to the fusec cache (keyed by the hash of its text) and imported from there,
so Triton can read its source; Triton caches the compiled GPU binary itself. On a machine without
a GPU the same module runs under Triton's interpreter (TRITON_INTERPRET=1).

This file renders pointwise kernels (flat or tiled) and writes, builds and loads modules;
triton/text.py spells the IR, triton/reduction.py renders reductions; a kernel family
(codegen/families.py) renders the kernels of its form instead.
"""
from __future__ import annotations

import hashlib
import importlib.util
import marshal
import math
import sys
import threading
from pathlib import Path

from fusec import cache, ops
from fusec.ir import Index, PointwiseKernel
from fusec.symbolic import hint, py_expr
from fusec.runtime.fast_start.pdl import pdl as pdl_on
from fusec.runtime.fast_start.triton_launch import TritonLauncher

from .. import families
from . import keys as triton_keys
from ..render import render_template
from .reduction import PERSISTENT_MAX_K, is_column_reduction  # noqa: F401 (read as triton.X)
from .reduction import render_reduction
from .text import (helpers_in, max_address, render_stmt, ops_summary, block_size, convert,
                   gather_offset, piece_mask, size, same, cdiv, needs_int64, is_flat,
                   size_arguments, kernel_sizes)


def render(kernel, arch: int | None = None) -> str:
    """The kernel's module source. `arch` (80, 90, ...) renders it for that NVIDIA GPU instead
    of this process's (codegen/triton/target.py): only a kernel family's choices depend on it."""
    special, notes = None, []
    if not kernel_sizes(kernel):  # (a family's kernels take no sizes: a shape family's are general)
        special, notes = families.special(kernel, "triton", arch)  # a kernel family's, if one takes it
    if special is not None:
        return special
    if not isinstance(kernel, PointwiseKernel):
        return render_reduction(kernel, arch, notes)
    tiles = tiling(kernel)
    if tiles is not None:
        return render_tiled(kernel, *tiles, arch)
    shape = kernel.shape
    numel = kernel.numel
    widths = tuple(a.dtype.itemsize for a in [*kernel.loads, *kernel.stores])
    # (from the traced sizes where they are symbols: see the note on shape families in text.py)
    block, num_warps = block_size(hint(numel), widths)
    flat = [is_flat(l.index, shape) for l in kernel.loads] + \
           [is_flat(s.index, shape) for s in kernel.stores]
    coords = []
    if not all(flat) or any(l.valid for l in kernel.loads):
        for d in range(len(shape)):
            below = math.prod(shape[d + 1:])
            expr = "offsets" if same(below, 1) else f"(offsets // {size(below)})"
            coords.append(f"i{d} = {expr}" + ("" if d == 0 else f" % {size(shape[d])}"))

    def index(idx: Index) -> str:
        if is_flat(idx, shape):
            return "offsets"
        terms = [f"i{d}" if same(s, 1) else f"i{d} * {size(s)}"
                 for d, s in enumerate(idx.strides) if not same(s, 0)]
        if not terms:  # every lane reads one element: still a block of addresses, for the mask
            terms = ["tl.zeros_like(offsets)"]
        return " + ".join(([size(idx.offset)] if not same(idx.offset, 0) else []) + terms)

    loads, body, stores = pointwise_lines(kernel, index, "[BLOCK_SIZE]")
    big = needs_int64([numel] + [max_address(a.index, shape) + _reach(a)
                                 for a in [*kernel.loads, *kernel.stores]])
    helpers = helpers_in(loads + body + stores)
    return render_template(
        "triton_pointwise.py.j2",
        name=kernel.name, summary=ops_summary(kernel), source_shape=kernel.source_shape,
        loop_shape=shape, numel=numel, numel_text=py_expr(numel), block=block,
        blocks=cdiv(numel, block, "cdiv"), num_warps=num_warps, helpers=sorted(helpers),
        params=[f"{p.name}_ptr" for p in kernel.params], args=[p.name for p in kernel.params],
        block_start="pid.to(tl.int64) * BLOCK_SIZE" if big else "pid * BLOCK_SIZE",
        coords=coords, loads=loads, body=body, stores=stores, pdl=pdl_on(arch),
        **size_arguments(kernel, [("n_elements", numel, False)]))


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
        unit = [d for d, st in enumerate(a.index.strides) if same(st, 1) and hint(shape[d]) > 1]
        if unit:
            along.append(unit[-1])
    others = [d for d in along if d != xdim]
    # (a choice of speed: the traced sizes decide where sizes are symbols; both forms are right)
    if not others or xdim not in along or hint(shape[xdim]) < TILE_MIN:
        return None
    ydim = max(set(others), key=others.count)
    if hint(shape[ydim]) < TILE_MIN:
        return None
    return ydim, xdim


def render_tiled(kernel: PointwiseKernel, ydim: int, xdim: int, arch: int | None = None) -> str:
    shape = kernel.shape
    ysize, xsize = shape[ydim], shape[xdim]
    yblock = min(64, 1 << (hint(ysize) - 1).bit_length())
    xblock = min(64, 1 << (hint(xsize) - 1).bit_length())
    # (as (n + block - 1) // block: Triton's `//` rounds toward zero, so -(-n // block) is not it)
    y_tiles, x_tiles = (ysize + yblock - 1) // yblock, (xsize + xblock - 1) // xblock
    others = [d for d in range(len(shape)) if d not in (ydim, xdim)]
    programs = y_tiles * x_tiles * math.prod(shape[d] for d in others)
    rest = []
    for j, d in enumerate(others):
        below = math.prod(shape[o] for o in others[j + 1:])
        expr = "rest" if same(below, 1) else f"(rest // {size(below)})"
        rest.append(f"i{d} = {expr}" + ("" if j == 0 else f" % {size(shape[d])}"))
    big = needs_int64([kernel.numel] + [max_address(a.index, shape) + _reach(a)
                                        for a in [*kernel.loads, *kernel.stores]])
    block = "[YBLOCK, XBLOCK]"

    def index(idx: Index) -> str:
        terms = [f"i{d}" if same(st, 1) else f"i{d} * {size(st)}"
                 for d, st in enumerate(idx.strides) if not same(st, 0)]
        if not any(t.split(" ")[0] in (f"i{ydim}", f"i{xdim}") for t in terms):
            terms.append(f"tl.zeros({block}, tl.int32)")  # the same element in every lane
        return " + ".join(([size(idx.offset)] if not same(idx.offset, 0) else []) + terms)

    loads, body, stores = pointwise_lines(kernel, index, block)
    names = [p.name for p in kernel.params]
    along = {d: [a.param for a in [*kernel.loads, *kernel.stores] if same(a.index.strides[d], 1)]
             for d in (ydim, xdim)}
    why = "; ".join(f"dim {d}: {', '.join(dict.fromkeys(along[d]))}" for d in (ydim, xdim))
    sized = size_arguments(kernel, [("y_tiles", y_tiles, False), ("x_tiles", x_tiles, False)]
                           if kernel_sizes(kernel) else [])
    if sized["sizes"]:  # the tile counts are computed first thing in the kernel (size_lines)
        y_tiles, x_tiles = "y_tiles", "x_tiles"
    return render_template(
        "triton_pointwise_tiled.py.j2",
        name=kernel.name, summary=ops_summary(kernel), source_shape=kernel.source_shape,
        loop_shape=shape, numel=kernel.numel, ydim=ydim, xdim=xdim, ysize=size(ysize),
        xsize=size(xsize), yblock=yblock, xblock=xblock, y_tiles=y_tiles, x_tiles=x_tiles,
        xy_tiles=f"({x_tiles} * {y_tiles})" if sized["sizes"] else x_tiles * y_tiles,
        programs=py_expr(programs),
        pid="tl.program_id(axis=0).to(tl.int64)" if big else "tl.program_id(axis=0)",
        rest=rest, why=why, num_warps=4, helpers=sorted(helpers_in(loads + body + stores)),
        params=[f"{n}_ptr" for n in names], args=names, loads=loads, body=body, stores=stores,
        pdl=pdl_on(arch), **sized)


def _reach(access) -> int:
    """How far past its index an indexed write may store (the last position along its dim)."""
    at = getattr(access, "scatter", None) or getattr(access, "gather", None)
    return (at[2] - 1) * abs(at[1]) if at else 0


def pointwise_lines(kernel: PointwiseKernel, index, block: str) -> tuple[list, list, list]:
    """(loads, statements, stores) of a pointwise kernel, with `index` writing an Index as an
    address expression: shared by the 1-D and the tiled template, which differ only there."""
    loads = []
    for l in kernel.loads:
        inside = piece_mask(l, kernel.shape)
        where = "mask" if inside is None else f"mask & {inside}"
        addr = index(l.index)
        if l.gather is not None:  # a gathered read: the row its index value names (fusec.ir.Load)
            loads.append(f"# {l.var.name}: the row of {l.param} that {l.gather[0]} names")
            addr = f"{addr} + {gather_offset(l)}"
        value = f"tl.load({l.param}_ptr + {addr}, mask={where})"
        if ops.register_dtype(l.dtype) != l.dtype or l.dtype != l.var.dtype:
            value = convert(value, l.dtype, l.var.dtype)
        if l.other is not None:  # a piece of a cat: the next piece's value where this one ends
            value = f"tl.where({inside}, {value}, {l.other.name})"
        loads.append(f"{l.var.name} = {value}")
    body = [render_stmt(s, set(), block) for s in kernel.stmts]
    stores = []
    for s in kernel.stores:
        value, where = convert(s.var.name, s.var.dtype, s.dtype), "mask"
        addr = index(s.index)
        if s.scatter is not None:  # an indexed write: `cache[:, :, pos] = k` (fusec.ir.Store)
            pos, stride, n = s.scatter
            stores += [f"# write at position {pos} along the buffer's dim of {n} (negative: "
                       "from the end; outside it: nothing, where eager would raise)",
                       f"{pos}_at = tl.where({pos} < 0, {pos} + {size(n)}, {pos})"]
            addr = f"{addr} + {pos}_at * {size(stride)}"
            where = f"mask & ({pos}_at >= 0) & ({pos}_at < {size(n)})"
        stores.append(f"tl.store({s.param}_ptr + {addr}, {value}, mask={where})")
    return loads, body, stores


def build(source: str, name: str) -> Path:
    """Write the module into the cache (unless it is there, intact). Triton compiles the kernel
    when it first launches it; a module is only text until then."""
    key = cache.content_hash(source)
    path = cache.cache_dir("triton") / f"{name}-{key}.py"
    try:
        intact = cache.read_bytes(path, touch=True) == source.encode()  # (this user's only)
    except OSError:
        intact = False
    if intact:
        cache.STATS["hits"] += 1
    else:
        if path.exists():
            cache.STATS["corrupt"] += 1
            cache.log(f"corrupt cache entry {path.name}: rewriting")
        cache.STATS["misses"] += 1
        path = cache.atomic_write(path, source)  # (elsewhere if the cache cannot be written)
        WRITTEN.add(path)
    return path


# Modules this process wrote (not found in the cache): their kernels have never been compiled
# here, so fusec/runtime/build.py compiles them in threads; the others most likely have been.
WRITTEN: set[Path] = set()


_KEYS: list[threading.Thread] = []  # the one thread that works out Triton's own key


def prepare(device) -> None:
    """Before the first compile for a GPU in this process, start working out Triton's own cache
    key in a thread. Every Triton compile, even one that finds its binary in Triton's cache,
    keys the cache by a hash of Triton's own sources and its 300 MB compiler library
    (`triton_key()`, computed once per process): 0.4 s on an H200's host, a quarter of a warm
    start. Reading and hashing a file leave Python's lock free, so the hash is done while the
    model is captured and the passes run; `launcher` waits for it before any kernel compiles.
    """
    if _KEYS or torch_device_type(device) != "cuda":
        return
    # remembered from an earlier process (codegen/triton/keys.py): nothing to hash
    remembered = triton_keys.remember(compute=False)

    def work_out():
        if not remembered:
            triton_keys.remember(compute=True)  # hashed here, then saved for the next process
        _ptxas_version(device)

    thread = threading.Thread(target=work_out, name="fusec-triton-key", daemon=True)
    _KEYS.append(thread)
    thread.start()


def _ptxas_version(device) -> None:
    """Triton's CUDA backend also keys its cache by `ptxas --version`, a process that Triton
    runs once per process (0.2 s on an H200's host, measured under a warm start): run it here,
    in the same thread, where waiting for it leaves Python's lock free. Best effort: the helper
    and its arguments differ between Triton releases, and the first compile runs it anyway."""
    try:
        import inspect

        import torch
        from triton.backends.nvidia.compiler import get_ptxas_version
        if inspect.signature(get_ptxas_version).parameters:
            major, minor = torch.cuda.get_device_capability(device)
            get_ptxas_version(major * 10 + minor)  # (positional, as Triton calls it)
        else:
            get_ptxas_version()
    except Exception:  # noqa: BLE001
        pass


def prepare_launch(compiled) -> None:
    """Make a kernel compiled ahead (fusec/runtime/build.py) ready to launch, in the compiling
    thread: Triton's `_init_handles` builds its host-side launcher and loads its binary onto the
    GPU, which a kernel otherwise does at its first launch.

    The launcher is a small C function made for the kernel's argument types, compiled with gcc
    and cached on disk: on a cold start that was most of a model's first run (1.9 s of
    BERT-base's on an H200), one gcc after another; here they compile side by side. On a warm
    start the launcher is in the cache, and doing it here, once, spares the first run its
    lookups. (Only building the launcher, as this did before, made the first launch look it up a
    second time.) Best effort: a Triton without this method does it all at the first launch."""
    try:
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        else:
            from triton.runtime.driver import driver
            driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:  # noqa: BLE001 - the first launch does it again, and reports any error
        pass


def torch_device_type(device) -> str:
    return device.type if hasattr(device, "type") else str(device).split(":")[0]


def launcher(path: Path, name: str, n_params: int, n_sizes: int = 0):
    """Import a written module (once per process) and wrap its `launch` in a TritonLauncher."""
    for thread in _KEYS:
        thread.join()  # (prepare: Triton's key, worked out while the model was captured)
    module_name = f"fusec_kernels.{path.stem.replace('-', '_')}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        exec(_bytecode(path), module.__dict__)  # (as exec_module, without compiling)
        sys.modules[module_name] = module
    return TritonLauncher(module, path, name, n_params, n_sizes)


def _bytecode(path: Path):
    """The module's compiled Python code, compiled once and kept beside it (`<name>.pyc`).

    Python keeps its own `.pyc` files in `__pycache__`, but not where PYTHONDONTWRITEBYTECODE is
    set, as on many containers: every warm start then compiled each kernel's module from its
    text again (3 ms each on a GPU host, 0.15 s for a ResNet-50's 42 modules). The saved code
    starts with this Python's magic number, a hash of the module's text and a hash of the code
    itself, so a stale, foreign or damaged file is compiled again, never run."""
    source = cache.read_bytes(path)  # a file this user wrote, nobody else can write
    saved = path.with_suffix(".pyc")
    stamp = importlib.util.MAGIC_NUMBER + hashlib.sha256(source).digest()[:16]
    try:
        data = cache.read_bytes(saved)  # (another user's file: refused, compiled below)
        code, check = data[len(stamp) + 16:], data[len(stamp):len(stamp) + 16]
        if data.startswith(stamp) and hashlib.sha256(code).digest()[:16] == check:
            return marshal.loads(code)
    except (OSError, EOFError, ValueError, TypeError):
        pass  # not there, or damaged: compiled below
    code = compile(source, str(path), "exec", dont_inherit=True)
    data = marshal.dumps(code)
    try:
        cache.atomic_write(saved, stamp + hashlib.sha256(data).digest()[:16] + data)
    except OSError:
        pass  # a read-only cache: compiled again next time
    return code


def load(kernel: PointwiseKernel, source: str):
    """Write the module into the cache (if not already there, intact) and import its launcher."""
    return launcher(build(source, kernel.name), kernel.name, len(kernel.params),
                    len(kernel_sizes(kernel)))
