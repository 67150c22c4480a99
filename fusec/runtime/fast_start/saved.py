"""Saved programs: a compiled program kept on disk, so that a new process skips capture and passes.

A warm start used to redo everything but the kernel builds: capture (make_fx under fake
tensors), the passes, lowering. For a ResNet-50 on a GPU host that was 1.7 of its 2.4 seconds,
spent to arrive at the program it arrived at last time. Now, after a compile, the driver's result
is written to the cache under the call's fingerprint (fingerprint.py, beside this file):

    ~/.cache/fusec/programs/<fingerprint>.pkl     kernel IRs and their rendered sources, the
                                                   program's steps, the memory plan, what the
                                                   caller's outputs look like
    ~/.cache/fusec/programs/<fingerprint>.json    its sha256 and an HMAC of it, signed with
                                                   this user's key, written last (fusec/cache.py)

and a later process whose call has the same fingerprint loads it: each kernel's binary comes
from the kernel cache as on any warm start (fusec/runtime/build.py), the steps are bound to those
kernels, and the program runs. Nothing is captured or traced.

What is not saved is what only the inspection tools read: the captured graph, the graph after the
passes and their records. A loaded program makes them on first use (`cf.source()`, `cf.schedule`)
by compiling the call again, from tensors of the same shapes. The saved program is only used where
nobody watches: `explain`, `profile`, `FUSEC_LOG` and `check=True` compile as usual.
`FUSEC_SAVED_PROGRAMS=0` (or false, off, no) turns saving and loading off.

Note: a saved program is a pickle, and unpickling can run any code, so a program file is only
unpickled once its bytes are known to be this user's own: the file must belong to this user and be
writable by nobody else, and its sha256 must match a manifest signed with the user's secret key
(`cache.read_verified`, checked before `pickle.loads`). A file another user planted, or one whose
manifest is missing, forged or unsigned, is a miss: the call compiles as usual, and
`FUSEC_LOG=cache` says why.
"""
from __future__ import annotations

import io
import pickle
import time
import warnings
from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fusec import cache, env
from fusec.capture.frontend import Captured
from fusec.driver import CompiledGraph, Kernel
from fusec.errors import FusecError
from fusec.runtime.build import build_all
from fusec.runtime.steps import KernelStep

FORMAT = 2  # bumped when what is saved changes shape


def enabled() -> bool:
    return env.flag("FUSEC_SAVED_PROGRAMS", True)


def _path(key: str):
    return cache.cache_dir("programs") / f"{key}.pkl"


def save(key: str, compiled) -> bool:
    """Write `compiled` (a fresh driver.CompiledGraph, not yet run) under `key`. Returns whether
    it was saved: a program holding something that cannot be written (an op we cannot name) is
    not, and compiles as usual next time."""
    program = compiled.program
    if program.pool is not None or program.run is not None:
        return False  # saved before its first run only: a run binds buffers we must not write
    if any(k.built is not None and k.built.failed for k in compiled.kernels):
        return False  # a group runs eagerly (fusec/runtime/eager.py): compiled, and said, each time
    launchers = {id(k.launcher): i for i, k in enumerate(compiled.kernels)}
    kernels = {id(k): i for i, k in enumerate(compiled.kernels)}
    try:
        steps = io.BytesIO()
        _Saver(steps, launchers, kernels).dump(program)
        captured = compiled.captured
        payload = pickle.dumps({
            "format": FORMAT, "backend": compiled.backend,
            "kernels": [(k.name, k.backend, k.ops, k.ir) for k in compiled.kernels],
            "rendered": [_rendered(k, compiled.backend) for k in compiled.kernels],
            "device": next((str(s.device) for s in program.steps if isinstance(s, KernelStep)), None),
            "program": steps.getvalue(), "memory": compiled.memory, "inplace": compiled.inplace,
            "graph_blocker": compiled.graph_blocker,
            "captured": {"lifted_names": captured.lifted_names, "input_names": captured.input_names,
                         "out_spec": captured.out_spec, "output_aliases": captured.output_aliases,
                         "output_constants": captured.output_constants},
        })
    except Exception as err:  # noqa: BLE001 (an output spec holding fake tensors, say)
        cache.log(f"program {key} not saved ({type(err).__name__}): compiled every time")
        return False
    try:
        path = cache.store(_path(key), payload)  # the pickle, then its signed manifest
    except (OSError, FusecError) as err:  # (no room left even in a private cache)
        cache.log(f"program {key} not saved ({err}): compiled every time")
        return False
    cache.log(f"saved program {path.name}")
    return True


def load(key: str, recompile: Callable[[], Any]):
    """The program saved under `key`, ready to run, or None (not saved, or not intact).
    `recompile()` compiles the call for real; the loaded program calls it the first time
    someone reads what was not saved (the graphs)."""
    path = _path(key)
    start = time.perf_counter()
    data = cache.read_verified(path)  # this user's, intact and signed: only then unpickled
    if data is None:
        return None
    try:
        with warnings.catch_warnings():  # (torch 2.13 warns about its own pytree specs' pickles)
            warnings.simplefilter("ignore", FutureWarning)
            payload = pickle.loads(data)
    except Exception as err:  # noqa: BLE001 (written by another version of a library: a miss)
        cache.log(f"program {path.name} unreadable ({type(err).__name__}): compiling")
        return None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return None
    times = {"capture": 0.0, "passes": 0.0, "load": 0.0}
    irs = [ir for _, _, _, ir in payload["kernels"]]
    built = build_all(irs, payload["backend"], times, payload["device"], payload["rendered"])
    if any(b.failed for b in built):  # no backend builds one now: compile, and fall back there
        return None
    kernels = [Kernel(name, b.backend, None, list(ops), ir, b.launcher, b)
               for (name, _, ops, ir), b in zip(payload["kernels"], built)]
    program = _Loader(io.BytesIO(payload["program"]), kernels).load()
    captured = _SavedCapture.__new__(_SavedCapture)
    vars(captured).update(payload["captured"], seconds=0.0)
    compiled = _SavedGraph(payload["backend"], captured, None, None, kernels, program,
                           payload["memory"], payload["inplace"])
    del compiled.gm  # made on first use (see _SavedGraph)
    captured._owner = compiled
    compiled._recompile = recompile
    _eager_on_failure(compiled)
    compiled.graph_blocker = payload["graph_blocker"]
    times["load"] += time.perf_counter() - start - sum(times.values())
    compiled.times = times
    cache.STATS["programs loaded"] += 1
    cache.log(f"loaded program {path.name}: {len(kernels)} kernels, nothing captured")
    return compiled


def _eager_on_failure(compiled) -> None:
    """A loaded program does not hold its groups' ATen graphs, which a Triton kernel that fails
    to compile at its first launch runs instead (triton_launch.py, fusec/runtime/eager.py).
    Should that happen, the program is compiled for real first: its driver tells the launcher
    (the same one: fusec/runtime/build.py shares it) which ATen ops to run."""
    for kernel in compiled.kernels:
        launcher = kernel.launcher
        if getattr(launcher, "fallback", False) is not None:
            continue

        def instead(error, warn=True, launcher=launcher):
            launcher.fallback = None
            _recompiled(compiled)
            if launcher.fallback is None:  # (the real compile did not use this launcher)
                raise error
            return launcher.fallback(error, warn)
        launcher.fallback = instead


def _rendered(kernel, backend: str):
    """What a loaded program need not render again: the kernel's canonical IR and its source,
    as this same fusec (the fingerprint holds its source hash) rendered them for `backend`. None
    for a kernel another backend built (a fallback), which is rendered again on load."""
    built = kernel.built
    if built is None or built.backend != backend:
        return None
    return built.ir, built.source


# ---- pickling the steps -------------------------------------------------------------------------
#
# A Program's steps hold three kinds of things pickle cannot write by value: the kernels' loaded
# launchers (ctypes functions, Triton JIT functions), the Kernel records in `producers`, and ATen
# ops (`aten.mm.default`, an OpOverload). They are written as references, "kernel 3" or
# "op aten.mm.default", and bound again on load: to the kernels just loaded from the kernel cache,
# and to the op of that name in this process's torch.

class _Saver(pickle.Pickler):
    def __init__(self, file, launchers: dict, kernels: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.launchers, self.kernels = launchers, kernels

    def persistent_id(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if callable(obj) and id(obj) in self.launchers:
            return ("launcher", self.launchers[id(obj)])
        if isinstance(obj, Kernel) and id(obj) in self.kernels:
            return ("kernel", self.kernels[id(obj)])
        return None


class _Loader(pickle.Unpickler):
    def __init__(self, file, kernels: list):
        super().__init__(file)
        self.kernels = kernels

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "launcher":
            return self.kernels[rest[0]].launcher
        if kind == "kernel":
            return self.kernels[rest[0]]
        namespace, name = rest[0].split("::")  # "aten::mm"
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, rest[1] or "default") if kind == "op" else packet


# ---- what a loaded program makes on first use ---------------------------------------------------

def _recompiled(compiled):
    """The real compilation behind a loaded program, made once, when first needed."""
    real = vars(compiled).get("_real")
    if real is None:
        real = compiled._real = compiled._recompile()
    return real


class _SavedCapture(Captured):
    """A loaded program's Captured: what calling it needs; its graph is made when read."""

    def __getattr__(self, attr: str):
        if attr in ("gm", "lifted"):
            return getattr(_recompiled(vars(self)["_owner"]).captured, attr)
        raise AttributeError(attr)


class _SavedGraph(CompiledGraph):
    """A loaded program: it runs like any CompiledGraph; its graphs are made when read."""

    def __getattr__(self, attr: str):
        if attr == "gm":
            return _recompiled(self).gm
        raise AttributeError(attr)


class _TensorLike(NamedTuple):
    """A tensor argument remembered by its signature only (see `placeholders`)."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def remake(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                   device=self.device).requires_grad_(self.requires_grad)


def placeholders(args: tuple, kwargs: dict) -> Callable[[], tuple]:
    """A way to get back arguments like these later without keeping their data alive: each
    tensor is remembered by shape, strides, dtype and device, and remade (uninitialized)."""
    flat, tree = pytree.tree_flatten((args, kwargs))
    kept = [_TensorLike(tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad)
            if isinstance(v, torch.Tensor) else v for v in flat]

    def remake():
        return pytree.tree_unflatten([v.remake() if isinstance(v, _TensorLike) else v
                                      for v in kept], tree)
    return remake
