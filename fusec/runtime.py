"""Runtime: run a scheduled program, step by step, over a flat list of buffer slots.

A Program is built once per input signature. Everything that can be decided ahead of time is:
which slot each value lives in, the shapes and strides of every buffer a kernel writes, the
prepared launcher of each kernel. A call then only fills the input slots and runs the steps:

    env = [x, None, None]
    KernelStep  fused_sin_sin_mul_0   env[1] = empty(4, 4); launch(env[0], env[1])
    ExternStep  aten.mm.default       env[2] = aten.mm(env[1], env[0])
    return [env[2]]

Views do not appear here unless an extern call or the caller needs them as tensors: kernels read
views through index expressions (see passes/schedule.py).
"""
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import Layout, TensorMeta


@dataclass(frozen=True)
class SlotRef:
    slot: int


@dataclass
class OutputBuffer:
    slot: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None  # bytes into the program's pool (memory plan), or None: allocate
    nbytes: int = 0
    inplace: int | None = None  # the slot whose buffer this output is written over, if any


class KernelStep:
    def __init__(self, name: str, launcher: Callable, reads: list[int], writes: list[OutputBuffer],
                 device: str, numel: int):
        self.name, self.launcher, self.reads, self.writes = name, launcher, reads, writes
        self.device = torch.device(device)
        self.numel = numel

        self.planned: dict[int, torch.Tensor] = {}  # slot -> its view into the pool

    def bind_pool(self, pool: torch.Tensor) -> None:
        """Carve this kernel's planned outputs out of the program's pool, once."""
        for w in self.writes:
            if w.offset is not None:
                piece = pool[w.offset:w.offset + w.nbytes].view(w.dtype)
                self.planned[w.slot] = piece.as_strided(w.shape, w.stride, piece.storage_offset())

    def __call__(self, env: list) -> None:
        outs = []
        for w in self.writes:
            t = self.planned.get(w.slot)
            if w.inplace is not None:  # the input's memory, seen with this output's shape
                src = env[w.inplace]
                t = src.as_strided(w.shape, w.stride, src.storage_offset())
            if t is None:
                t = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=self.device)
            env[w.slot] = t
            outs.append(t)
        if self.numel:
            self.launcher(*[env[r] for r in self.reads], *outs)

    def __repr__(self) -> str:
        return f"KernelStep({self.name})"


class ExternStep:
    """An eager ATen call. Its tensor result is put in the layout the schedule planned for it."""

    def __init__(self, target, args, kwargs, out_slot: int, planned: Layout | None):
        self.target, self.args, self.kwargs = target, args, kwargs
        self.out_slot, self.planned = out_slot, planned
        self.name = str(target)

    def __call__(self, env: list) -> None:
        def fetch(a):
            return env[a.slot] if isinstance(a, SlotRef) else a
        args = fx.node.map_aggregate(self.args, fetch)
        kwargs = fx.node.map_aggregate(self.kwargs, fetch)
        out = self.target(*args, **kwargs)
        env[self.out_slot] = out if self.planned is None else self.settle(out)

    def settle(self, out):
        return settle(out, self.planned)

    def __repr__(self) -> str:
        return f"ExternStep({self.name})"


def settle(out, planned: Layout):
    """`out` in the strides the schedule planned for it (a copy only when ATen chose others)."""
    if isinstance(out, torch.Tensor) and tuple(out.stride()) != planned.stride \
            and out.numel() > 1:
        fixed = torch.empty_strided(planned.shape, planned.stride, dtype=out.dtype,
                                    device=out.device)
        out = fixed.copy_(out)
    return out


class ViewStep:
    """Materialize a view as a tensor (only for extern calls and program outputs)."""

    def __init__(self, root: int, layout: Layout, out_slot: int):
        self.root, self.layout, self.out_slot = root, layout, out_slot

    def __call__(self, env: list) -> None:
        base = env[self.root]
        env[self.out_slot] = base.as_strided(self.layout.shape, self.layout.stride,
                                             base.storage_offset() + self.layout.offset)

    def __repr__(self) -> str:
        return f"ViewStep(slot {self.root} as {self.layout.shape}/{self.layout.stride}+{self.layout.offset})"


class GetItemStep:
    """One output of a multi-output extern. A tensor output is settled into the layout the
    schedule planned from the op's fake value: a library may lay it out otherwise (an LSTM's
    batch-first output is a transposed view of a sequence-first buffer), and kernels read it
    through the planned strides."""

    def __init__(self, src: int, index: int, out_slot: int, planned: Layout | None = None):
        self.src, self.index, self.out_slot, self.planned = src, index, out_slot, planned

    def __call__(self, env: list) -> None:
        out = env[self.src][self.index]
        env[self.out_slot] = out if self.planned is None else settle(out, self.planned)

    def __repr__(self) -> str:
        return f"GetItemStep(slot {self.src}[{self.index}])"


class Program:
    """A compiled program for one input signature.

    Intermediate buffers live in one pool allocated on the first call and reused by every later
    one (passes/schedule.py plans the offsets), so a call allocates only its outputs.

    The first call also writes the steps out as one straight-line Python function, `self.run`
    (see "Note: the per-call path" below); every call after that is just `self.run(inputs)`.
    `interpret` walks the steps one by one instead: the same result, the slow way.
    """

    def __init__(self, n_slots: int, input_slots: list[int], constants: dict[int, torch.Tensor],
                 steps: list, output_slots: list[int], producers: dict[int, Any],
                 memory=None):
        self.memory = memory
        self.pool: torch.Tensor | None = None
        self.n_slots = n_slots
        self.input_slots = input_slots
        self.constants = list(constants.items())
        self.steps = steps
        self.output_slots = output_slots
        self.producers = producers  # output slot -> the kernel (or op name) that produced it
        self.run: Callable | None = None  # the straight-line function, built by prepare()

    def _bind_pool(self) -> None:
        kernels = [s for s in self.steps if isinstance(s, KernelStep)]
        device = kernels[0].device if kernels else torch.device("cpu")
        self.pool = torch.empty(max(self.memory.pool_bytes if self.memory else 0, 1),
                                dtype=torch.uint8, device=device)
        for step in kernels:
            step.bind_pool(self.pool)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The output tensors for `inputs` (one tensor per input slot, in order)."""
        return (self.run or self.prepare())(inputs)

    def prepare(self) -> Callable:
        """Allocate the pool and build `self.run`, once; returns it."""
        if self.pool is None:
            self._bind_pool()
        if self.run is None:
            self.run = self.runner()
        return self.run

    def runner(self, aliases: dict | None = None, constants: dict | None = None,
               form: str = "list") -> Callable:
        """A straight-line function `run(inputs)` for this program (see `straight_line`).

        By default it returns the list of output tensors. A caller that knows what the user's
        function returns can have it returned directly: `constants` (output index -> a value
        returned as is) are inserted, `aliases` (output index -> input index) return an input
        itself, and `form` is "list", "tuple" or "single" (the one output, unwrapped).
        """
        if self.pool is None:
            self._bind_pool()
        return straight_line(self, aliases or {}, constants or {}, form)

    def interpret(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run the steps one by one over a list of slots: what `run` does, written as a loop."""
        if self.pool is None:
            self._bind_pool()
        env: list = [None] * self.n_slots
        for slot, t in zip(self.input_slots, inputs):
            env[slot] = t
        for slot, t in self.constants:
            env[slot] = t
        for step in self.steps:
            step(env)
        return [env[s] for s in self.output_slots]


def build_program(gm: fx.GraphModule, kernels: dict[str, Any]) -> Program:
    """Turn a scheduled graph plus its compiled kernels (name -> Kernel) into a Program."""
    slot_of: dict[str, int] = {}

    def slot(name: str) -> int:
        if name not in slot_of:
            slot_of[name] = len(slot_of)
        return slot_of[name]

    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    memory = gm.meta.get("fusec_memory")
    inplace = gm.meta.get("fusec_inplace", {})  # passes/schedule.py: plan_inplace
    output = gm.graph.output_node()
    input_slots, constants, steps = [], {}, []
    producers: dict[int, Any] = {}
    def folded(n):  # a view read through index arithmetic: it needs no tensor of its own
        return n.op == "call_function" and "fusec_layout" in n.meta \
            and n.meta["fusec_layout"].root != n.name

    materialize = {n for n in nodes if folded(n)
                   and any(u.op != "call_module" and not folded(u) for u in n.users)}

    def ref(a):
        return SlotRef(slot(a.name)) if isinstance(a, fx.Node) else a

    for node in nodes:
        if node.op == "placeholder":
            input_slots.append(slot(node.name))
        elif node.op == "get_attr":
            constants[slot(node.name)] = getattr(gm, node.target)
        elif node.op == "call_module":
            kernel = kernels[node.target]
            reads = [slot(p.name) for p in kernel.ir.params if not p.is_output]
            writes = []
            for p in kernel.ir.params:
                if p.is_output:
                    layout = by_name[p.name].meta["fusec_layout"]
                    placed = memory.placements.get(p.name) if memory else None
                    writes.append(OutputBuffer(slot(p.name), layout.shape, layout.stride, p.dtype,
                                               placed.offset if placed else None,
                                               placed.nbytes if placed else 0,
                                               slot(inplace[p.name]) if p.name in inplace else None))
                    producers[slot(p.name)] = kernel
            device = node.meta["fusec_group"]["device"]
            # launch unless every output is empty (a reduction over an empty dim still writes
            # its rows: the identity of the reduction)
            out_numel = max((math.prod(w.shape) for w in writes), default=0)
            steps.append(KernelStep(kernel.name, kernel.launcher, reads, writes, device, out_numel))
        elif node.op == "call_function" and "fusec_views" in node.meta:
            continue  # split/unbind: its pieces are views, read in place
        elif node.op == "call_function" and node in materialize:
            layout = node.meta["fusec_layout"]
            steps.append(ViewStep(slot(layout.root), layout, slot(node.name)))
        elif folded(node):
            continue  # a view (or a piece of a split) read through index arithmetic
        elif node.op == "call_function" and node.target.__name__ == "getitem":
            src = node.args[0]
            if src.op == "call_module":
                continue  # a kernel output: written by the KernelStep
            layout = node.meta.get("fusec_layout")
            planned = layout if layout is not None and layout.root == node.name else None
            steps.append(GetItemStep(slot(src.name), node.args[1], slot(node.name), planned))
            producers[slot(node.name)] = str(src.target)
        elif node.op == "call_function" and node in materialize:
            layout = node.meta["fusec_layout"]
            steps.append(ViewStep(slot(layout.root), layout, slot(node.name)))
        elif node.op == "call_function" and _is_view(node) and "fusec_layout" in node.meta \
                and node.meta["fusec_layout"].root != node.name:
            continue  # folded into the indices of whoever reads it
        elif node.op == "call_function":
            layout = node.meta.get("fusec_layout")
            steps.append(ExternStep(node.target, fx.node.map_arg(node.args, ref),
                                    fx.node.map_arg(node.kwargs, ref), slot(node.name),
                                    layout if layout is not None and layout.root == node.name else None))
            producers[slot(node.name)] = str(node.target)
    outputs = [slot(a.name) for a in output.args[0]]
    program = Program(len(slot_of), input_slots, constants, steps, outputs, producers, memory)
    program.slot_names = [None] * len(slot_of)
    for name, index in slot_of.items():
        program.slot_names[index] = name
    return program


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and ops.classify(node.target) == ops.VIEW



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

def straight_line(program: Program, aliases: dict, constants: dict, form: str) -> Callable:
    """Write `program` out as `def run(inputs)` (see the note above), compile it, return it."""
    w = _Writer(program)
    names = [w.define(slot) for slot in program.input_slots]
    if names:
        w.line(f"{', '.join(names)}{',' if len(names) == 1 else ''} = inputs")
    for slot, tensor in program.constants:
        w.names[slot] = w.bind(tensor, "constant")
    last = last_uses(program)
    keep = set(program.output_slots) | set(program.input_slots)
    for i, step in enumerate(program.steps):
        _EMITTERS.get(type(step), _emit_any)(w, step)
        dead = [w.names.pop(s) for s in last.get(i, ())
                if s not in keep and w.names.get(s, "").startswith("s")]
        if dead:  # as torch.compile's output code does: memory goes back as soon as it can
            w.line(f"del {', '.join(dead)}", "last use")
    w.line("return " + _result(w, program, aliases, constants, form))
    return w.build()


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


def last_uses(program: Program) -> dict[int, list[int]]:
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


class _Writer:
    """The text of a straight-line function and the globals it reads.

    Slot 3 is the local `s3`; a value that is the same on every call (a kernel, a template, an
    extern op, a constant argument) is a global with a readable name, `_fused_sin_0` say.
    """

    def __init__(self, program: Program):
        self.program = program
        self.lines: list[str] = []
        self.names: dict[int, str] = {}  # slot -> the expression that holds its value
        self.globals: dict[str, Any] = {"empty_like": torch.empty_like,
                                        "empty_strided": torch.empty_strided}

    def define(self, slot: int) -> str:
        self.names[slot] = f"s{slot}"
        return self.names[slot]

    def bind(self, value: Any, hint: str) -> str:
        """A global holding `value`, named after `hint`."""
        base = "_" + "".join(c if c.isalnum() else "_" for c in hint)
        name, n = base, 1
        while name in self.globals:
            name, n = f"{base}_{n}", n + 1
        self.globals[name] = value
        return name

    def line(self, text: str, comment: str = "") -> None:
        self.lines.append(f"    {text}" + (f"  # {comment}" if comment else ""))

    def value_name(self, slot: int) -> str:
        """The graph's name for a slot's value (`sin`), for comments."""
        names = getattr(self.program, "slot_names", None)
        return names[slot] if names else f"slot {slot}"

    def build(self) -> Callable:
        import linecache
        source = "def run(inputs):\n" + "\n".join(self.lines) + "\n"
        filename = f"<fusec straight-line program {id(self.program):x}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), self.globals)
        run = self.globals["run"]
        run.source = source
        return run


def _emit_kernel(w: _Writer, step: KernelStep) -> None:
    """Outputs (fresh, or the program's pool views), then the launch."""
    for buf in step.writes:
        view = step.planned.get(buf.slot)
        if buf.inplace is not None:  # written over an input read here for the last time
            source = w.names[buf.inplace]
            w.line(f"{w.define(buf.slot)} = {source}.as_strided({buf.shape}, {buf.stride}, "
                   f"{source}.storage_offset())",
                   f"{w.value_name(buf.slot)}: written over {w.value_name(buf.inplace)}, "
                   f"its last use")
        elif view is not None:  # carved out of the pool once: the same memory on every call
            w.names[buf.slot] = w.bind(view, w.value_name(buf.slot))
            w.line(f"# {w.names[buf.slot]}: a view of the pool, bytes [{buf.offset}, "
                   f"{buf.offset + buf.nbytes})")
        else:
            w.line(f"{w.define(buf.slot)} = {_allocation(w, buf, step.device)}",
                   f"{w.value_name(buf.slot)}: a fresh {buf.shape} {buf.dtype} buffer")
    if not step.numel:
        w.line("pass", f"{step.name}: every output is empty, nothing to launch")
        return
    tensors = [w.names[r] for r in step.reads] + [w.names[b.slot] for b in step.writes]
    entry = getattr(step.launcher, "pointer_entry", None)
    if entry is not None:  # a C function: called with the data pointers, as ints
        w.line(f"{w.bind(entry, step.name)}({', '.join(t + '.data_ptr()' for t in tensors)})")
    else:  # a Python launcher (Triton's grid launch, the LLVM backend's): called with tensors
        w.line(f"{w.bind(step.launcher, step.name)}({', '.join(tensors)})")


def _allocation(w: _Writer, buf: OutputBuffer, device: torch.device) -> str:
    """The expression that allocates a fresh output buffer.

    `torch.empty_like(t)`, where t is one element expanded to the buffer's shape, allocates a
    contiguous buffer of t's shape, dtype and device; it takes no keyword arguments to parse,
    which makes it the cheapest allocation from Python (~0.2 us less than `empty_strided` with
    `dtype=` and `device=`). Buffers with other strides use `empty_strided`.
    """
    meta = torch.empty((), dtype=buf.dtype, device="meta").expand(buf.shape)
    if tuple(torch.empty_like(meta).stride()) == tuple(buf.stride):
        like = torch.empty((), dtype=buf.dtype, device=device).expand(buf.shape)
        return f"empty_like({w.bind(like, 'like')})"
    return (f"empty_strided({buf.shape}, {buf.stride}, dtype={w.bind(buf.dtype, 'dtype')}, "
            f"device={w.bind(device, 'device')})")


def _emit_extern(w: _Writer, step: ExternStep) -> None:
    """`s5 = _aten_mm_default(s1, s2)`, its arguments written out."""
    try:
        args = [_argument(w, a) for a in step.args]
        for k, v in step.kwargs.items():
            if not k.isidentifier() or keyword.iskeyword(k):
                raise _NotWritable(f"keyword {k!r}")
            args.append(f"{k}={_argument(w, v)}")
    except _NotWritable:
        return _emit_any(w, step)
    call = f"{w.bind(step.target, step.name)}({', '.join(args)})"
    if step.planned is not None:  # ATen picks its result's strides: settle them as planned
        call = f"{w.bind(step.settle, 'settle')}({call})"
    w.line(f"{w.define(step.out_slot)} = {call}")


class _NotWritable(Exception):
    """An argument `_argument` cannot write out (a tensor inside a dict, say)."""


def _argument(w: _Writer, a: Any) -> str:
    """An extern call's argument as an expression: a slot's name, a literal, or a global."""
    if isinstance(a, SlotRef):
        return w.names[a.slot]
    if type(a) in (int, bool, str) or a is None or (type(a) is float and math.isfinite(a)):
        return repr(a)
    if isinstance(a, (list, tuple)) and _holds_slots(a):
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
    root, lay = w.names[step.root], step.layout
    w.line(f"{w.define(step.out_slot)} = {root}.as_strided({lay.shape}, {lay.stride}, "
           f"{root}.storage_offset() + {lay.offset})", w.value_name(step.out_slot))


def _emit_getitem(w: _Writer, step: GetItemStep) -> None:
    item = f"{w.names[step.src]}[{step.index!r}]"
    if step.planned is not None:  # as for an extern's result: settle the strides as planned
        item = f"{w.bind(settle, 'settle')}({item}, {w.bind(step.planned, 'layout')})"
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


def _result(w: _Writer, program: Program, aliases: dict, constants: dict, form: str) -> str:
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
    return w.bind(value, "out")


# ---- CUDA graphs -----------------------------------------------------------------------------

# Note (when a CUDA graph does not pay): a graph saves at most the CPU time of the launches it
# replaces, about LAUNCH_US each (a Triton launch through its bound launcher, an ATen call). It
# costs a copy of every user input into the graph's buffers and of every output out of them.
# For a big program with few steps the copies are the larger cost: KernelBench-style
# 7_conv2d_instancenorm_divide on an H200 (a 67 MB input, a 134 MB output, 4 launches) spent
# 0.098 ms of its 0.656 in those two copies, more than eager needed for its whole bias add.
LAUNCH_US = 5.0
COPY_BYTES_PER_US = 2.0e6  # input + output bytes copied per microsecond (201 MB in 98 us, H200)


def graph_blocker(program: Program, gm: fx.GraphModule, n_inputs: int,
                  n_static: int = 0) -> str | None:
    """Why this program is not replayed as one CUDA graph, or None if it is.

    A captured graph replays fixed addresses: every input is read from a buffer we own (or from a
    parameter that stays put), every output comes out of the graph's own memory. So a program
    that writes into its inputs, returns an input (or a view of one), or runs anything on the CPU
    is launched step by step instead; and so is one whose input and output copies would cost
    more than its launches (see the note above). `n_static`: the leading inputs that are
    parameters and buffers, which the graph reads in place.
    """
    devices = {n.meta["fusec"].device for n in gm.graph.nodes
               if isinstance(n.meta.get("fusec"), TensorMeta)}
    if any(not d.startswith("cuda") for d in devices) or len(devices) != 1:
        return f"not all on one CUDA device ({', '.join(sorted(devices))})"
    inputs = set(program.input_slots) | {s for s, _ in program.constants}
    for step in program.steps:
        if isinstance(step, ExternStep) and getattr(step.target, "_schema", None) is not None \
                and step.target._schema.is_mutable:
            return f"{step.name} writes into a tensor in place"
        if isinstance(step, ViewStep) and step.root in inputs and step.out_slot in program.output_slots:
            return "an output is a view of an input"
    if any(s in inputs for s in program.output_slots):
        return "an output is an input"
    for step in program.steps:
        if draws_random_numbers(step):
            return f"{step.name} draws random numbers (a replay would not follow torch.manual_seed)"
    launches = sum(isinstance(s, (KernelStep, ExternStep)) for s in program.steps)
    if launches < 2:
        return "a single launch: a graph would only add the copy of the inputs"
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    copied = sum(_bytes(n) for n in placeholders[n_static:]) \
        + sum(_bytes(n) for n in gm.graph.output_node().all_input_nodes)
    if copied / COPY_BYTES_PER_US > launches * LAUNCH_US:
        return (f"copying {copied / 1e6:.1f} MB of inputs and outputs into and out of a graph "
                f"(~{copied / COPY_BYTES_PER_US:.0f} us) would cost more than its {launches} "
                f"launches (~{launches * LAUNCH_US:.0f} us)")
    return None


def _bytes(node: fx.Node) -> int:
    m = node.meta.get("fusec")
    if not isinstance(m, TensorMeta):
        return 0
    return math.prod(m.shape) * torch.empty((), dtype=m.dtype).element_size()


def draws_random_numbers(step) -> bool:
    """True for an ATen call that consumes the random generator. torch tags such ops
    `nondeterministic_seeded`; the fused attention kernels (flash, efficient, cuDNN) carry the tag
    because they can apply dropout, but with `dropout_p` 0 (inference, eval mode) they draw
    nothing, and a CUDA graph of a vision transformer must not be refused for it."""
    target = getattr(step, "target", None)
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = step.kwargs.get("dropout_p", step.args[i] if i < len(step.args) else
                            schema.arguments[i].default_value)
        return not (isinstance(p, (int, float)) and p == 0)
    return True


_CAPTURE_STREAMS: dict = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream per device on which every fusec graph warms up and is captured.

    Capture cannot happen on the default stream, but a new stream per graph would cost memory:
    cuBLAS keeps a workspace per (handle, stream), tens of MB on recent GPUs, so each fresh stream
    that runs a matmul adds one. Sharing one stream pays for it once per process.
    """
    key = torch.device(device).index if torch.device(device).index is not None \
        else torch.cuda.current_device()
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=key)
    return _CAPTURE_STREAMS[key]


class CudaGraphRunner:
    """Replays a Program as one CUDA graph: one launch instead of one per step.

    Parameters and buffers (the first `n_static` inputs) are read in place; a call that passes a
    parameter at another address needs a new capture (`__call__` returns None). Other inputs are
    copied into buffers the graph owns. Outputs are cloned out of the graph's memory, so the next
    replay cannot overwrite what an earlier call returned.
    """

    def __init__(self, program: Program, inputs: list[torch.Tensor], n_static: int):
        self.program, self.n_static = program, n_static
        self.static = [t if i < n_static else t.clone() for i, t in enumerate(inputs)]
        self.static_ptrs = [t.data_ptr() for t in self.static[:n_static]]
        side = capture_stream(next((t.device for t in inputs), torch.device("cuda")))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: cuBLAS handles, allocator, Triton binaries
            program(self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side):
            self.outputs = program(self.static)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        for i in range(self.n_static):
            if inputs[i].data_ptr() != self.static_ptrs[i]:
                return None
        for dst, src in zip(self.static[self.n_static:], inputs[self.n_static:]):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        self.graph.replay()
        return [o.clone() for o in self.outputs]


# ---- the program as Python ------------------------------------------------------------------

def load_launcher(path: str, name: str = "", n_params: int = 0):
    """A kernel launcher from its cached artifact: a C++ shared library, an LLVM object file or a
    Triton module."""
    from pathlib import Path
    if path.endswith(".so"):
        from fusec.codegen.cpp import CppLauncher
        return CppLauncher(Path(path), name, n_params)
    if path.endswith(".o"):  # LLVM object code, loaded by llvmlite's JIT
        from fusec.codegen.llvm import LlvmLauncher
        return LlvmLauncher(Path(path), name, n_params)
    import importlib.util
    from fusec.codegen.triton_launch import TritonLauncher
    spec = importlib.util.spec_from_file_location(f"fusec_wrapper_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return TritonLauncher(module, Path(path), name, n_params)


def python_wrapper(program: Program) -> str:
    """The program as a runnable Python function `call(*inputs)`, like torch.compile's output
    code: one line per step, buffers named after the graph's values. Exec it and call it."""
    import sys

    names = program.slot_names
    lines = ["import torch", "from fusec.runtime import load_launcher", ""]
    kernels = [s for s in program.steps if isinstance(s, KernelStep)]
    for step in kernels:
        launcher = step.launcher
        if hasattr(launcher, "lib"):
            lines.append(f"{step.name} = load_launcher({str(launcher.lib)!r}, {launcher.name!r}, "
                         f"{launcher.n_params})")
        else:
            path = sys.modules[launcher.__module__].__file__
            lines.append(f"{step.name} = load_launcher({path!r}, {step.name!r})")
    pool_bytes = program.memory.pool_bytes if program.memory is not None else 0
    device = kernels[0].device if kernels else torch.device("cpu")
    lines += ["", "# intermediate buffers share one pool (passes/schedule.py plans the offsets)",
              f"pool = torch.empty({max(pool_bytes, 1)}, dtype=torch.uint8, device={str(device)!r})",
              "", "", f"def call({', '.join(names[s] for s in program.input_slots)}):"]

    def ref(a):
        return names[a.slot] if isinstance(a, SlotRef) else repr(a)

    def render_args(value):
        if isinstance(value, SlotRef):
            return names[value.slot]
        if isinstance(value, (list, tuple)):
            inner = ", ".join(render_args(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, torch.device):
            return f"torch.device({str(value)!r})"
        return repr(value)

    for slot, tensor in program.constants:
        lines.append(f"    {names[slot]} = ...  # a constant tensor of the graph, {tuple(tensor.shape)}")
    for step in program.steps:
        if isinstance(step, KernelStep):
            for w in step.writes:
                n = names[w.slot]
                if w.inplace is not None:
                    src = names[w.inplace]
                    lines.append(f"    {n} = {src}.as_strided({w.shape}, {w.stride}, "
                                 f"{src}.storage_offset())  # written over {src}: its last use")
                elif w.offset is not None:
                    lines.append(f"    {n} = pool[{w.offset}:{w.offset + w.nbytes}].view({w.dtype})"
                                 f".as_strided({w.shape}, {w.stride})")
                else:
                    lines.append(f"    {n} = torch.empty_strided({w.shape}, {w.stride}, "
                                 f"dtype={w.dtype}, device={str(step.device)!r})")
            args = [names[r] for r in step.reads] + [names[w.slot] for w in step.writes]
            lines.append(f"    {step.name}({', '.join(args)})")
        elif isinstance(step, ExternStep):
            args = ", ".join(render_args(a) for a in step.args)
            kwargs = "".join(f", {k}={render_args(v)}" for k, v in step.kwargs.items())
            lines.append(f"    {names[step.out_slot]} = torch.ops.{step.name}({args}{kwargs})")
        elif isinstance(step, ViewStep):
            lay = step.layout
            lines.append(f"    {names[step.out_slot]} = {names[step.root]}.as_strided({lay.shape}, "
                         f"{lay.stride}, {names[step.root]}.storage_offset() + {lay.offset})")
        elif isinstance(step, GetItemStep):
            lines.append(f"    {names[step.out_slot]} = {names[step.src]}[{step.index}]")
    lines.append(f"    return [{', '.join(names[s] for s in program.output_slots)}]")
    return "\n".join(lines) + "\n"
