"""The writer: a Program's steps written out once as Python, the text that runs and is shown.

`straight_line(program, ...)` turns the list of steps into `def run(inputs)`, one line per step,
with kernels, ATen ops and constants bound as globals, and compiles it; `Program.prepare` keeps
the result as `program.run`. See "Note: the per-call path" below for why.

`python_wrapper(program)` shows that program (it is part of `cf.source()`): every global of `run`
spelled as Python (`_fused_sin_0 = load_launcher(...)`), then the very text `run` was compiled
from, then `call(x, w)`, which calls it. One writer makes both, so what is shown is what runs;
exec the text and `call(...)` gives the same result (tests/test_wrapper.py).

Why this file is long: one writer spells every kind of step twice over (the text that runs, the
globals it reads as Python), for static programs and for shape families alike; split, a reader
would chase how one line of `run` is made across files.
"""
from __future__ import annotations

import keyword
import linecache
import math
from typing import Any, Callable

import torch
import torch.fx as fx

from fusec.ir import Layout, contiguous_strides
from fusec.symbolic import hint, is_symbolic, py_expr, rename
from fusec.runtime.family_pool import made_per_size, pooled_views
from fusec.runtime.steps import (CLONES_WHOLE_STORAGE, ExternStep, GetItemStep, KernelStep,
                                 OutputBuffer, SlotRef, ViewStep, check_index_values, own_storage,
                                 reinterpret_tensor, settle, settle_as)

# ---- the straight-line runner ------------------------------------------------------------------
#
# Note: the per-call path. A Program's steps are fixed for its input signature, so instead of
# walking them on every call (an env list, a loop, one method call per step, a list of data
# pointers built per launch), `straight_line` writes them out once as a Python function and
# compiles it, the way torch.compile's wrapper code (`output_code`) runs. For `torch.sin(x)`:
#
#     def run(inputs):
#         s0, = inputs
#         s1 = empty_like(_like)                  # sin: a fresh (1024,) torch.float32 buffer
#         _fused_sin_0(s0.data_ptr(), s1.data_ptr())
#         return [s1]
#
# `_like` (a one-element tensor expanded to the output's shape), `_fused_sin_0` (the kernel's
# ctypes function, CppLauncher.pointer_entry) and every other constant are globals of that
# function, bound when it is built. Nothing is looked up, rendered or walked per call; outputs are
# still allocated per call, so a later call never overwrites what an earlier one returned.
# `program.run.source` is the text; a traceback through it shows its lines.

def straight_line(program: "Program", aliases: dict, constants: dict, form: str) -> Callable:
    """Write `program` out as `def run(inputs)` (see the note above), compile it, return it."""
    w = _Writer(program)
    names = [w.define(slot) for slot in program.input_slots]
    if names:
        w.line(f"{', '.join(names)}{',' if len(names) == 1 else ''} = inputs",
               ", ".join(w.value_name(slot) for slot in program.input_slots))
    _bind_sizes(w, program, names)
    _carve_family_pool(w, program)
    for slot, tensor in program.constants:
        w.names[slot] = w.bind(tensor, "constant")
    last = last_uses(program)
    keep = set(program.output_slots) | set(program.input_slots)
    for i, step in enumerate(program.steps):
        _EMITTERS.get(type(step), _emit_any)(w, step)
        dead = [w.names.pop(s) for s in last.get(i, ())
                if s not in keep and s not in w.pooled and w.names.get(s, "").startswith("s")]
        if dead:  # as torch.compile's output code does: memory goes back as soon as it can
            w.line(f"del {', '.join(dead)}", "last use")
    w.line("return " + _result(w, program, aliases, constants, form))
    return w.build()


def _bind_sizes(w: "_Writer", program: "Program", names: list[str]) -> None:
    """A shape family's program reads each size symbol from its input once per call (Note: sizes
    as symbols in kernels, fusec/symbolic.py): `x_size0, x_size1 = s0.shape` when every size of
    `x` is one, else `x_size0 = s0.shape[0]`; strides alike."""
    by_input: dict = {}
    for symbol, name, k, kind, d in getattr(program, "size_bindings", ()):
        w.sizes[symbol] = name
        by_input.setdefault((k, kind), {})[d] = name
    w.inputs_of_sizes = {}
    for (k, kind), dims in by_input.items():
        attr = "shape" if kind == "size" else "stride()"
        rank = w.program.input_ranks[k] if hasattr(w.program, "input_ranks") else None
        if rank is not None and len(dims) == rank:
            targets = [dims[d] for d in range(rank)]
            w.line(f"{', '.join(targets)}{',' if rank == 1 else ''} = {names[k]}.{attr}",
                   "this call's sizes (a shape family's program)")
        else:
            for d, name in sorted(dims.items()):
                w.line(f"{name} = {names[k]}.{attr}[{d}]", "a size of this call (a shape family's program)")


def _carve_family_pool(w: "_Writer", program: "Program") -> None:
    """A shape family's intermediate buffers: this size's views of its pool, carved at the first
    call at a size and kept for the next (fusec/runtime/family_pool.py)."""
    pool = getattr(program, "family_pool", None)
    if pool is None or not pool.buffers:
        return
    bufs = [b for s in program.steps if isinstance(s, KernelStep) for b in s.writes if b.live]
    views = pooled_views(program.steps, {b.slot for b in bufs}, set(program.output_slots))
    factories = [(f, call) for f in made_per_size(program.steps, set(program.output_slots),
                                                   step_reads)
                 if (call := _extern_call(w, f)) is not None]
    at = {slot: k for k, slot in enumerate([b.slot for b in bufs] + [v.out_slot for v in views])}
    symbols = sorted(w.sizes.values())
    key = symbols[0] if len(symbols) == 1 else f"({', '.join(symbols)})"
    name = w.bind(pool, "pool", f"FamilyPool({str(pool.device)!r}, {pool.buffers!r})")
    kept = w.bind(pool.kept, "pool_views", f"{name}.kept")
    layouts = ", ".join(f"({w.size(tuple(b.shape))}, {w.size(tuple(b.stride))})" for b in bufs)
    w.line(f"_v = {kept}.get({key})", "this size's intermediate buffers, if kept")
    w.line("if _v is None:")
    made = "".join(f"({at[v.root]}, {w.size(tuple(v.layout.shape))}, "
                   f"{w.size(tuple(v.layout.stride))}, {w.size(v.layout.offset)}), " for v in views)
    more = "".join(f"{call}, " for _, call in factories)
    w.line(f"    _v = {name}.carve({key}, ({layouts}{',' if len(bufs) == 1 else ''}), "
           f"({made.rstrip()}), ({more.rstrip()}))", "a pool for this size: planned, allocated, "
           "carved, with its views and what depends on the sizes alone")
    w.line(f"{name}.in_use = _v", "(a CUDA graph captured now keeps it: cuda_graphs.py)")
    slots = [*(b.slot for b in bufs), *(v.out_slot for v in views),
             *(f.out_slot for f, _ in factories)]
    targets = [w.define(slot) for slot in slots]
    w.pooled = set(slots)  # (kept with the pool: no `del`, no view made per call)
    w.line(f"{', '.join(targets)}{',' if len(targets) == 1 else ''} = _v",
           ", ".join(w.value_name(slot) for slot in slots))


def step_reads(step) -> list[int]:
    """The slots a step reads."""
    if isinstance(step, KernelStep):
        return list(step.reads)
    if isinstance(step, ExternStep):
        found: list[int] = []
        for a in (step.args, step.kwargs):
            fx.node.map_aggregate(a, lambda v: found.append(v.slot) if isinstance(v, SlotRef) else v)
        return found
    if isinstance(step, ViewStep):
        return [step.root]
    if isinstance(step, GetItemStep):
        return [step.src]
    return []


def last_uses(program: "Program") -> dict[int, list[int]]:
    """Step index -> the slots whose last reader (or, if never read, whose writer) it is.

    A slot that is read nowhere dies where it is made: an extern op's result that nothing uses,
    say. Locals of the straight-line function are deleted there, so a buffer that ATen allocated
    for an extern call goes back to the allocator after its last reader instead of living until
    the call returns (which, in a CUDA graph's capture, would keep it in the graph's pool).
    """
    where: dict[int, int] = {}
    for i, step in enumerate(program.steps):
        for slot in _written_slots(step):
            where.setdefault(slot, i)
        for slot in step_reads(step):
            where[slot] = i
    out: dict[int, list[int]] = {}
    for slot, i in sorted(where.items()):
        out.setdefault(i, []).append(slot)
    return out


_PRESET = ("empty_like", "empty_strided")  # globals of every written function


class _Writer:
    """The text of a straight-line function and the globals it reads.

    Slot 3 is the local `s3`; a value that is the same on every call (a kernel, a template, an
    extern op, a constant argument) is a global with a readable name, `_fused_sin_0` say.
    """

    def __init__(self, program: "Program"):
        self.program = program
        self.lines: list[str] = []
        self.names: dict[int, str] = {}  # slot -> the expression that holds its value
        self.globals: dict[str, Any] = {"empty_like": torch.empty_like,
                                        "empty_strided": torch.empty_strided}
        # each global as Python, for the shown program (python_wrapper), after `setup`
        self.spelled: dict[str, str] = {"empty_like": "torch.empty_like",
                                        "empty_strided": "torch.empty_strided"}
        self.setup: list[str] = []
        self.sizes: dict = {}  # size symbol -> the local that holds its value on this call
        self.fixed: dict[int, torch.Tensor] = {}  # slot -> its tensor, the same on every call
        self.pooled: set = set()  # slots a shape family's pool keeps for this call's sizes
        self.hidden: set | None = None  # see _hidden_buffers

    def size(self, x) -> str:
        """A size, a shape or a stride tuple as Python: a symbolic one over this call's sizes."""
        if isinstance(x, (tuple, list)):
            inner = [self.size(v) for v in x]
            text = ", ".join(inner)
            return f"({text}{',' if len(inner) == 1 else ''})" if isinstance(x, tuple) else f"[{text}]"
        return py_expr(x, self.sizes)

    def define(self, slot: int) -> str:
        self.names[slot] = f"s{slot}"
        return self.names[slot]

    def bind(self, value: Any, hint: str, spelling: str | None = None) -> str:
        """A global holding `value`, named after `hint`; `spelling` is the Python that makes it
        in the shown program (by default `spell(value)`)."""
        base = "_" + "".join(c if c.isalnum() else "_" for c in hint)
        name, n = base, 1
        while name in self.globals:
            name, n = f"{base}_{n}", n + 1
        self.globals[name] = value
        self.spelled[name] = spelling or spell(value) or \
            f"...  # a {type(value).__name__} made while compiling: {_short(value)}"
        return name

    def line(self, text: str, comment: str = "") -> None:
        self.lines.append(f"    {text}" + (f"  # {comment}" if comment else ""))

    def value_name(self, slot: int) -> str:
        """The graph's name for a slot's value (`sin`), for comments."""
        names = getattr(self.program, "slot_names", None)
        return names[slot] if names else f"slot {slot}"

    def build(self) -> Callable:
        source = "def run(inputs):\n" + "\n".join(self.lines) + "\n"
        filename = f"<fusec straight-line program {id(self.program):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.globals)
        run = self.globals["run"]
        run.source = source
        run.definitions = self.setup + [f"{n} = {s}" for n, s in self.spelled.items()
                                        if n not in _PRESET or f"{n}(" in source]
        return run


def _emit_kernel(w: _Writer, step: KernelStep) -> None:
    """Outputs (fresh, or the program's pool views), then the launch."""
    for buf in step.writes:
        view = step.planned.get(buf.slot)
        if buf.inplace is not None:  # written over an input read here for the last time
            _emit_reinterpreted(w, buf.slot, buf.inplace, (buf.shape, buf.stride, 0),
                                f"written over {w.value_name(buf.inplace)}, its last use")
        elif buf.live is not None:  # a shape family's: this size's view of its pool (above)
            w.line(f"# {w.names[buf.slot]}: {w.value_name(buf.slot)}, in this size's pool")
        elif view is not None:  # carved out of the pool once: the same memory on every call
            w.names[buf.slot] = w.bind(view, w.value_name(buf.slot), _pool_view(w, buf))
            w.fixed[buf.slot] = view
            w.line(f"# {w.names[buf.slot]}: a view of the pool, bytes [{buf.offset}, "
                   f"{buf.offset + buf.nbytes})")
        else:
            w.line(f"{w.define(buf.slot)} = {_allocation(w, buf, step.device)}",
                   f"{w.value_name(buf.slot)}: a fresh {w.size(buf.shape)} {buf.dtype} buffer")
    if not step.numel:
        w.line("pass", f"{step.name}: every output is empty, nothing to launch")
        return
    tensors = [w.names[r] for r in step.reads] + [w.names[b.slot] for b in step.writes]
    sizes = [w.sizes[s] for s in getattr(step, "sizes", ())]  # after the pointers, as ints
    entry = getattr(step.launcher, "pointer_entry", None)
    loaded = _loaded(step.launcher)
    serial = _serial_entry(step.launcher) if entry is None else None
    if entry is not None:  # a C function: called with the data pointers, as ints
        name = w.bind(entry, step.name, loaded and loaded + ".pointer_entry")
        w.line(f"{name}({', '.join([t + '.data_ptr()' for t in tensors] + sizes)})")
    elif serial is not None:  # an LLVM kernel that runs on this thread: all its work at once
        # (its launcher a global too: the launcher's JIT engine owns the function's code)
        keep = w.bind(step.launcher, step.name + "_launcher", loaded)
        name = w.bind(serial[0], step.name, f"{keep}.fn")
        w.line(f"{name}({', '.join([t + '.data_ptr()' for t in tensors] + ['0', str(serial[1])])})",
               "its whole range of work, on this thread")
    else:  # a Python launcher (Triton's grid launch, a parallel LLVM kernel): called with tensors
        w.line(f"{w.bind(step.launcher, step.name, loaded)}({', '.join(tensors + sizes)})")


def _serial_entry(launcher) -> tuple[Callable, int] | None:
    """(the C function, its amount of work) of an LLVM kernel whose one call on the calling
    thread always runs all its work: fixed sizes, and threads do not pay off (`parallel` false,
    a constant of its object file; fusec/codegen/llvm `LlvmLauncher`). The program calls that
    function itself, `fn(pointers..., 0, work)`, as it calls a C++ kernel's `pointer_entry`:
    what `LlvmLauncher.__call__` would do, without its frame, its list of pointers and its
    thread count (a microsecond a launch, tens of launches a training step). Else None."""
    if getattr(launcher, "n_sizes", 1) != 0 or getattr(launcher, "parallel", True) is not False \
            or not isinstance(getattr(launcher, "work", None), int) \
            or getattr(launcher, "fn", None) is None:
        return None
    return launcher.fn, launcher.work


def _loaded(launcher) -> str | None:
    """The Python that loads `launcher` again from its cached file (fusec/runtime/launchers.py)."""
    if not hasattr(launcher, "lib"):
        return None
    sizes = getattr(launcher, "n_sizes", 0)
    return (f"load_launcher({str(launcher.lib)!r}, {launcher.name!r}, {launcher.n_params}"
            + (f", {sizes})" if sizes else ")"))


def _pool_view(w: _Writer, buf: OutputBuffer) -> str:
    """The Python for a planned output's view of the pool (KernelStep.bind_pool makes it)."""
    pool = w.program.pool
    if not w.setup:
        w.setup.append(f"pool = torch.empty({pool.numel()}, dtype=torch.uint8, "
                       f"device={str(pool.device)!r})  # the intermediate buffers' memory")
    first = buf.offset // torch.empty((), dtype=buf.dtype).element_size()
    return (f"pool[{buf.offset}:{buf.offset + buf.nbytes}].view({buf.dtype})"
            f".as_strided({buf.shape}, {buf.stride}, {first})")


def _allocation(w: _Writer, buf: OutputBuffer, device: torch.device) -> str:
    """The expression that allocates a fresh output buffer.

    `torch.empty_like(t)`, where t is one element expanded to the buffer's shape, allocates a
    contiguous buffer of t's shape, dtype and device; it takes no keyword arguments to parse,
    which makes it the cheapest allocation from Python (~0.2 us less than `empty_strided` with
    `dtype=` and `device=`). Buffers with other strides use `empty_strided`.
    """
    if is_symbolic(buf.shape) or is_symbolic(buf.stride):  # a shape family's: this call's sizes
        same = _input_like(w, buf, device)
        if same is not None:  # an input with this very layout: the cheapest allocation
            return f"empty_like({same})"
        return (f"empty_strided({w.size(buf.shape)}, {w.size(buf.stride)}, "
                f"dtype={w.bind(buf.dtype, 'dtype')}, device={w.bind(device, 'device')})")
    shape, stride = hint(tuple(buf.shape)), hint(tuple(buf.stride))  # (a size fixed by a guard
    # may still be a SymInt of the family's ShapeEnv: its value, no new guard)
    meta = torch.empty((), dtype=buf.dtype, device="meta").expand(shape)
    if tuple(torch.empty_like(meta).stride()) == stride:
        like = torch.empty((), dtype=buf.dtype, device=device).expand(shape)
        spelled = f"torch.empty((), dtype={buf.dtype}, device={str(device)!r}).expand({shape})"
        return f"empty_like({w.bind(like, 'like', spelled)})"
    return (f"empty_strided({shape}, {stride}, dtype={w.bind(buf.dtype, 'dtype')}, "
            f"device={w.bind(device, 'device')})")


def _input_like(w: _Writer, buf: OutputBuffer, device) -> str | None:
    """The local of a program input whose shape, strides (as expressions), dtype and device are
    `buf`'s, if any: `empty_like` of it makes a buffer like `buf` (its guards fix its layout)."""
    from fusec.ir import contiguous_strides
    from fusec.symbolic import hashable
    if hashable(tuple(buf.stride)) != hashable(contiguous_strides(tuple(buf.shape))):
        return None  # (empty_like keeps only a dense input's strides: contiguous ones are sure)
    want = (hashable(tuple(buf.shape)), hashable(tuple(buf.stride)), buf.dtype, str(device))
    for slot, meta in zip(w.program.input_slots, getattr(w.program, "input_metas", ())):
        if meta is not None and (hashable(tuple(meta.shape)), hashable(tuple(meta.stride)),
                                 meta.dtype, str(meta.device)) == want and slot in w.names:
            return w.names[slot]
    return None


def _emit_extern(w: _Writer, step: ExternStep) -> None:
    """`s5 = _aten_mm_default(s1, s2)`, its arguments written out."""
    if step.out_slot in w.pooled:  # made with a shape family's pool, once per size
        w.line(f"# {w.names[step.out_slot]}: {w.value_name(step.out_slot)}, made once for this "
               "size")
        return
    call = _extern_call(w, step)
    if call is None:
        return _emit_any(w, step)
    w.line(f"{w.define(step.out_slot)} = {call}")


def _extern_call(w: _Writer, step: ExternStep) -> str | None:
    """The Python that calls an extern step's op, its result settled as planned (None: an
    argument that cannot be written out)."""
    try:
        args = [_argument(w, a) for a in step.args]
        if step.target in CLONES_WHOLE_STORAGE and args:  # see that note in runtime/steps.py
            args[0] = f"{w.bind(own_storage, 'own_storage', 'own_storage')}({args[0]})"
        for k, v in step.kwargs.items():
            if not k.isidentifier() or keyword.iskeyword(k):
                raise _NotWritable(f"keyword {k!r}")
            args.append(f"{k}={_argument(w, v)}")
    except _NotWritable:
        return None
    binding = PYTHON_BINDINGS.get(step.target) if not step.kwargs else None
    name = w.bind(binding, step.name, f"torch.{binding.__name__}") if binding else \
        w.bind(step.target, step.name)
    call = f"{name}({', '.join(args)})"
    if step.planned is not None and not _fresh_contiguous(step):  # ATen picks the strides:
        call = _settled(w, call, step.planned)                        # settle them as planned
    return call


# Note (an extern call through torch's own binding): calling an ATen op through its OpOverload
# (`torch.ops.aten.convolution.default(...)`) goes through the dispatcher's generic path, which
# reads every argument against the op's schema; the function torch generates for Python
# (`torch.convolution`) parses them with compiled code. Same op, same kernel, same result, and
# microseconds less a call on a CPU (docs/performance.md, "Per-call overhead"). The common extern
# ops of inference programs, called with positional arguments only, are written as the binding.
aten = torch.ops.aten
PYTHON_BINDINGS = {aten.convolution.default: torch.convolution, aten.mm.default: torch.mm,
                   aten.addmm.default: torch.addmm, aten.bmm.default: torch.bmm,
                   aten.baddbmm.default: torch.baddbmm}


# Note (results that need no settling). A product's result (`mm`, `addmm`, `bmm`, `baddbmm`,
# called without `out=`) is a new tensor in row-major order, whatever its operands' strides: ATen
# allocates it with no strides asked for. When the schedule planned that order too (strides
# equal to row-major ones wherever a dim has more than one element), `settle` would only compare
# strides and return the result; the call is written without it. A training step makes some
# forty such calls (BERT's linear layers and their gradients, a ResNet's 1x1 convolutions as
# products).
ROW_MAJOR_RESULTS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default,
                               aten.baddbmm.default})


def _fresh_contiguous(step: ExternStep) -> bool:
    """Whether the step's result is row-major by construction and planned so (the note)."""
    planned = step.planned
    if step.target not in ROW_MAJOR_RESULTS or "out" in step.kwargs \
            or is_symbolic(planned.shape) or is_symbolic(planned.stride) or planned.offset != 0:
        return False
    want = contiguous_strides(tuple(planned.shape))
    return all(n == 1 or a == b for n, a, b in zip(planned.shape, planned.stride, want))


def _settled(w: _Writer, call: str, planned: Layout) -> str:
    """`call`'s result settled to its planned layout (`settle`, fusec/runtime/steps.py): the
    Layout a global, or, in a shape family's program, the shape and strides of this call's sizes
    (`settle_as`)."""
    if is_symbolic(planned.shape) or is_symbolic(planned.stride):
        name = w.bind(settle_as, "settle_as", "settle_as")
        return f"{name}({call}, {w.size(tuple(planned.shape))}, {w.size(tuple(planned.stride))})"
    return f"{_settle(w)}({call}, {w.bind(planned, 'layout')})"


class _NotWritable(Exception):
    """An argument `_argument` cannot write out (a tensor inside a dict, say)."""


def _argument(w: _Writer, a: Any) -> str:
    """An extern call's argument as an expression: a slot's name, a literal, or a global."""
    if isinstance(a, SlotRef):
        return w.names[a.slot]
    if isinstance(a, torch.SymInt):  # a size of the shape family (`view(x_size0 * 64)`)
        return w.size(a)
    if type(a) in (int, bool, str) or a is None or (type(a) is float and math.isfinite(a)):
        return repr(a)
    if isinstance(a, (list, tuple)) and (_holds_slots(a) or is_symbolic(a)):
        if type(a) is not tuple and not isinstance(a, list):
            raise _NotWritable(type(a))  # a named tuple: left to ExternStep itself
        inner = [_argument(w, v) for v in a]
        if isinstance(a, list):
            return f"[{', '.join(inner)}]"
        return f"({', '.join(inner)}{',' if len(inner) == 1 else ''})"
    if _holds_slots(a):
        raise _NotWritable(type(a))
    return w.bind(a, "arg")


def _holds_slots(a: Any) -> bool:
    found = []
    fx.node.map_aggregate(a, lambda v: found.append(v) if isinstance(v, SlotRef) else v)
    return bool(found)


def _emit_view(w: _Writer, step: ViewStep) -> None:
    """A view for an extern call or an output. A view of memory that is the same on every call
    (a buffer carved out of the pool once, or a view of one) is made once, here, and kept as a
    global: an `as_strided` call costs about a microsecond, and a training step makes a hundred.
    Other views are made per call, as cheaply as each allows (`_emit_reinterpreted`); one the
    program returns stays a real view unless its buffer is hidden (`_hidden_buffers`)."""
    root, lay = w.names[step.root], step.layout
    if step.out_slot in w.pooled:  # carved with a shape family's pool, once per size
        w.line(f"# {w.names[step.out_slot]}: {w.value_name(step.out_slot)}, a view of {root} in "
               "this size's pool")
        return
    if step.out_slot in w.program.output_slots and step.root not in _hidden_buffers(w):
        # a real view (of an input, say): see the note on a view made per call, runtime/steps.py
        offset = "" if _is_zero(lay.offset) else f", {root}.storage_offset() + {w.size(lay.offset)}"
        w.line(f"{w.define(step.out_slot)} = {root}.as_strided({w.size(lay.shape)}, "
               f"{w.size(lay.stride)}{offset})", w.value_name(step.out_slot))
        return
    _emit_reinterpreted(w, step.out_slot, step.root, (lay.shape, lay.stride, lay.offset),
                        f"a view of {root}")


def _hidden_buffers(w: _Writer) -> set:
    """The buffers a kernel of this call allocates that the program returns only through one
    view: no one else sees them, so that view may be reinterpreted as torch.compile's output code
    returns it (its `_base` None instead of a buffer the caller never sees; nothing shares its
    version counter). Found once per program."""
    if w.hidden is None:
        outputs = w.program.output_slots
        seen = [s.root for s in w.program.steps if isinstance(s, ViewStep) and s.out_slot in outputs]
        fresh = {b.slot for s in w.program.steps if isinstance(s, KernelStep) for b in s.writes
                 if b.inplace is None and b.live is None and b.slot not in s.planned}
        w.hidden = {r for r in fresh if seen.count(r) == 1 and r not in outputs}
    return w.hidden


def _emit_reinterpreted(w: _Writer, slot: int, root_slot: int, layout: tuple, what: str) -> None:
    """`slot` as a view of `root_slot`'s memory, `layout` its (shape, stride, offset), a view
    the program alone reads (an extern call's argument, a kernel's output written over a buffer
    it reads for the last time).

    Its base the same on every call (a buffer carved out of the pool once): the view is made
    once, a global. Else `reinterpret_tensor(s3, (8, 4), (1, 8))`, made per call: the view
    without autograd's bookkeeping (see the note on a view made per call, runtime/steps.py), its
    offset past the base's own left out when it is 0, a number when it is one.
    """
    root, base = w.names[root_slot], w.fixed.get(root_slot)
    shape, stride, offset = tuple(layout[0]), tuple(layout[1]), layout[2]
    if base is not None and slot not in w.program.output_slots and not any(
            is_symbolic(v) for v in (*shape, *stride, offset)):
        view = base.as_strided(shape, stride, base.storage_offset() + offset)
        w.names[slot] = w.bind(view, w.value_name(slot), (
            f"{root}.as_strided({shape}, {stride}, {root}.storage_offset() + {offset})"))
        w.fixed[slot] = view
        w.line(f"# {w.names[slot]}: {what}, made once")
        return
    if "_reinterpret_tensor" not in w.globals:  # (bound once, as `_settle`)
        w.bind(reinterpret_tensor, "reinterpret_tensor", "reinterpret_tensor")
    more = "" if _is_zero(offset) else f", {w.size(offset)}"
    w.line(f"{w.define(slot)} = _reinterpret_tensor({root}, {w.size(shape)}, {w.size(stride)}{more})",
           f"{w.value_name(slot)}: {what}")


def _is_zero(offset) -> bool:
    """Whether a view's offset (an int, or a shape family's size expression) is 0."""
    return not is_symbolic(offset) and int(offset) == 0


def _emit_getitem(w: _Writer, step: GetItemStep) -> None:
    item = f"{w.names[step.src]}[{step.index!r}]"
    if step.planned is not None:  # as for an extern's result: settle the strides as planned
        item = _settled(w, item, step.planned)
    w.line(f"{w.define(step.out_slot)} = {item}")


def _emit_any(w: _Writer, step) -> None:
    """A step written as a call of the step itself, with the live values in a dict for its env
    (a step reads `env[slot]` and writes `env[out_slot]`; a dict serves as well as a list)."""
    live = ", ".join(f"{slot}: {name}" for slot, name in w.names.items())
    env = w.bind(step, type(step).__name__.lower())
    w.line(f"env = {{{live}}}")
    w.line(f"{env}(env)", repr(step))
    for slot in _written_slots(step):
        w.line(f"{w.define(slot)} = env[{slot}]")
    w.line("del env")


def _written_slots(step) -> list[int]:
    if isinstance(step, KernelStep):
        return [b.slot for b in step.writes]
    return [step.out_slot]


_EMITTERS = {KernelStep: _emit_kernel, ExternStep: _emit_extern, ViewStep: _emit_view,
             GetItemStep: _emit_getitem}


def _result(w: _Writer, program: "Program", aliases: dict, constants: dict, form: str) -> str:
    """The return expression: the program's outputs, with `constants` inserted and `aliases`
    returning inputs themselves (what CompiledFunction does to a program's output list)."""
    items = [w.names[s] for s in program.output_slots]
    for k, value in sorted(constants.items()):
        items.insert(k, _literal_or_global(w, value))
    for k, i in aliases.items():
        items[k] = w.names[program.input_slots[i]]
    if form == "single":
        (item,) = items
        return item
    if form == "tuple":
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    return f"[{', '.join(items)}]"


def _literal_or_global(w: _Writer, value: Any) -> str:
    if type(value) in (int, bool, str) or value is None:
        return repr(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):  # a family's size
        kind = {torch.SymInt: "int", torch.SymFloat: "float", torch.SymBool: "bool"}[type(value)]
        if not value.node.expr.free_symbols <= set(w.sizes):
            from fusec.errors import UnsupportedError
            raise UnsupportedError(f"fusec: the program returns a size ({value}) that no input's "
                                   f"size gives; call the function without fusec for it")
        from torch.utils._sympy.printers import PythonPrinter  # this call's, from its inputs
        return f"{kind}({PythonPrinter().doprint(rename(value.node.expr, w.sizes))})"
    return w.bind(value, "out")


def _settle(w: _Writer) -> str:
    """The global holding `settle` (fusec/runtime/steps.py), bound once."""
    if "_settle" not in w.globals:
        w.bind(settle, "settle", "settle")
    return "_settle"


# ---- the program as shown ------------------------------------------------------------------------

SPELLED_TENSOR_ELEMENTS = 4096  # constant tensors up to this size are written out in full


def spell(value: Any) -> str | None:
    """`value` as a Python expression that makes it again, or None if there is none (a large
    tensor made while compiling, a step object): a literal, a dtype, a device, an ATen op, a
    Layout, a small constant tensor (its values written out)."""
    if type(value) in (int, bool, str) or value is None:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _spell_tensor(value)
    if type(value) is float:
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)  # torch.float32, torch.channels_last, torch.strided
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, torch._ops.OpOverload):
        return f"torch.ops.{value}"  # torch.ops.aten.mm.default
    if isinstance(value, Layout):
        return repr(value)
    if value is check_index_values:
        return "check_index_values"
    if type(value) in (list, tuple) or isinstance(value, list):  # (fx's immutable_list too)
        inner = [spell(v) for v in value]
        if any(i is None for i in inner):
            return None
        if isinstance(value, list):
            return f"[{', '.join(inner)}]"
        return f"({', '.join(inner)}{',' if len(inner) == 1 else ''})"
    return None


def _spell_tensor(t: torch.Tensor) -> str | None:
    """A small dense tensor: exact values (a float's repr reads back the same), strides, dtype."""
    if t.numel() > SPELLED_TENSOR_ELEMENTS or t.is_complex() or 0 in t.stride():
        return None
    flat = t.detach().cpu().reshape(-1)
    values = (flat.double() if t.is_floating_point() else flat).tolist()
    if not all(math.isfinite(v) for v in values):
        return None
    shape = tuple(t.shape)
    return (f"torch.empty_strided({shape}, {tuple(t.stride())}, dtype={t.dtype}, device="
            f"{str(t.device)!r}).copy_(torch.tensor({values}, dtype={t.dtype}).view({shape}))")


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}, {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def python_wrapper(program: "Program") -> str:
    """The program as runnable Python, like torch.compile's output code: what each global of
    `program.run` is, the text `run` was compiled from, and `call(*inputs)` calling it. Exec it
    and call `call`. (A constant tensor of the graph larger than SPELLED_TENSOR_ELEMENTS, or a
    step written as an object, is shown as `...` with what it is: those exist only in the
    compiled program.)"""
    run = program.prepare()
    names = getattr(program, "slot_names", None) or [f"s{i}" for i in range(program.n_slots)]
    inputs = ", ".join(names[s] for s in program.input_slots)
    lines = ["import torch", "from fusec.ir import Layout",
             "from fusec.runtime import FamilyPool, load_launcher, settle, settle_as",
             "from fusec.runtime.steps import " + ("check_index_values, " if "check_index_values"
                                                   in run.source else "") + "reinterpret_tensor",
             "", *run.definitions, "", "",
             run.source.rstrip("\n"), "", "", f"def call({inputs}):",
             f"    return run([{inputs}])"]
    return "\n".join(lines) + "\n"
