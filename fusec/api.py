"""The public entry point: `fusec.compile`, and what it returns.

    capture (capture/frontend.py) -> compile_graph (driver.py) -> runtime.Program, per signature

`CompiledFunction` keeps one Program per input signature (shapes, strides, dtypes, devices and
the values of non-tensor arguments). A call with a known signature goes straight to its Program
(fastpath.py); a new signature compiles a new one. Two other paths start here: training
(capture/training.py: AOT Autograd's forward and backward, each compiled like any program) and
graph breaks (capture/regions.py: TorchDynamo's regions, each compiled like any program); both
are handed `part_compiler(...)`, the one way a piece of a program is compiled.

What a call must get right besides that lives in its own module, which this file calls: inputs
that share memory (aliasing.py), the Python state a capture read (capture/guards.py), how many
programs a function compiles and keeps (limits.py), threads (runtime/threads.py).

Why this file is long: `CompiledFunction` is the one object every call goes through, and its
paths (the fast path, the general path, a new signature, aliased inputs, training, graph
breaks) read best top to bottom in one class; the mechanisms they use live in the modules above.
"""
from __future__ import annotations

import functools
import threading
import time
import types
import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
from torch._dispatch.python import enable_python_dispatcher

from fusec import check as _check
from fusec import dynamic, events, symbolic
from fusec.dynamic import Family
from fusec.aliasing import AliasedCalls, alias_check, share_memory
from fusec.capture import calls, frontend, guards, tracing
from fusec.capture.breaks import warn_graph_breaks
from fusec.capture.eager_checks import eager_value_checks
from fusec.capture.torch_level import torch_level
from fusec.capture.regions import GraphBroken, Regions, dynamo_regions, original
from fusec.capture.training import aot_compile
from fusec.codegen import backends
from fusec.driver import CompiledGraph, Kernel, compile_graph, gc_paused
from fusec.errors import FusecError, FusecWarning, GraphBreakError, UnsupportedError
from fusec.fastpath import MISS, complete, guarded_call, no_fast_path, call_signature  # noqa: F401
from fusec.fastpath import fast_path_key, flat_args, make_fast_path
from fusec.limits import recompile_limit, remember, touch, trim, warn_limit_reached, what_changed
from fusec.runtime.fast_start import saved
from fusec.runtime.fast_start.fingerprint import fingerprint
from fusec.runtime.cuda_graphs import CudaGraphRunner
from fusec.runtime.training_graphs import GraphPair
from fusec.runtime.threads import one_at_a_time
from fusec.runtime.training_call import fast_path_leaves, training_fast_path, training_fast_path_on

def backend_options() -> tuple[str, ...]:
    """The `backend=` option's values: "auto" and every registered backend (codegen/backends.py,
    fusec's own and any registered from outside)."""
    return ("auto", *backends.BACKENDS)


def check_backend(backend: str) -> None:
    if backend not in backend_options():
        raise FusecError(f"fusec: unknown backend {backend!r}; choose one of "
                         f"{', '.join(backend_options())}")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend that compiles for `device` (the option "auto" picks one: codegen/backends.py),
    made ready for it (Triton on a CPU: its interpreter), or a clear error."""
    device = torch.device(device)
    check_backend(backend)
    if backend == "auto":
        backend = backends.GPU if device.type == "cuda" else _cpu_backend()
    backends.get(backend).prepare(device)
    return backend


def _cpu_backend() -> str:
    """backend="auto" on CPU: the C++/OpenMP backend when a C++ compiler exists, else the LLVM
    backend, which needs none (said once, so the user knows why)."""
    first, fallback = backends.CPU
    if backends.get(first).available():
        return first
    global _SAID_LLVM
    if not _SAID_LLVM:
        _SAID_LLVM = True
        warnings.warn("fusec: no C++ compiler found (see $CXX/$CC); backend='auto' uses the "
                      "LLVM backend (llvmlite) for CPU tensors", stacklevel=4)
    return fallback


_SAID_LLVM = False

def part_compiler(backend: str, check: bool = False) -> Callable:
    """How a piece of a bigger program is compiled: AOT Autograd's forward and backward graphs
    (capture/training.py) and TorchDynamo's regions (capture/regions.py) each become a
    CompiledFunction that runs step by step (its outputs feed autograd or Dynamo, not a caller
    that a CUDA graph could hand its own memory to)."""
    return functools.partial(CompiledFunction, backend=backend, check=check, cuda_graphs=False)


class CompiledFunction:
    """What `fusec.compile(fn)` returns: call it like `fn`."""

    def __init__(self, fn: Callable, backend: str = "auto", cuda_graphs: str | bool = "auto",
                 check: bool = False, fullgraph: bool = False, dynamic: bool | None = None):
        check_backend(backend)
        self.dynamic = dynamic  # None: sizes that change become symbols (fusec/dynamic.py)
        self.families: list[Family] = []  # programs for shape families, most recent last
        # for a graph handed over with symbolic sizes (fusec/dynamic.py `from_examples`): the
        # dims compiled as symbols from the first call, and the int arguments that are sizes
        self.seed_dims: dict = {}
        self.derived: dict = {}
        self.size_relations: tuple | None = None  # and how its sizes relate (training_family.py)
        self._pinned: set = set()  # dims that tracing pinned to numbers: not tried again
        self.fn = fn
        self.backend = backend
        self.cuda_graphs = cuda_graphs
        self.check = check
        self.fullgraph = fullgraph
        self.breaks = None  # a capture.regions.GraphBroken once the program proved not one graph
        # signature -> its program, least recently called first ("Note: limits", fusec/limits.py)
        self.compiled: OrderedDict[tuple, CompiledGraph] = OrderedDict()
        self.compiles = 0  # programs compiled (or loaded) so far, against the recompile limit
        self.recompiles: list[str] = []  # why it compiled again, the last few (fusec.explain)
        self._lock = threading.RLock()  # one compile at a time (see `_compile_new`)
        self._said_limit = False  # the recompile limit's warning is given once
        self._aliased = AliasedCalls()  # calls whose inputs overlap (fusec/aliasing.py)
        self.last: CompiledGraph | None = None
        # a training program's forward or backward on a GPU (capture/training.py): its graphs
        self.graph_pair: GraphPair | None = None
        self.handed_from: int | None = None  # (runtime/training_graphs.py)
        self.train_parts: list = []  # forward and backward CompiledFunctions, when training
        self.train_families: list[Family] = []  # training pairs for shape families, newest last
        self._train_pinned: set = set()  # training dims that tracing pinned: not tried again
        # where each parameter and buffer lives, so a call reads them without walking the module
        # and the Python state its captures read, guarded on every call (capture/guards.py); the
        # refs include what it reaches through globals and closures (a closure's module's weights)
        self._guards = guards.Guards(fn)
        self._state_refs = self._guards.refs
        self._module = fn if isinstance(fn, torch.nn.Module) else None
        self._fast: Callable = no_fast_path  # see __call__
        self._fast_paths: dict[tuple, Callable] = {}  # signature -> its fast path, once made
        self._train_fast: Callable | None = None  # the same for training calls, once made
        self._train_fast_paths: dict[tuple, Callable] = {}  # (fusec/runtime/training_call.py)
        functools.update_wrapper(self, fn, updated=())
        why = _dynamo_first(fn)
        if why is not None:
            self.breaks = _through_dynamo(fn, why, backend, check)

    # -- public ---------------------------------------------------------------------------------
    def __repr__(self) -> str:
        what = f"fusec.compile({label_of(self.fn)}, backend={self.backend!r})"
        if self.breaks is not None:
            return (f"<{what}: compiled in regions by TorchDynamo ({self.breaks.cause.reason});"
                    " print(cf.breaks) for the regions and breaks>")
        if not self.compiled:
            return f"<{what}: not called yet (it compiles at the first call)>"
        kernels = self.kernels
        return (f"<{what}: {len(self.compiled)} program(s); the last has {len(kernels)} "
                f"kernel(s){': ' + ', '.join(k.name for k in kernels[:3]) if kernels else ''}"
                f"{', ...' if len(kernels) > 3 else ''}>")

    @property
    def kernels(self) -> list[Kernel]:
        """The kernels of the last input signature called (forward, then backward, in training;
        with graph breaks, every region's, region by region)."""
        if self.breaks is not None:
            return self.breaks.regions.kernels
        if self.last is None and self.train_parts:
            return [k for part in self.train_parts for k in part.kernels]
        return self.last.kernels if self.last else NothingCompiledYet()

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
        straight-line function (fusec/runtime/writer.py), which returns the user's outputs itself.
        Anything else (keyword arguments, non-tensor or nested arguments, a new signature,
        training, check=True) takes the general path, `_call`, which compiles when needed and
        prepares `self._fast` for the next call like this one. (A program that is not one graph
        takes `_call` every time, into its graph-break path: fusec/capture/regions.py.) Training
        calls, keyword arguments included, have a fast path of their own, `self._train_fast`
        (fusec/runtime/training_call.py), which `_train` prepares."""
        if _functorch_active():  # inside torch.func.vmap / grad / jvp ...: see `_transformed`
            return self._transformed(args, kwargs)
        if not self.check:
            out = self._fast(args) if not kwargs else MISS
            if out is MISS and self._train_fast is not None:
                out = self._train_fast(args, kwargs)
            if out is not MISS:
                return out
        return self._call(args, kwargs)

    # -- internals ------------------------------------------------------------------------------
    def _transformed(self, args: tuple, kwargs: dict):
        """A call inside a torch.func transform (vmap, grad, jacrev, jvp, functional_call's
        callers...) gets wrapped tensors (batched, grad-tracking, dual) that a compiled program,
        which computes plain tensors, cannot take: the function runs eagerly, as the transform
        expects, and fusec says so once. (TorchDynamo traces through these transforms; fusec
        captures below them.)"""
        if not getattr(self, "_said_transformed", False):
            self._said_transformed = True
            warnings.warn(FusecWarning(
                f"fusec: {label_of(self.fn)} is called inside a torch.func transform (vmap, grad, "
                "jvp ...); it runs eagerly there (its compiled program takes plain tensors)"),
                stacklevel=3)
        return self.fn(*args, **kwargs)

    def _call(self, args: tuple, kwargs: dict):
        """The general path: flatten the arguments, pick (or compile) the signature's program,
        train if gradients are needed, run, check, rebuild the outputs' structure."""
        if self.breaks is not None:
            return self.breaks(args, kwargs)
        self._fast = no_fast_path  # set again below when this call can take the fast path
        self._train_fast = None  # (set again by `_train` for a training call)
        module = self.fn if isinstance(self.fn, torch.nn.Module) else None
        plain = not kwargs and all(type(a) is torch.Tensor or isinstance(a, torch.Tensor)
                                   for a in args)
        if plain:
            leaves, structure = list(args), ()  # the common call: positional tensors, flat
        else:  # where each leaf sits is part of the signature: {"a": x, "b": y} is not {"b": ...}
            leaves, names, _ = calls.flatten_call(self.fn, args, kwargs)
            structure = (tuple(names),)
        lifted = self._state()
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in [*lifted, *leaves] if isinstance(t, torch.Tensor))
        if needs_grad:  # (one thread at a time: its first call compiles, as `_compile_new`)
            with self._lock:
                return self._train(args, kwargs, leaves, lifted)
        key = call_signature([*lifted, *leaves],
                         module.training if module is not None else False) + structure
        if self.derived:  # ints that are sizes of tensor arguments: where from, not the value
            entries = list(key)
            mine = entries[1 + len(lifted):1 + len(lifted) + len(leaves)]
            dynamic.derive(mine, leaves, self.derived)
            entries[1 + len(lifted):1 + len(lifted) + len(leaves)] = mine
            key = tuple(entries)
        key += self._guards.key()  # the values of the Python state its program read
        compiled = self.compiled.get(key)
        family = None
        if compiled is None and self.families:  # a program for every size of some dims?
            family = self._family_for([*lifted, *(l for l in leaves if isinstance(l, torch.Tensor))],
                                      key)
            compiled = family.compiled if family is not None else None
        if compiled is None:
            if self._state_moved():
                return self._call(args, kwargs)
            compiled = self._compile_new(key, args, kwargs, leaves)
            if not isinstance(compiled, CompiledGraph):
                return compiled.result(args, kwargs)  # graph breaks, or eager past the limit
            key = self._guards.rekeyed(key)
        else:
            touch(self.compiled, key)
        self.last = compiled
        tensors = [*lifted, *(l for l in leaves if isinstance(l, torch.Tensor))]
        aliased = alias_check(compiled.program, tensors)  # None unless it writes into inputs
        if aliased is not None:
            return self._aliased_call(aliased, key, args, kwargs, leaves, tensors, len(lifted))
        run = one_at_a_time(self._run, compiled)  # (fusec/runtime/threads.py)
        rng = _check.rng_state(compiled) if self.check else None  # (random ops: eager's too)
        flat_out = complete(compiled, run(compiled, tensors, len(lifted)), tensors)
        if self.check:
            _check.check_outputs(self, compiled, args, kwargs, flat_out, rng)
        elif not kwargs and flat_args(args):  # tensors, and ints (a family's backward's sizes)
            kept = fast_path_key(key, compiled, args, self.derived)
            # (one fast path for a whole family, checking the Python state this call's key holds)
            self._fast = self._fast_paths.get(kept) or self._fast_path(key, compiled, tensors,
                                                                       args, kept)
        return calls.unflatten_outputs(flat_out, compiled.captured.out_spec)

    def _fast_path(self, key: tuple, compiled: "CompiledGraph", tensors: list,
                   args: tuple, kept: tuple | None = None) -> Callable:
        """The fast path for calls like this one (fusec/fastpath.py), kept for its signature (or,
        `kept`, for its shape family)."""
        self._fast_paths[kept or key] = fast = make_fast_path(compiled, tensors, args, self,
                                                      self._state_refs, self._module,
                                                      self._guards.fast_lines(key), self.derived)
        return fast

    # -- new signatures: one compile at a time, a limit, a bounded memory ----------------------
    def _compile_new(self, key: tuple, args: tuple, kwargs: dict, leaves: list,
                     same: dict | None = None):
        """The program for a signature not compiled yet, or an `_Instead` (graph breaks, or past
        the recompile limit: eager; "Note: limits" in fusec/limits.py). One compile at a time per
        function: a thread that waited here finds the program the other thread compiled.
        (`same`: which inputs are the very same tensor, fusec/aliasing.py.)"""
        with self._lock:
            compiled = self.compiled.get(self._guards.compiled_meanwhile(key))
            if compiled is not None:
                return compiled
            tensors = [*self._state(), *(l for l in leaves if isinstance(l, torch.Tensor))]
            family = self._family_for(tensors, key) if self.families and not same else None
            if family is not None:  # another thread compiled a family that serves this call
                return family.compiled
            limit = recompile_limit()
            for old in trim(self.compiled, limit):  # (only when the limit was lowered)
                if self._fast_paths.pop(old, None) is self._fast:
                    self._fast = no_fast_path
            if self.compiles >= limit:
                if not self._said_limit:
                    self._said_limit = True
                    changed = self._changed(key, args, kwargs)
                    remember(self.recompiles, f"past the recompile limit ({limit}), ran "
                                              f"eagerly: {changed}")
                    warn_limit_reached(label_of(self.fn), self.compiles, limit, changed)
                return _Instead(self._eager)
            if self.compiles:
                changed = self._changed(key, args, kwargs)
                broken, self._broken = getattr(self, "_broken", None), None
                if broken:  # (fusec/dynamic.py: the shape family's program did not serve it;
                    # `changed` compares with the last signature compiled, not the last call's:
                    # a fast-path call is not written down)
                    changed = (f"outside the shape family (its guard {broken} failed); against "
                               f"the last program compiled: {changed}")
                remember(self.recompiles, changed)
                events.publish("recompiled", label_of(self.fn), changed)
            dims = {} if same else self._dynamic_dims(key, tensors)
            try:
                compiled, key = self._compile_dynamic(key, args, kwargs, leaves, tensors, dims) \
                    if dims else self._compile_recorded(key, args, kwargs, leaves, same)
            except GraphBreakError as err:
                out = self._graph_breaks(err, args, kwargs)
                return _Instead(lambda *_: out)
            self.compiles += 1
            compiled.program.prepare()  # its pool bound now, before two threads can run it
            self.compiled[key] = compiled
            return compiled

    # -- shape families (fusec/dynamic.py) -----------------------------------------------------
    def _family_for(self, tensors: list, key: tuple) -> Family | None:
        """The shape family program that serves this call (its guards hold), else None; a family
        whose guards this call broke says which, for the recompile's reason."""
        rest = _rest_of(key)
        for family in reversed(self.families):
            if family.key != dynamic.family_key(tensors, family.dims, rest):
                continue
            if family.check(tensors):
                return family
            self._broken = dynamic.failed_guard(family.compiled.captured, tensors)
        return None

    def family_dims(self, args: tuple, kwargs: dict) -> dict | None:
        """The dims a call like this one runs with as symbols (its shape family's), or None when
        it runs a program of its own signature (fusec.explain compiles the same one)."""
        leaves = calls.flatten_call(self.fn, args, kwargs)[0]
        tensors = [*self._state(), *(l for l in leaves if isinstance(l, torch.Tensor))]
        module = self.fn if isinstance(self.fn, torch.nn.Module) else None
        key = call_signature([*self._state(), *leaves],
                             module.training if module is not None else False)
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            key += ()
        else:
            key += (tuple(calls.flatten_call(self.fn, args, kwargs)[1]),)
        key += self._guards.key()
        if key in self.compiled and self.compiled[key].captured.shape_env is None:
            return None
        family = self._family_for(tensors, key)
        return dict(family.dims) if family is not None else None

    def _dynamic_dims(self, key: tuple, tensors: list, training: bool = False) -> dict:
        """{flat tensor position: dims} to compile as symbols for this new signature, by the
        policy (fusec/dynamic.py): the dims marked dynamic, every dim with dynamic=True, and
        with dynamic=None the dims whose sizes differ from an earlier call alike in all else,
        and a broken family's dims again. `training`: for a training signature, against the
        earlier training signatures and families (fusec/capture/training_family.py)."""
        if self.dynamic is False or self.check:
            return {}
        n_static = len(self._state_refs)
        families = self.train_families if training else self.families
        dims = {i: frozenset(dynamic.marked_dims(t)) for i, t in enumerate(tensors)
                if i >= n_static and dynamic.marked_dims(t)}
        for i, ds in ({} if training else self.seed_dims).items():  # (a graph handed over
            dims[n_static + i] = dims.get(n_static + i, frozenset()) | ds  # with symbolic sizes)
        if self.dynamic:
            dims = {i: frozenset(ds) | dims.get(i, frozenset())
                    for i, ds in dynamic.all_dims(tensors, n_static).items()}
        else:
            rest, new = _rest_of(key), _tensor_entries(key)
            for old_key in reversed(self.compiled):
                if (old_key[:1] == ("train",)) != training or _rest_of(old_key) != rest:
                    continue
                changed = dynamic.changed_dims(_tensor_entries(old_key), new, n_static)
                if changed:
                    dims = {i: changed.get(i, frozenset()) | dims.get(i, frozenset())
                            for i in set(changed) | set(dims)}
                    break
            for family in families:  # a family whose guards broke: its dims again
                if family.key == dynamic.family_key(tensors, family.dims, rest):
                    dims = {i: family.dims.get(i, frozenset()) | dims.get(i, frozenset())
                            for i in set(family.dims) | set(dims)}
        dims = {i: frozenset(d for d in ds if tensors[i].shape[d] >= 2) for i, ds in dims.items()}
        dims = {i: ds for i, ds in dims.items() if ds}  # (0 and 1 are never symbols)
        pinned = self._train_pinned if training else self._pinned
        return {} if tuple(sorted(dims.items())) in pinned else dims

    def _compile_dynamic(self, key, args, kwargs, leaves, tensors: list, dims: dict):
        """Compile the program for a shape family (`dims` as symbols) and keep it as one; where
        that fails, the program for this call's sizes alone, and the reason in `recompiles`."""
        try:
            # (torch's Python implementations of ops, as AOT Autograd and make_fx's symbolic mode
            # use them: the C++ kernels of some, constant_pad_nd's, read sizes as numbers)
            with self._guards.recording(key) as recorded, dynamic.ones_in_family(), \
                    enable_python_dispatcher(), \
                    tracing.grad_mode_of_caller(recorded.grad_mode_read):
                compiled = self._capture_and_compile(args, kwargs, None, events.wants_detail(),
                                                     True, tensors, None, dims)
        except Exception as err:  # noqa: BLE001 (the static program is always there)
            remember(self.recompiles, f"could not compile for every size ({type(err).__name__}: "
                                      f"{str(err).splitlines()[0][:200]}); compiled for this size")
            return self._compile_recorded(key, args, kwargs, leaves)
        if compiled.captured.shape_env is None:  # (tracing pinned every symbol: no family)
            self._pinned.add(tuple(sorted(dims.items())))
            remember(self.recompiles, "no size stayed a symbol while tracing (an op read each "
                                      "as a number): compiled for this size")
            return compiled, recorded.key
        check, texts = dynamic.guard_check(compiled.captured)
        family = Family(dims, dynamic.family_key(tensors, dims, _rest_of(recorded.key)), compiled,
                        check, texts)
        self.families.append(family)
        return compiled, recorded.key

    def _eager(self, args: tuple, kwargs: dict):
        return self.fn(*args, **kwargs)

    def _names(self, args: tuple, kwargs: dict) -> list[str]:
        """Every input's name, in signature order: parameters and buffers, then arguments."""
        return [ref.name for ref in self._state_refs] + calls.flatten_call(self.fn, args, kwargs)[1]

    def _changed(self, key: tuple, args: tuple, kwargs: dict) -> str:
        """What makes `key` a new signature, compared with the signature called most recently."""
        last = next((k for k in reversed(self.compiled) if k[:1] != ("train",)), None)
        return self._guards.reason(key) or what_changed(last, key, self._names(args, kwargs))

    def _aliased_call(self, aliased: tuple, key: tuple, args: tuple, kwargs: dict, leaves: list,
                      tensors: list, n_static: int):
        """This call's inputs share memory, and its program writes into one of them (see "Note
        (aliased inputs)" in fusec/aliasing.py, which decides): a program of its own for inputs
        that are the very same tensor (after one eager call), else eager. No fast path."""
        key = self._aliased.program_key(aliased, key, label_of(self.fn),
                                        lambda: self._names(args, kwargs))
        compiled = self.compiled.get(key) if key is not None else None
        if compiled is None and self._aliased.runs_eagerly(key):
            out = self.fn(*args, **kwargs)
            self._aliased.ran(key)
            return out
        if compiled is None:
            compiled = self._compile_new(key, args, kwargs, leaves, same=aliased[1])
            if not isinstance(compiled, CompiledGraph):
                return compiled.result(args, kwargs)
        else:
            touch(self.compiled, key)
        self.last = compiled
        run = one_at_a_time(self._run, compiled)
        flat_out = complete(compiled, run(compiled, tensors, n_static), tensors)
        return calls.unflatten_outputs(flat_out, compiled.captured.out_spec)

    # -- pickling ---------------------------------------------------------------------------------
    def __get__(self, instance, owner=None):
        """`@fusec.compile` on a method in a class body (`def forward(self, x)`, as people write
        it for torch.compile): read from an instance, it is that instance's own compiled bound
        method, as `fusec.compile(model.forward)` would make (the module's parameters lifted as
        its state, read at each call), made at the first read and kept while the instance lives.
        Read from the class, it is this object."""
        if instance is None:
            return self
        methods = vars(self).setdefault("_methods", weakref.WeakKeyDictionary())
        try:
            return methods[instance]
        except KeyError:
            pass
        except TypeError:  # (not weakly referable or not hashable: a new one at each read)
            methods = {}
        bound = methods[instance] = CompiledFunction(types.MethodType(self.fn, instance),
                                                     **self.__getstate__()["options"])
        return bound

    def __getstate__(self) -> dict:
        """A pickle (or a deep copy) keeps what `fusec.compile` was given, not the programs (they
        hold built kernels, locks and memory): the copy compiles, or loads the programs saved on
        disk (fusec/runtime/fast_start/saved.py), on its first call."""
        return {"fn": self.fn, "options": dict(backend=self.backend, cuda_graphs=self.cuda_graphs,
                                               check=self.check, fullgraph=self.fullgraph,
                                               dynamic=self.dynamic)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["fn"], **state["options"])

    def _run(self, compiled: "CompiledGraph", tensors: list, n_static: int) -> list:
        """Run step by step, or, on CUDA, replay the whole program as one CUDA graph: the first
        call runs normally (it compiles and warms up), the second captures, later ones replay.
        A training program's forward or backward: runtime/training_graphs.py decides."""
        if self.graph_pair is not None:
            return self.graph_pair.run(compiled, tensors, self.handed_from)
        if self.cuda_graphs is False or compiled.graph_blocker is not None:
            return compiled.program(tensors)
        if compiled.captured.shape_env is not None:  # a shape family: one CUDA graph per size
            return self._run_sized(compiled, tensors, n_static)
        if compiled.runner is not None:
            out = compiled.runner(tensors)
            if out is not None:
                return out
            compiled.runner = None  # a parameter moved: capture again
        compiled.calls += 1
        if compiled.calls < 2:
            return compiled.program(tensors)
        compiled.runner = CudaGraphRunner(compiled.program, tensors, n_static)
        return compiled.runner(tensors)

    GRAPHS_PER_FAMILY = 8  # CUDA graphs a shape family's program keeps (the sizes used last)

    def _run_sized(self, compiled: "CompiledGraph", tensors: list, n_static: int) -> list:
        """A shape family's program on CUDA: a CUDA graph is captured for each size, as
        reduce-overhead does per size bucket (the second call of that size captures), and the
        GRAPHS_PER_FAMILY sizes used last keep theirs; other sizes run step by step."""
        size = tuple((tuple(t.shape), tuple(t.stride())) for t in tensors[n_static:])
        runners = compiled.__dict__.setdefault("sized_runners", OrderedDict())
        calls = compiled.__dict__.setdefault("sized_calls", {})
        runner = runners.get(size)
        if runner is not None:
            runners.move_to_end(size)
            out = runner(tensors)
            if out is not None:
                return out
            del runners[size]  # a parameter moved: capture again
        calls[size] = calls.get(size, 0) + 1
        if calls[size] < 2:
            if len(calls) > 4 * self.GRAPHS_PER_FAMILY:
                calls.clear()  # (a bounded memory of sizes seen once)
            return compiled.program(tensors)
        runners[size] = CudaGraphRunner(compiled.program, tensors, n_static)
        while len(runners) > self.GRAPHS_PER_FAMILY:
            runners.popitem(last=False)
        return runners[size](tensors)

    def _state(self) -> list[torch.Tensor]:
        """The module's parameters and buffers now (an optimizer may have replaced them). One
        set to None or deleted (`lin.bias = None`) is no longer state to lift: the refs are
        found again (`_state_moved`)."""
        try:
            state = [ref.get() for ref in self._state_refs]
        except (KeyError, AttributeError, ValueError):
            state = None
        if (state is None or any(t is None for t in state)) and self._state_moved():
            return self._state()
        return state

    def _state_moved(self) -> bool:
        """Before compiling: do its globals and closures now reach other state to lift (`lin`
        rebound to another module)? Then the lifted refs change, and the call starts again."""
        if not self._guards.moved():
            return False
        self._state_refs = self._guards.refs
        self._fast, self._train_fast = no_fast_path, None
        self._train_fast_paths.clear()  # (they read the state where the old refs found it)
        return True

    def _compile_recorded(self, key: tuple, args, kwargs, leaves, same: dict | None = None):
        """`_compile`, writing down the Python state it read (capture/guards.py). Returns the
        program and its key, whose guards' part holds the values the program was compiled for."""
        with self._guards.recording(key) as recorded, \
                tracing.grad_mode_of_caller(recorded.grad_mode_read):
            compiled = self._compile(args, kwargs, leaves, same)
        return compiled, recorded.key

    def _compile(self, args, kwargs, leaves, same: dict | None = None) -> CompiledGraph:
        """Compile the program for this call, or load the one a process before compiled for a
        call just like it (fusec/runtime/fast_start/: saved.py, keyed by fingerprint.py)."""
        tensors = [*self._state(), *(l for l in leaves if isinstance(l, torch.Tensor))]
        real = [t for t in tensors if not calls.is_cpu_scalar(t)]
        backend = None
        if real and len({t.device for t in real}) == 1:  # before capture: it starts Triton's
            backend = resolve_backend(self.backend, real[0].device)  # cache key in a thread
        detail = events.wants_detail()  # source lines and per-pass graphs, for a watcher
        key = None
        # a saved program has no graphs to show a watcher, and check=True compares with them;
        # the pieces of training and graph breaks (GraphModules) are compiled as they come
        if backend is not None and not detail and not self.check and saved.enabled() \
                and not isinstance(self.fn, torch.fx.GraphModule) and not same:
            start = time.perf_counter()
            backends.get(backend).module  # imported now, so that its settings count every time
            with gc_paused():
                key = fingerprint(self.fn, args, kwargs, backend)
            seconds = time.perf_counter() - start
            if key is not None:
                remake = saved.placeholders(args, kwargs)
                with gc_paused():  # (unpickling, too, makes many objects and no garbage)
                    loaded = saved.load(key, lambda: self._capture_and_compile(*remake(), backend))
                if loaded is not None:
                    loaded.times["capture"] += seconds  # the fingerprint stood in for capture
                    events.publish("compiled", loaded, label_of(self.fn))
                    return loaded
        compiled = self._capture_and_compile(args, kwargs, backend, detail, bool(real), tensors,
                                             same)
        if key is not None:
            compiled.times["capture"] += seconds
            saved.save(key, compiled)
        return compiled

    def _capture_and_compile(self, args, kwargs, backend: str | None, detail: bool = False,
                             has_real: bool = True, tensors: list | None = None,
                             same: dict | None = None, dims: dict | None = None) -> CompiledGraph:
        if share_memory(args, kwargs, self._state()):  # traced as distinct tensors (unless
            args, kwargs = saved.placeholders(args, kwargs)()  # `same` says otherwise): the
            # signature, and so the program, is for any tensors like these, aliased or not
        with gc_paused():  # (fusec/driver.py: tracing makes many objects and no garbage)
            with torch.no_grad():  # (inputs on two devices: capture says if an op mixes them)
                # (check=True records the user's lines too: a check that cannot compare an
                # output drawn from random numbers names the line that drew them)
                captured = frontend.capture(self.fn, args, kwargs, stack_traces=detail or
                                            self.check, same=same, reached=self._guards.reached,
                                            dynamic=dims, derived=self.derived if dims else None,
                                            relations=self.size_relations if dims else None)
            if has_real and backend is None:  # CPU indices next to CUDA data: copied to CUDA
                backend = resolve_backend(self.backend, calls.program_device(tensors))
            elif backend is None:  # no tensor arguments: where its factories make them
                device = calls.graph_device(captured.gm)  # (`torch.ones(3, device="cuda")`)
                # a program with no tensor at all (`torch.broadcast_shapes`) has no kernel for
                # any backend to build: whichever backend this machine runs is as good
                backend = resolve_backend(self.backend if device is not None else "auto",
                                          device or torch.device("cpu"))
            return compile_graph(captured, backend, record=detail, label=label_of(self.fn))

    def _graph_breaks(self, cause: GraphBreakError, args: tuple, kwargs: dict):
        """The program is not one static graph (`cause` says why and where). fullgraph=True:
        raise that. Otherwise compile the regions around the breaks through TorchDynamo, say so
        once, and call every later signature that way too (fusec/capture/regions.py)."""
        if self.fullgraph:
            raise GraphBreakError(f"{cause} (fullgraph=True; with fullgraph=False fusec compiles "
                                  "the regions around this and runs it eagerly)",
                                  cause.reason, cause.where) from None
        label = label_of(self.fn)
        warn_graph_breaks(label, cause)
        self.breaks = GraphBroken(self.fn, cause, part_compiler(self.backend, self.check),
                                  self.backend, label)
        self._fast, self.last, self.train_parts = no_fast_path, None, []
        self._train_fast = None
        return self.breaks(args, kwargs)

    def _train(self, args, kwargs, leaves: list, lifted: list):
        """Inputs or parameters require grad: compile forward and backward with AOT Autograd
        (fusec/capture/training.py), one compiled pair per input signature, or one per shape
        family once a size changed (`_train_new`). `leaves` and `lifted`: the call's flat
        arguments and the module's state, as `_call` found them (a step of a small model is a
        few milliseconds: flattening a call again costs ~0.1 ms)."""
        module = self.fn if isinstance(self.fn, torch.nn.Module) else None
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        key = ("train",) + call_signature([*lifted, *leaves], module.training if module is not None else False)
        key += self._guards.key()  # the values of the Python state its program read
        entry = self.compiled.get(key)
        family = None
        if entry is not None and entry[1].family is not None:  # the family's first size
            family = next((f for f in self.train_families if f.compiled is entry), None)
        if entry is None and self.train_families:
            family = self._train_family_for([*lifted, *tensors], key)
            entry = family.compiled if family is not None else None
        if entry is None:
            if self._state_moved():
                return self._call(args, kwargs)
            return self._train_new(key, args, kwargs, lifted, tensors)
        call, parts = entry
        self.train_parts = parts
        self.last = None
        # (a family's pair: its fast path checks the caller's sizes with the family's guards)
        if (parts.family is None or family is not None) and not self.check \
                and training_fast_path_on() and fast_path_leaves(args, kwargs, leaves):
            self._train_fast = self._training_fast_path(key, entry, lifted, args, kwargs, family)
        return call(*lifted, *tensors)

    def _train_new(self, key: tuple, args, kwargs, lifted: list, tensors: list):
        """Compile the training pair for a call no pair serves (a shape family's, when the
        policy makes some dims symbols: `_dynamic_dims`), run its forward, and keep it."""
        names = [ref.name for ref in self._state_refs]
        dims = self._dynamic_dims(key, [*lifted, *tensors], training=True)
        if self.compiles:  # a training program again: say why, as `_compile_new` does
            last = next((k for k in reversed(self.compiled) if k[:1] == ("train",)), None)
            changed = self._guards.reason(key) or what_changed(
                last and last[1:], key[1:], self._names(args, kwargs))
            broken, self._broken = getattr(self, "_broken", None), None
            if broken:
                changed = f"outside the shape family (its guard {broken} failed); {changed}"
            if dims:
                changed += "; a training shape family, with symbols for " + \
                    self._dims_text(dims, args, kwargs)
            remember(self.recompiles, f"training: {changed}")
            events.publish("recompiled", label_of(self.fn), changed)
        device = calls.program_device([*lifted, *tensors])
        backend = resolve_backend(self.backend, device)
        entry = aot_compile(self.fn, args, kwargs, lifted, names,
                            part_compiler(backend, self.check), self._guards.reached, dims,
                            graphs=GraphPair() if self.cuda_graphs is True else None)
        try:  # AOT Autograd traces on the first call
            # (an argument object holding tensors, a filled cache: a graph break, as capture)
            calls.check_arguments(*calls.flatten_call(self.fn, args, kwargs)[:2])
            with self._guards.recording(key) as recorded, \
                    tracing.python_at_trace_time_refused(), tracing.compiling(), \
                    tracing.dense_attention_masks(), torch_level(), eager_value_checks():
                out = entry[0](*lifted, *tensors)
            key = recorded.key
        except GraphBreakError as err:
            return self._graph_breaks(err, args, kwargs)
        except Exception as err:
            cause = tracing.capture_error(err)
            if isinstance(cause, GraphBreakError):
                return self._graph_breaks(cause, args, kwargs)
            if not dims:
                raise
            # (the pair for this call's sizes alone is always there, as `_compile_dynamic`'s)
            self._train_pinned.add(tuple(sorted(dims.items())))
            remember(self.recompiles, f"training: could not compile for every size "
                                      f"({type(err).__name__}: {str(err).splitlines()[0][:200]});"
                                      " compiled for this size")
            return self._train_new(key, args, kwargs, lifted, tensors)
        if dims:
            self._keep_train_family(entry, dims, key, [*lifted, *tensors])
        self.compiled[key] = entry
        self.compiles += 1
        self.train_parts, self.last = entry[1], None
        return out

    # -- training shape families (fusec/capture/training_family.py) ------------------------------
    def _train_family_for(self, tensors: list, key: tuple) -> Family | None:
        """The training shape family whose pair serves this call (its guards hold), else None;
        a family whose guards this call broke says which, for the recompile's reason."""
        rest = _rest_of(key)
        for family in reversed(self.train_families):
            if family.key != dynamic.family_key(tensors, family.dims, rest):
                continue
            if family.check(tensors):
                return family
            self._broken = dynamic.failed_guard(family.compiled[1].family, tensors)
        return None

    def _keep_train_family(self, entry: tuple, dims: dict, key: tuple, tensors: list) -> None:
        """Keep a training pair traced with `dims` as symbols as a shape family, with its guards
        (the ShapeEnv's: fusec/dynamic.py `guard_check`); where tracing made every symbol a
        number again (a size read as an int), it stays the pair of this signature only."""
        traced = entry[1].family
        if traced is None or not any(symbolic.is_symbolic(tuple(node.meta["val"].shape))
                                     for node in traced.gm.graph.nodes if node.op == "placeholder"):
            entry[1].family = None
            self._train_pinned.add(tuple(sorted(dims.items())))
            remember(self.recompiles, "training: no size stayed a symbol while tracing (an op "
                                      "read each as a number): compiled for this size")
            return
        check, texts = dynamic.guard_check(traced)
        self.train_families.append(Family(dims, dynamic.family_key(tensors, dims, _rest_of(key)),
                                          entry, check, texts))

    def _dims_text(self, dims: dict, args: tuple, kwargs: dict) -> str:
        """`dims` in words: "dim 0 of x, dim 1 of labels"."""
        names = self._names(args, kwargs)
        n_static = len(self._state_refs)
        tensor_names = names[:n_static] + [n for n, leaf in zip(
            names[n_static:], calls.flatten_call(self.fn, args, kwargs)[0])
            if isinstance(leaf, torch.Tensor)]
        return ", ".join(f"dim {d} of {tensor_names[i] if i < len(tensor_names) else i}"
                         for i, ds in sorted(dims.items()) for d in sorted(ds))

    def _training_fast_path(self, key: tuple, entry: tuple, lifted: list, args: tuple,
                            kwargs: dict, family: Family | None = None) -> Callable:
        """The fast path for training calls like this one (fusec/runtime/training_call.py),
        made once per signature (or shape family) and way of passing the arguments: it runs
        `entry`'s forward as `_train` does, one thread at a time. A family's path checks the
        caller's sizes and strides with the family's guards, so one serves every size."""
        kept = (("family", id(entry), self._guards.key()) if family is not None else key) \
            + (len(args), tuple(kwargs))
        fast = self._train_fast_paths.get(kept)
        if fast is None:
            call, parts = entry
            lock = self._lock

            def hit(*tensors):
                with lock:
                    self.train_parts, self.last = parts, None
                    return call(*tensors)
            fast = self._train_fast_paths[kept] = training_fast_path(
                hit, lifted, args, kwargs, self._state_refs, self._module,
                self._guards.fast_lines(key), family.check if family is not None else None)
        return fast


class NothingCompiledYet(list):
    """`cf.kernels` before the first call: an empty list (tests and loops read it as one) that
    says, when printed, why it is empty: fusec compiles at the first call, for its inputs."""

    def __repr__(self) -> str:
        return ("[]  (nothing compiled yet: fusec compiles at the first call, cf(*inputs), "
                "for those inputs' shapes and dtypes; then cf.kernels lists the kernels)")


class CompiledModule(torch.nn.Module):
    """What `fusec.compile(module)` returns: a module whose forward runs the compiled program."""

    def extra_repr(self) -> str:  # under the wrapped module's own lines: what fusec made of it
        c = self._compiled
        if c.breaks is not None:
            return f"backend={c.backend!r}, compiled in regions by TorchDynamo (graph breaks)"
        if not c.compiled and not c.train_parts:
            return f"backend={c.backend!r}, not called yet (it compiles at the first call)"
        names = [k.name for k in c.kernels]
        return (f"backend={c.backend!r}, {len(names)} kernel(s) in the last program"
                f"{': ' + ', '.join(names[:3]) if names else ''}{', ...' if len(names) > 3 else ''}")

    # It stands for the module it wraps, as torch.compile's OptimizedModule does: attributes
    # (`cm.fc1`, `cm.config`), `len`, `dir`, `.training` and attribute writes (`cm.fc1 = ...`:
    # guards see the new child at the next call) go to the wrapped module; its state_dict keys
    # start with `_orig_mod.` as torch.compile's do.
    _OWN = frozenset({"_orig_mod", "_compiled"})

    def __init__(self, module: torch.nn.Module, **options):
        super().__init__()
        self._orig_mod = module
        self._compiled = CompiledFunction(module, **options)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    def __getattr__(self, name: str):
        if name == "_orig_mod":  # (before it is set, nn.Module's own lookup has failed)
            return self.__dict__["_modules"]["_orig_mod"]
        return getattr(self._orig_mod, name)

    def __setattr__(self, name: str, value) -> None:
        if name in CompiledModule._OWN or hasattr(type(self), name):
            return super().__setattr__(name, value)
        return setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str) -> None:
        if name in CompiledModule._OWN or hasattr(type(self), name):
            return super().__delattr__(name)
        return delattr(self._orig_mod, name)

    @property
    def training(self) -> bool:
        return self._orig_mod.training

    @training.setter
    def training(self, mode: bool) -> None:  # (nn.Module.__init__ sets it before _orig_mod is)
        if "_orig_mod" in self.__dict__.get("_modules", {}):
            self._orig_mod.training = mode

    def __len__(self) -> int:
        return len(self._orig_mod)

    def __dir__(self):
        return sorted(set(dir(self._orig_mod)) | set(super().__dir__()))

    @property
    def kernels(self) -> list[Kernel]:
        return self._compiled.kernels

    def source(self) -> str:
        return self._compiled.source()

    @property
    def schedule(self) -> str:
        return self._compiled.schedule


class _Instead:
    """What `_compile_new` returns when a call takes another path than a new program:
    `result(args, kwargs)` gives the call's outputs."""

    def __init__(self, result: Callable):
        self.result = result


_functorch_active = torch._C._are_functorch_transforms_active  # (~0.03 us)


def _is_tensor_entry(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 5 and isinstance(entry[2], torch.dtype)


def _rest_of(key: tuple) -> tuple:
    """A signature without its tensors' entries: the grad flag, non-tensor values, the call's
    structure and the Python state's values."""
    return tuple(e for e in key if not _is_tensor_entry(e))


def _tensor_entries(key: tuple) -> list:
    """(shape, dtype, device) of each tensor in a signature."""
    return [(e[0], e[2], e[3]) for e in key if _is_tensor_entry(e)]


def _dynamo_first(fn) -> str | None:
    """Why `fn` goes to TorchDynamo from the start (None: fusec captures it itself).

    An optimizer's step keeps its state in Python objects (`param_groups`, `state`, created at
    the first step), which a traced graph would write once, while tracing. DistributedDataParallel
    prepares its gradient all-reduce in Python on every forward (`prepare_for_backward`); traced
    once, later steps skipped it and each process trained on its own gradients (a silent wrong
    answer). FSDP gathers each block's parameters in hooks and frees them after (a traced graph
    would read freed storage). TorchDynamo tracks Python side effects and knows DDP (it splits the
    graph at DDP's gradient buckets so the all-reduce overlaps backward) and FSDP, so these go to
    it, as `torch.compile` would take them; fusec compiles the graphs it hands over. (Compiling
    each block before `fully_shard` wraps it, the usual FSDP2 recipe, needs none of this.)"""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.optim.Optimizer):
        return "an optimizer step (its state lives in Python objects)"
    module = owner if isinstance(owner, torch.nn.Module) else fn
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel (its gradient all-reduce is prepared in Python each step)"
    if is_fsdp(module):
        return ("a module sharded by FSDP (fully_shard): its parameters are gathered and freed "
                "by hooks around each block")
    return None


def is_fsdp(module) -> bool:
    """A module wrapped by FSDP2's `fully_shard` (or FSDP1). (torch.distributed is imported only
    where it is already loaded: a program that never used it does not pay for it here.)"""
    import sys
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, torch.nn.Module):
        return False
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None),
                              getattr(fsdp, "FullyShardedDataParallel", None)) if k is not None)
    return bool(kinds) and isinstance(module, kinds)


def _through_dynamo(fn, why: str, backend: str, check: bool) -> GraphBroken:
    """The program compiled in regions by TorchDynamo from the first call (`_dynamo_first`)."""
    cause = GraphBreakError(f"fusec: {why}: TorchDynamo captures it, and fusec compiles the "
                            "graphs it finds", reason=why, where="")
    label = f"{type(fn.__self__).__name__}.step" if hasattr(fn, "__self__") else label_of(fn)
    return GraphBroken(fn, cause, part_compiler(backend, check), backend, label)


def label_of(fn) -> str:
    """A name for fn in logs and debug folders: the function's or the module class's name."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__name__", type(fn).__name__)


def compile(fn: Callable | None = None, *, backend: str = "auto",
            cuda_graphs: str | bool = "auto", fullgraph: bool = False, check: bool = False,
            dynamic: bool | None = None, mode: str | None = None, options: dict | None = None,
            disable: bool = False):
    """Compile a function or nn.Module into fused kernels.

    Use as `fusec.compile(fn)`, `@fusec.compile`, or `@fusec.compile(backend="cpp", check=True)`.
    backend: "auto" (Triton for CUDA inputs, C++/OpenMP for CPU inputs), "triton", "cpp" or "llvm".
    fullgraph: True: the program must be one graph, or fusec raises a GraphBreakError saying
    why and where. False (the default): a program that cannot be one graph (Python control flow
    on tensor values, `.item()`, data-dependent shapes, print or numpy) is compiled in regions
    through TorchDynamo, with graph breaks between them (fusec/capture/regions.py; warned once). A
    program captured whole calls straight into its schedule either way.
    check: also run eager PyTorch on every call and raise fusec.MismatchError if a fused result
    is further from a float64 reference than eager's result is (beyond the dtype's tolerance).
    dynamic: None (the default): a dim whose size changes between calls becomes a symbol, and one
    program serves every size of it (fusec/dynamic.py); True: every dim of the arguments is a
    symbol from the first call; False: every new size compiles a program of its own.
    cuda_graphs: "auto" (the default): an inference program on a GPU replays as one CUDA graph
    where that pays (fusec/runtime/cuda_graphs.py); True (or mode="reduce-overhead"): a training
    step's forward and backward replay as CUDA graphs too (fusec/runtime/training_graphs.py);
    False: every kernel is launched one by one.
    mode, options, disable: torch.compile's, so its calls work as written (`_torch_compile_mode`).
    """
    if disable:  # (as torch.compile(disable=True): the function itself, uncompiled)
        return fn if fn is not None else (lambda f: f)
    cuda_graphs = _torch_compile_mode(mode, options, cuda_graphs)
    options = dict(backend=backend, cuda_graphs=cuda_graphs, fullgraph=fullgraph, check=check,
                   dynamic=dynamic)
    if fn is None:
        return lambda f: compile(f, **options)
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn, **options)
    return CompiledFunction(fn, **options)


def _torch_compile_mode(mode: str | None, options: dict | None, cuda_graphs):
    """torch.compile's `mode` in fusec's terms: "reduce-overhead" is CUDA graphs on (`cuda_graphs`
    left "auto"), "max-autotune-no-cudagraphs" off; "default" and "max-autotune" change nothing
    (fusec picks its kernels' block sizes the same way in every mode). `options` are Inductor's
    settings, which fusec does not have: refused by name, not ignored."""
    modes = {None: cuda_graphs, "default": cuda_graphs, "max-autotune": cuda_graphs,
             "reduce-overhead": True if cuda_graphs == "auto" else cuda_graphs,
             "max-autotune-no-cudagraphs": False if cuda_graphs == "auto" else cuda_graphs}
    if mode not in modes:
        raise FusecError(f"fusec: unknown mode {mode!r}; torch.compile's modes are "
                         f"{', '.join(repr(m) for m in modes if m)}")
    if options:
        raise FusecError(f"fusec: options={options!r} are Inductor's settings, which fusec does not "
                         "have; fusec's switches are its compile() arguments and FUSEC_* environment "
                         "variables (docs/torch_compile.md)")
    return modes[mode]


def regions(compiled) -> Regions:
    """The fusec regions behind a compiled object, for inspection:

        opt = torch.compile(model, backend="fusec")
        opt(x)
        r = fusec.regions(opt)     # r.kernels, r.source(), r.schedule, print(r)

    Works for `torch.compile(..., backend="fusec")` modules and functions, and for a
    `fusec.compile`d program that took the graph-break path."""
    if isinstance(compiled, CompiledModule):
        compiled = compiled._compiled
    if isinstance(compiled, CompiledFunction):
        if compiled.breaks is None:
            raise FusecError("fusec: this program was captured as one graph, so it has no "
                             "regions: its kernels are cf.kernels, its program cf.source()")
        return compiled.breaks.regions
    found = dynamo_regions(compiled)
    if found is None:
        raise FusecError(f"fusec: {type(compiled).__name__} is not compiled by fusec: pass what "
                         "torch.compile(model, backend=\"fusec\") or fusec.compile returned")
    found.label = label_of(original(compiled))
    return found
