"""The public entry point: `fusec.compile`, and the driver that runs the whole pipeline.

    capture (frontend.py) -> passes.PIPELINE -> codegen per fused group -> runtime.Program

`CompiledFunction` keeps one Program per input signature (shapes, strides, dtypes, devices and
the values of non-tensor arguments). A call with a known signature goes straight to its Program;
a new signature compiles a new one.
"""
from __future__ import annotations

import builtins
import functools
import importlib
import operator
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import frontend
from . import log as _log
from .errors import DeviceError, FusecError, GraphBreakError
from .ir import PointwiseKernel

# The pipeline's own modules (and networkx, jinja2) load with fusec, not on the first compile.
import fusec.codegen.cpp  # noqa: E402,F401
import fusec.codegen.lower  # noqa: E402,F401
import fusec.passes  # noqa: E402,F401
import fusec.runtime  # noqa: E402,F401

BACKENDS = ("auto", "triton", "cpp", "llvm")


@dataclass
class Kernel:
    """One generated kernel: `name` says what it fuses, `source` is the full generated text.

    `source` is this kernel as it reads in its program: its own name, parameters named after the
    buffers it reads and writes, comments citing its ATen nodes. The binary it runs was built
    from `canonical`, the same kernel with generic names, which every kernel of the program
    (and of any other program) that differs from it only in names shares: one build, one
    loaded binary (fusec/build.py). `shares` lists the kernels of a program that share it."""

    name: str
    backend: str
    source: str | None  # None: rendered from `ir` when first read
    ops: list[str]
    ir: Any = field(repr=False)  # fusec.ir.PointwiseKernel or ReductionKernel
    launcher: Callable = field(repr=False, default=None)
    built: Any = field(repr=False, default=None)  # its fusec.build.Built

    def __post_init__(self) -> None:
        if self.source is None:  # rendering is cheap, but a warm start renders only what it builds
            del self.source

    def __getattr__(self, attr: str):
        if attr == "source":  # (only reached while the instance has no `source` yet)
            self.source = backend_module(self.backend).render(self.ir)
            return self.source
        raise AttributeError(attr)

    @property
    def canonical(self) -> str:
        """The text that was compiled into the binary this kernel runs."""
        return self.built.source if self.built is not None else self.source

    def __str__(self) -> str:
        return self.source


@dataclass
class CompiledGraph:
    """Everything compiled for one input signature."""

    backend: str
    captured: frontend.Captured
    gm: fx.GraphModule  # after the pipeline
    snapshots: list | None  # the graph after each pass, if recorded: see `stages()`
    kernels: list[Kernel]
    program: Any
    graph_blocker: str | None = "not checked"  # why it cannot be one CUDA graph (None: it can)
    times: dict = field(default_factory=dict)  # seconds per stage of its compile (see `report`)
    runner: Any = None  # the CudaGraphRunner once captured
    calls: int = 0

    def stages(self) -> list:
        """The graph after each pass (`passes.Snapshot`s). A compile records them only when
        someone watches (FUSEC_LOG, FUSEC_DEBUG_DIR, explain, profile): printing a model's graph
        seven times was a fifth of its warm start. Otherwise they are made here, on first use, by
        running the passes again over the captured graph (they are deterministic)."""
        if self.snapshots is None:
            from fusec.passes import run_pipeline
            self.snapshots = run_pipeline(self.captured.gm, record=True)[1]
        return self.snapshots

    def schedule_text(self) -> str:
        """The numbered steps (kernel or extern, buffers read and written) and the memory plan."""
        from fusec.passes.schedule import format_schedule
        text = format_schedule(self.gm.meta["fusec_schedule"])
        memory = self.gm.meta.get("fusec_memory")
        text += ("\n" + str(memory) if memory is not None else "")
        for out, over in self.gm.meta.get("fusec_inplace", {}).items():
            text += f"\n  {out:<24} written over {over} (its last use): no buffer of its own"
        return text

    def source(self) -> str:
        parts = [f"# fusec program ({self.backend} backend): {len(self.kernels)} kernel(s)\n"]
        for k in self.kernels:
            parts.append(f"# ===== kernel {k.name} =====\n{k.source}")
        parts.append("# ===== schedule =====\n" + "\n".join(
            "# " + line for line in self.schedule_text().splitlines()))
        from fusec.runtime import python_wrapper
        parts.append("# ===== wrapper: the program as Python (exec it, then call(...)) =====\n"
                     + python_wrapper(self.program))
        parts.append("# ===== graph =====\n" + self.gm.code)
        return "\n".join(parts)


def backend_module(name: str):
    return importlib.import_module(f"fusec.codegen.{name}")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    device = torch.device(device)
    if backend not in BACKENDS:
        raise FusecError(f"fusec: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else _cpu_backend()
    if backend in ("cpp", "llvm") and device.type != "cpu":
        raise DeviceError(f"fusec: backend {backend!r} runs on CPU tensors, but the inputs are on "
                          f"{device}; use backend='triton' or move the inputs to the CPU")
    if backend == "triton" and device.type not in ("cuda", "cpu"):
        raise DeviceError(f"fusec: backend 'triton' runs on CUDA tensors (or on CPU tensors under "
                          f"TRITON_INTERPRET=1), not on {device}")
    return backend


def _cpu_backend() -> str:
    """backend="auto" on CPU: the C++/OpenMP backend when a C++ compiler exists, else the LLVM
    backend, which needs none (said once, so the user knows why)."""
    from fusec.codegen import cpp
    if cpp.available():
        return "cpp"
    global _SAID_LLVM
    if not _SAID_LLVM:
        _SAID_LLVM = True
        import warnings
        warnings.warn("fusec: no C++ compiler found (see $CXX/$CC); backend='auto' uses the "
                      "LLVM backend (llvmlite) for CPU tensors", stacklevel=4)
    return "llvm"


_SAID_LLVM = False


def compile_graph(captured: frontend.Captured, backend: str, record: bool = False,
                  label: str = "program") -> CompiledGraph:
    """Run the pass pipeline over a captured graph and build every kernel for `backend`.

    FUSEC_LOG / FUSEC_DEBUG_DIR (fusec/log.py) show each stage; `label` names the debug folder.
    """
    from fusec.codegen.lower import lower_pointwise, lower_reduction
    from fusec.passes import run_pipeline
    from fusec.build import build_all
    from fusec.runtime import build_program

    times = {"capture": captured.seconds}
    _log.captured(captured.gm)
    captured.gm.meta["fusec_backend"] = backend  # a pass may decide by it (fuse_reductions)
    start = time.perf_counter()
    gm, snapshots = run_pipeline(captured.gm, record=record)
    snapshots = snapshots if record else None  # CompiledGraph.stages() makes them when asked
    times["passes"] = time.perf_counter() - start
    _log.pipeline_done(captured.gm, gm, snapshots)
    start = time.perf_counter()
    by_name = {n.name: n for n in gm.graph.nodes}
    root_dtypes = {n.name: n.meta["fusec"].dtype for n in gm.graph.nodes
                   if "fusec_layout" in n.meta and n.meta["fusec_layout"].root == n.name}
    groups, irs = [], []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(gm, node.target)
        in_layouts = [a.meta["fusec_layout"] for a in node.args]
        outs = sorted((u for u in node.users), key=lambda u: u.args[1])
        out_layouts = [u.meta["fusec_layout"] for u in outs]
        lower = lower_reduction if sub.meta["fusec_group"]["kind"] == "reduction" else lower_pointwise
        irs.append(lower(node.target, sub, in_layouts, out_layouts, root_dtypes))
        groups.append(node)
        node.meta["fusec_group"]["device"] = by_name[outs[0].name].meta["fusec"].device
    times["codegen"] = time.perf_counter() - start  # lowering; build_all adds its rendering
    # one build per distinct kernel, several at a time (fusec/build.py)
    kernels: dict[str, Kernel] = {}
    device = groups[0].meta["fusec_group"]["device"] if groups else None
    for node, ir, built in zip(groups, irs, build_all(irs, backend, times, device)):
        kernels[node.target] = kernel = Kernel(ir.name, built.backend, None, list(ir.ops), ir,
                                               built.launcher, built)
        if _log.enabled("output_code"):
            _log.kernel_rendered(ir.name, built.backend, kernel.source)
    start = time.perf_counter()
    # outputs written over a dying extern result (passes/schedule.py, plan_inplace): those need
    # no place in the pool, so the pool is planned again without them
    from fusec.passes.schedule import plan_inplace, plan_memory
    gm.meta["fusec_inplace"] = inplace = plan_inplace(gm, kernels, backend)
    if inplace:
        gm.meta["fusec_memory"] = plan_memory(gm, gm.meta["fusec_schedule"], skip=set(inplace))
    program = build_program(gm, kernels)
    compiled = CompiledGraph(backend, captured, gm, snapshots, list(kernels.values()), program)
    from fusec.runtime import graph_blocker
    compiled.graph_blocker = graph_blocker(program, gm, len(program.input_slots),
                                           len(getattr(captured, "lifted", ())))
    times["load"] += time.perf_counter() - start  # binaries loaded, then the program assembled
    compiled.times = times
    _log.compile_times(compiled, label)
    _log.compiled(compiled, label)
    return compiled


def build_kernel(ir, backend: str) -> Kernel:
    """Render `ir` for `backend`, build and load it (or find it built; on a CompileError, the
    other CPU backend builds it: fusec/build.py)."""
    from fusec.build import build_all
    (built,) = build_all([ir], backend)
    return Kernel(ir.name, built.backend, None, list(ir.ops), ir, built.launcher, built)


class _Miss:
    """What a fast path returns when the call is not the one it was made for."""

    def __repr__(self) -> str:
        return "MISS"


_MISS = _Miss()


def _no_fast_path(args: tuple) -> _Miss:
    """The fast path before the first call (and after a call that cannot take one)."""
    return _MISS


def _guarded(run: Callable, tensors: list, n_static: int, state_refs: list, module) -> Callable:
    """`fast(args)`: run(tensors) when `args` match the call that `tensors` came from, else MISS.

    A guard in the sense of TorchDynamo's, written out as straight-line Python and compiled, so
    that checking costs a handful of attribute reads per tensor. For `f(x)` with x a (1024,)
    float32 CPU tensor:

        def fast(args):
            if len(args) != 1:
                return MISS
            a0, = args
            if (type(a0) is not Tensor or a0.shape != (1024,) or a0.stride() != (1,)
                    or a0.dtype is not float32 or not a0.is_cpu or a0.requires_grad):
                return MISS
            return run(args)

    A module's parameters and buffers are read where they live (an optimizer may replace them)
    and checked the same way, and so is `module.training`. When some tensor requires grad, the
    program is an inference one: it runs only while grad mode is off.
    """
    glob = {"MISS": _MISS, "Tensor": torch.Tensor, "run": run,
            "is_grad_enabled": torch.is_grad_enabled}
    n_args = len(tensors) - n_static
    args = [f"a{i}" for i in range(n_args)]
    lines = [f"if len(args) != {n_args}:", "    return MISS"]
    if args:
        lines.append(f"{', '.join(args)}{',' if n_args == 1 else ''} = args")
    if module is not None:
        glob["module"] = module
        lines += [f"if module.training is not {module.training}:", "    return MISS"]
    state = [f"p{i}" for i in range(n_static)]
    for i, ref in enumerate(state_refs):
        glob[f"owner{i}"] = ref.owner
        table = "_parameters" if ref.is_param else "_buffers"
        lines.append(f"p{i} = owner{i}.{table}[{ref.attr!r}]")
    for var, t in zip(state + args, tensors):
        dtype, device = str(t.dtype).replace("torch.", ""), str(t.device).replace(":", "")
        glob[dtype], glob[device] = t.dtype, t.device
        checks = ([f"type({var}) is not Tensor"] if var.startswith("a") else []) + [
            f"{var}.shape != {tuple(t.shape)}", f"{var}.stride() != {tuple(t.stride())}",
            f"{var}.dtype is not {dtype}",
            # is_cpu reads a flag; .device builds a torch.device to compare
            f"not {var}.is_cpu" if device == "cpu" else f"{var}.device != {device}",
            f"{'not ' if t.requires_grad else ''}{var}.requires_grad"]
        rows = [" or ".join(checks[i:i + 3]) for i in range(0, len(checks), 3)]
        lines += [f"if ({rows[0]}", *[f"        or {row}" for row in rows[1:-1]],
                  f"        or {rows[-1]}):", "    return MISS"]
    if any(t.requires_grad for t in tensors):
        lines += ["if is_grad_enabled():  # an inference program: training takes `_call`",
                  "    return MISS"]
    everything = "args" if not state else f"[{', '.join(state + args)}]"
    lines.append(f"return run({everything})")
    source = "def fast(args):\n" + "".join(f"    {line}\n" for line in lines)
    exec(builtins.compile(source, "<fusec fast path>", "exec"), glob)  # (fusec's compile is ours)
    fast = glob["fast"]
    fast.source, fast.run = source, run
    return fast


def _complete(compiled: "CompiledGraph", flat_out: list, tensors: list) -> list:
    """A program's output list, completed with the outputs that are not tensors it computes:
    constants (None, a number) and inputs returned as they are."""
    for k, value in sorted(compiled.captured.output_constants.items()):
        flat_out.insert(k, value)
    for k, i in compiled.captured.output_aliases.items():
        flat_out[k] = tensors[i]  # `x.add_(1); return x` returns the caller's x itself
    return flat_out


def _output_form(spec) -> str | None:
    """"single", "tuple" or "list" when the user's outputs are one tensor or a flat tuple or
    list of them (the forms a straight-line function returns itself); None for anything else."""
    n = spec.num_leaves
    forms = {"single": pytree.tree_structure(0), "tuple": pytree.tree_structure((0,) * n),
             "list": pytree.tree_structure([0] * n)}
    return next((name for name, simple in forms.items() if spec == simple), None)


def _packer(spec) -> Callable:
    """flat outputs -> the user's structure, cheaply for the simple forms."""
    form = _output_form(spec)
    if form == "single":
        return operator.itemgetter(0)
    if form is not None:
        return tuple if form == "tuple" else list
    return lambda flat: pytree.tree_unflatten(flat, spec)


def _direct_runner(program, captured: frontend.Captured) -> Callable:
    """`run(tensors)` -> the user's outputs: the program's straight-line function, told to
    return the outputs in the user's structure when it is a tensor, a flat tuple or a flat list
    (else the structure is rebuilt by pytree after it)."""
    spec = captured.out_spec
    form = _output_form(spec)
    program.prepare()
    run = program.runner(captured.output_aliases, captured.output_constants, form or "list")
    if form is not None:
        return run
    return lambda tensors: pytree.tree_unflatten(run(tensors), spec)


def _signature(leaves: list, grad: bool) -> tuple:
    key = [grad]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device,
                        leaf.requires_grad))
        else:
            key.append((type(leaf), leaf))
    return tuple(key)


class CompiledFunction:
    """What `fusec.compile(fn)` returns: call it like `fn`."""

    def __init__(self, fn: Callable, backend: str = "auto", cuda_graphs: str | bool = "auto",
                 check: bool = False, fullgraph: bool = False):
        if backend not in BACKENDS:
            raise FusecError(f"fusec: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.fn = fn
        self.backend = backend
        self.cuda_graphs = cuda_graphs
        self.check = check
        self.fullgraph = fullgraph
        self.breaks = None  # a fusec.breaks.GraphBroken once the program proved not one graph
        self.compiled: dict[tuple, CompiledGraph] = {}
        self.last: CompiledGraph | None = None
        self.train_parts: list = []  # forward and backward CompiledFunctions, when training
        # where each parameter and buffer lives, so a call reads them without walking the module
        self._state_refs = frontend.module_state(fn) if isinstance(fn, torch.nn.Module) else []
        self._module = fn if isinstance(fn, torch.nn.Module) else None
        self._fast: Callable = _no_fast_path  # see __call__
        self._fast_paths: dict[tuple, Callable] = {}  # signature -> its fast path, once made
        functools.update_wrapper(self, fn, updated=())

    # -- public ---------------------------------------------------------------------------------
    @property
    def kernels(self) -> list[Kernel]:
        """The kernels of the last input signature called (forward, then backward, in training;
        with graph breaks, every region's, region by region)."""
        if self.breaks is not None:
            return self.breaks.regions.kernels
        if self.last is None and self.train_parts:
            return [k for part in self.train_parts for k in part.kernels]
        return self.last.kernels if self.last else []

    @property
    def schedule(self) -> str:
        """The last signature's schedule: numbered steps and the memory plan (print it)."""
        if self.breaks is not None:
            return self.breaks.regions.schedule
        if self.last is None:
            raise FusecError("fusec: nothing compiled yet; call the compiled function first")
        return self.last.schedule_text()

    def source(self) -> str:
        """The whole generated program (kernels, schedule, graph) of the last signature."""
        if self.breaks is not None:
            return self.breaks.regions.source()
        if self.last is None:
            raise FusecError("fusec: nothing compiled yet; call the compiled function first")
        return self.last.source()

    def __call__(self, *args, **kwargs):
        """Note: the fast path. Most calls pass the same kind of tensors as the call before. For
        those, `self._fast` is a small generated function: it checks the arguments against the
        last signature (`fast.source` shows how) and, if they match, runs the program's
        straight-line function (fusec/runtime.py), which returns the user's outputs itself.
        Anything else (keyword arguments, non-tensor or nested arguments, a new signature,
        training, check=True) takes the general path, `_call`, which compiles when needed and
        prepares `self._fast` for the next call like this one. (A program that is not one graph
        takes `_call` every time, into its graph-break path: fusec/breaks.py.)"""
        if not kwargs and not self.check:
            out = self._fast(args)
            if out is not _MISS:
                return out
        return self._call(args, kwargs)

    # -- internals ------------------------------------------------------------------------------
    def _call(self, args: tuple, kwargs: dict):
        """The general path: flatten the arguments, pick (or compile) the signature's program,
        train if gradients are needed, run, check, rebuild the outputs' structure."""
        if self.breaks is not None:
            return self.breaks(args, kwargs)
        self._fast = _no_fast_path  # set again below when this call can take the fast path
        module = self.fn if isinstance(self.fn, torch.nn.Module) else None
        plain = not kwargs and all(type(a) is torch.Tensor or isinstance(a, torch.Tensor)
                                   for a in args)
        if plain:
            leaves, structure = list(args), ()  # the common call: positional tensors, flat
        else:  # where each leaf sits is part of the signature: {"a": x, "b": y} is not {"b": ...}
            leaves, names, _ = frontend.flatten_call(self.fn, args, kwargs)
            structure = (tuple(names),)
        lifted = self._state()
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in [*lifted, *leaves] if isinstance(t, torch.Tensor))
        if needs_grad:
            return self._train(args, kwargs)
        key = _signature([*lifted, *leaves],
                         module.training if module is not None else False) + structure
        compiled = self.compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compile(args, kwargs, leaves)
            except GraphBreakError as err:
                return self._graph_breaks(err, args, kwargs)
            self.compiled[key] = compiled
        self.last = compiled
        tensors = [*lifted, *(l for l in leaves if isinstance(l, torch.Tensor))]
        flat_out = _complete(compiled, self._run(compiled, tensors, len(lifted)), tensors)
        if self.check:
            from .check import check_outputs
            check_outputs(self, compiled, args, kwargs, flat_out)
        elif plain and all(type(a) is torch.Tensor for a in args):
            self._fast = self._fast_paths.get(key) or self._fast_path(key, compiled, tensors, len(args))
        return pytree.tree_unflatten(flat_out, compiled.captured.out_spec)

    def _fast_path(self, key: tuple, compiled: "CompiledGraph", tensors: list,
                   n_args: int) -> Callable:
        """The fast path for calls like this one (`n_args` positional plain tensors after the
        module's state, all as in `tensors`): a guard, written out as Python, then the run."""
        captured, n_static = compiled.captured, len(tensors) - n_args
        if compiled.graph_blocker is None:  # CUDA graphs may replay it: the same `_run` as `_call`
            pack = _packer(captured.out_spec)

            def run(tensors):
                tensors = list(tensors)
                return pack(_complete(compiled, self._run(compiled, tensors, n_static), tensors))
        else:  # steps run directly: the straight-line function returns the user's outputs itself
            run = _direct_runner(compiled.program, captured)
        self._fast_paths[key] = fast = _guarded(run, tensors, n_static, self._state_refs,
                                                self._module)
        return fast

    def _run(self, compiled: "CompiledGraph", tensors: list, n_static: int) -> list:
        """Run step by step, or, on CUDA, replay the whole program as one CUDA graph: the first
        call runs normally (it compiles and warms up), the second captures, later ones replay."""
        if self.cuda_graphs is False or compiled.graph_blocker is not None:
            return compiled.program(tensors)
        if compiled.runner is not None:
            out = compiled.runner(tensors)
            if out is not None:
                return out
            compiled.runner = None  # a parameter moved: capture again
        compiled.calls += 1
        if compiled.calls < 2:
            return compiled.program(tensors)
        from .runtime import CudaGraphRunner
        compiled.runner = CudaGraphRunner(compiled.program, tensors, n_static)
        return compiled.runner(tensors)

    def _state(self) -> list[torch.Tensor]:
        """The module's parameters and buffers now (an optimizer may have replaced them)."""
        return [ref.get() for ref in self._state_refs]

    def _compile(self, args, kwargs, leaves) -> CompiledGraph:
        tensors = [l for l in leaves if isinstance(l, torch.Tensor)]
        device = frontend.program_device([*self._state(), *tensors])
        backend = resolve_backend(self.backend, device)
        if backend == "triton":
            _prepare_triton(device)
        with torch.no_grad():
            captured = frontend.capture(self.fn, args, kwargs, stack_traces=_log.wants_stack_traces())
        return compile_graph(captured, backend, record=_log.wants_stack_traces(),
                             label=_label(self.fn))

    def _graph_breaks(self, cause: GraphBreakError, args: tuple, kwargs: dict):
        """The program is not one static graph (`cause` says why and where). fullgraph=True:
        raise that. Otherwise compile the regions around the breaks through TorchDynamo, say so
        once, and call every later signature that way too (fusec/breaks.py)."""
        if self.fullgraph:
            raise GraphBreakError(f"{cause} (fullgraph=True; with fullgraph=False fusec compiles "
                                  "the regions around this and runs it eagerly)",
                                  cause.reason, cause.where) from None
        from .breaks import GraphBroken, warn_graph_breaks
        label = _label(self.fn)
        warn_graph_breaks(label, cause)
        self.breaks = GraphBroken(self.fn, cause, self.backend, self.check, label)
        self._fast, self.last, self.train_parts = _no_fast_path, None, []
        return self.breaks(args, kwargs)

    def _train(self, args, kwargs):
        """Inputs or parameters require grad: compile forward and backward with AOT Autograd
        (fusec/training.py), one compiled pair per input signature."""
        from .training import aot_compile, tensor_args
        module = self.fn if isinstance(self.fn, torch.nn.Module) else None
        leaves, _, _ = frontend.flatten_call(self.fn, args, kwargs)
        lifted = self._state()
        key = ("train",) + _signature([*lifted, *leaves], module.training if module is not None else False)
        entry = self.compiled.get(key)
        if entry is None:
            names = [ref.name for ref in self._state_refs]
            device = frontend.program_device([*lifted, *tensor_args(args, kwargs, self.fn)])
            backend = resolve_backend(self.backend, device)
            if backend == "triton":
                _prepare_triton(device)
            entry = aot_compile(self.fn, args, kwargs, lifted, names, backend, self.check)
            try:  # AOT Autograd traces on the first call
                with frontend.python_at_trace_time_refused(), frontend.compiling(), \
                        frontend.dense_attention_masks():
                    out = entry[0](*lifted, *tensor_args(args, kwargs, self.fn))
            except GraphBreakError as err:
                return self._graph_breaks(err, args, kwargs)
            except Exception as err:
                cause = frontend._capture_error(err)
                if not isinstance(cause, GraphBreakError):
                    raise
                return self._graph_breaks(cause, args, kwargs)
            self.compiled[key] = entry
            self.train_parts, self.last = entry[1], None
            return out
        call, parts = entry
        self.train_parts = parts
        self.last = None
        return call(*lifted, *tensor_args(args, kwargs, self.fn))


class CompiledModule(torch.nn.Module):
    """What `fusec.compile(module)` returns: a module whose forward runs the compiled program."""

    def __init__(self, module: torch.nn.Module, **options):
        super().__init__()
        self._orig_mod = module
        self._compiled = CompiledFunction(module, **options)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    @property
    def kernels(self) -> list[Kernel]:
        return self._compiled.kernels

    def source(self) -> str:
        return self._compiled.source()

    @property
    def schedule(self) -> str:
        return self._compiled.schedule


def _label(fn) -> str:
    """A name for fn in logs and debug folders: the function's or the module class's name."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__name__", type(fn).__name__)


def _prepare_triton(device: torch.device) -> None:
    """Triton runs CPU tensors only under its interpreter, which must be on before import."""
    if device.type == "cuda":
        return
    # Triton reads TRITON_INTERPRET when it is imported (fusec/__init__.py sets it first on a
    # machine without a GPU); a process that imported triton before fusec must have set it itself.
    import fusec
    if os.environ.get("TRITON_INTERPRET") != "1" or fusec.TRITON_IMPORTED_BEFORE_FUSEC and \
            "fusec.codegen.triton_helpers" not in sys.modules and _interpreter_off():
        raise DeviceError("fusec: backend 'triton' with CPU tensors needs Triton's interpreter: "
                          "set TRITON_INTERPRET=1 before triton is imported (fusec does so itself "
                          "on a machine without a GPU if it is imported first), or use backend='cpp'")


def default_device() -> str:
    """Where the examples and the demo put their tensors: the GPU if there is one, unless the user
    asked for Triton's interpreter (TRITON_INTERPRET=1), which runs Triton kernels on the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"


def _interpreter_off() -> bool:
    """True if triton was imported with its interpreter off (its library is compiled-mode)."""
    import triton.language as tl
    return "Interpreted" not in type(tl.standard._sum_combine).__name__ \
        if hasattr(tl, "standard") and hasattr(tl.standard, "_sum_combine") else False


def compile(fn: Callable | None = None, *, backend: str = "auto",
            cuda_graphs: str | bool = "auto", fullgraph: bool = False, check: bool = False):
    """Compile a function or nn.Module into fused kernels.

    Use as `fusec.compile(fn)`, `@fusec.compile`, or `@fusec.compile(backend="cpp", check=True)`.
    backend: "auto" (Triton for CUDA inputs, C++/OpenMP for CPU inputs), "triton", "cpp" or "llvm".
    fullgraph: True: the program must be one graph, or fusec raises a GraphBreakError saying
    why and where. False (the default): a program that cannot be one graph (Python control flow
    on tensor values, `.item()`, data-dependent shapes, print or numpy) is compiled in regions
    through TorchDynamo, with graph breaks between them (fusec/breaks.py; warned once). A
    program captured whole calls straight into its schedule either way.
    check: also run eager PyTorch on every call and raise fusec.MismatchError if a fused result
    is further from a float64 reference than eager's result is (beyond the dtype's tolerance).
    """
    options = dict(backend=backend, cuda_graphs=cuda_graphs, fullgraph=fullgraph, check=check)
    if fn is None:
        return lambda f: compile(f, **options)
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn, **options)
    return CompiledFunction(fn, **options)
