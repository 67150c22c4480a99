"""A fingerprint of a call: what the program does, found without tracing it, as a saved program's key.

A warm start (a new process, a program compiled before) spends most of its time capturing and
running the passes again: make_fx, decompositions and functionalization cost about 0.35 ms per
traced ATen op, and a ResNet-50 has a thousand. Their result is the same every time, so fusec
keeps the program it compiled on disk (saved.py, beside this file). What it needs is a key that
says "this call would capture the same graph", computed far faster than capturing it.

`fingerprint` runs the program once more under fake tensors (no data, no arithmetic), with a
torch-function mode that writes down every torch call the user's code makes, in order:

    conv2d(in0, p0, None, (2, 2), (3, 3), (1, 1), 1) -> t0
    batch_norm(t0, p3, p4, p1, p2, False, 0.1, 1e-05, True) -> t1
    relu(t1, inplace=True) -> t1
    ...
    out: (t87,) spec: TreeSpec(tuple, None, [*])

Tensors are named by where they came from (`in0`: the first argument, `p3`: the fourth
parameter, `t1`: a call's result) and described by shape, stride, dtype and device when first
seen; everything else is written by value. Python's own control flow decides which calls are made,
so the list is the program as the ATen graph will see it. Its hash, with the versions, flags and
settings that steer capture and code generation (`environment`), is the key.

A call that cannot be described this way has no fingerprint (None, and the program is compiled
as usual, never saved): an argument of a type we cannot write down by value, a tensor the program
reaches by itself (a closure's or a plain attribute's: its values would be baked in), `.item()` or
anything else that needs data, a model that assigns tensor attributes. Cost: about 20 us a torch
call (a BERT layer is about 60 calls), a few percent of a capture. Some fake calls cost far more
the first time a process makes them (a CUDA batch norm: torch runs its Python decomposition);
their results are remembered in the cache and handed back next time (known_results.py).
"""
from __future__ import annotations

import ast
import enum
import functools
import hashlib
import json
import os
import platform
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fusec import cache
from fusec.capture import outputs
from fusec.codegen import backends
from fusec.capture.calls import flatten_call, module_state
from fusec.runtime.fast_start.known_results import Known, describe, known
from fusec.capture.tracing import (autograd_functions_inlined, compiling, dense_attention_masks,
                                   python_at_trace_time_refused)


class NoFingerprint(Exception):
    """This call cannot be described by its torch calls alone (the message says why)."""


def fingerprint(fn: Callable, args: tuple, kwargs: dict, backend: str) -> str | None:
    """The key of the program `fn(*args, **kwargs)` compiles to for `backend`, or None when the
    call cannot be fingerprinted (see the module docstring). Never raises for the user's code."""
    text = trace_text(fn, args, kwargs, backend)
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:32]


def trace_text(fn: Callable, args: tuple, kwargs: dict, backend: str) -> str | None:
    """The text `fingerprint` hashes: the environment, the arguments, then one line per torch
    call (None when the call cannot be fingerprinted)."""
    from fusec.capture.frontend import restore_attributes, tensor_attributes, flat_callable
    module = fn if isinstance(fn, torch.nn.Module) else None
    recorder = None
    try:
        leaves, names, rebuild = flatten_call(fn, args, kwargs)
        state = module_state(module) if module is not None else []
        lifted = [ref.get() for ref in state]
        tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        env = environment(backend)
        recorder = _Recorder(known(env))
        header = [env, f"training={getattr(module, 'training', None)}",
                  "args " + ",".join(names)]
        header += [f"{name}=" + recorder.encode(leaf) for name, leaf in zip(names, leaves)
                   if not isinstance(leaf, torch.Tensor)]
        call = flat_callable(fn, leaves, rebuild, tensor_pos, [ref.name for ref in state])
        mode = FakeTensorMode()
        example = [*lifted, *(leaves[i] for i in tensor_pos)]
        with mode:  # (3x cheaper than mode.from_tensor, which also describes each tensor's
            # storage and autograd state; which tensors share memory is written down below)
            fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                     for t in example]
        header += [recorder.source(fake, real, f"{'p' if k < len(lifted) else 'in'}{k}")
                   for k, (fake, real) in enumerate(zip(fakes, example))]
        attributes = tensor_attributes(module)
        try:
            with torch.no_grad(), mode, python_at_trace_time_refused(), compiling(), \
                    dense_attention_masks(), autograd_functions_inlined(), recorder:
                flat_out, spec = outputs.flatten(call(*fakes))
        finally:
            if restore_attributes(attributes):
                raise NoFingerprint("assigns tensor attributes")
        recorder.lines.append(f"out: ({','.join(recorder.encode(o) for o in flat_out)}) "
                              f"spec: {spec}")
    except Exception:  # noqa: BLE001 (any failure: capture will say what is wrong, or compile)
        return None
    finally:
        if recorder is not None:
            recorder.known.save()
    return "\n".join(header + recorder.lines)


class _Recorder(TorchFunctionMode):
    """Writes down every torch call made under it (not the calls those make: while a mode
    handles a call, it is off) and names every tensor it sees."""

    def __init__(self, known: Known):
        super().__init__()
        self.known = known  # results of slow fake calls, remembered from earlier processes
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.keep: list = []  # tensors named so far, kept alive so that their ids stay theirs
        self.storages: dict[Any, str] = {}

    def source(self, fake: torch.Tensor, real: torch.Tensor, name: str) -> str:
        """Name an input or parameter; say which earlier one shares its memory, if any."""
        self.names[id(fake)] = name
        self.keep.append(fake)
        storage = (real.device, real.untyped_storage().data_ptr())
        shared = self.storages.setdefault(storage, name) if real.numel() else name
        return f"{name}: {describe(real)} memory of {shared}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        text = f"{_name(func)}({self.encode(args)}, {self.encode(kwargs)})"
        out = self.known.call(func, args, kwargs)  # func(*args, **kwargs), or its known result
        self.lines.append(f"{text} -> {self.result(out)}")
        return out

    def result(self, value) -> str:
        """Name a call's new tensors (a tensor it returns that already has a name keeps it)."""
        if isinstance(value, torch.Tensor):
            if id(value) not in self.names:
                self.names[id(value)] = name = f"t{len(self.keep)}"
                self.keep.append(value)
                return f"{name}: {describe(value)}"
            return self.names[id(value)]
        if isinstance(value, (list, tuple)):
            return "(" + ",".join(self.result(v) for v in value) + ")"
        return self.encode(value)

    def encode(self, value) -> str:
        """A value as text that says everything capture could read from it."""
        if isinstance(value, torch.Tensor):
            name = self.names.get(id(value))
            if name is not None:
                return name
            if not isinstance(value, FakeTensor):  # a closure's or a plain attribute's tensor
                raise NoFingerprint("a tensor the program reaches by itself")
            return self.result(value)  # made where no torch function saw it (a factory in C++)
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return repr(value)
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, (list, tuple)):  # torch.Size, namedtuples and lists too
            return f"{type(value).__name__}(" + ",".join(self.encode(v) for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ",".join(f"{self.encode(k)}:{self.encode(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice):
            return f"slice({self.encode(value.start)},{self.encode(value.stop)},{self.encode(value.step)})"
        if value is Ellipsis:
            return "..."
        if isinstance(value, enum.Enum):
            return repr(value)
        if isinstance(value, (type, types.BuiltinFunctionType, torch._ops.OpOverload)) or \
                isinstance(value, types.FunctionType) and value.__closure__ is None \
                and "<" not in value.__qualname__:  # a function by name: not a lambda, nor local
            return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
        raise NoFingerprint(f"an argument of type {type(value).__name__}")


def _name(func) -> str:
    return resolve_name(func) or f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)}"


# ---- what else decides the program ------------------------------------------------------------

_ENV_PREFIXES = ("FUSEC_", "TRITON_", "OMP_", "CUDA_VISIBLE")
# where caches and logs go, whether programs are saved, how the build is run change no program
_ENV_IGNORED = {"FUSEC_CACHE_DIR", "FUSEC_LOG", "FUSEC_DEBUG_DIR", "FUSEC_SAVED_PROGRAMS",
                "FUSEC_COMPILE_JOBS", "FUSEC_PROGRESS", "FUSEC_CACHE_MAX_MB",  # builds at once; bars
                "TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR"}


def environment(backend: str) -> str:
    """Everything outside the call that capture, the passes or code generation read: fusec's own
    source, torch's and Triton's versions, the backend, the machine and torch's CPU kernels, the
    numeric settings (TF32, default dtype, autocast), the threads, fusec's environment variables."""
    flags = [
        f"fusec {source_hash()}", f"torch {torch.__version__}", f"python {sys.version_info[:2]}",
        f"backend {backend}", f"machine {platform.machine()} cpus {_cpus()} threads "
        f"{torch.get_num_threads()}", f"default dtype {torch.get_default_dtype()}",
        f"matmul precision {torch.get_float32_matmul_precision()}",
        f"tf32 {torch.backends.cuda.matmul.allow_tf32} {torch.backends.cudnn.allow_tf32}",
        f"reduced {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction} "
        f"{torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}",
        f"deterministic {torch.are_deterministic_algorithms_enabled()}",
        f"autocast {torch.is_autocast_enabled('cpu')} {torch.is_autocast_enabled('cuda')}",
    ]
    if "cuda" in backends.get(backend).devices:
        flags.append(f"triton {_version('triton')} gpu {_gpu()}")
    else:
        flags.append(f"cpu {_cpu_flags()} kernels {torch.backends.cpu.get_cpu_capability()}")
    flags += [f"{k}={v}" for k, v in sorted(os.environ.items())
              if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED]
    flags.append(f"settings {settings()}")
    flags.append("extensions " + ", ".join(extensions()))
    return "; ".join(flags)


def extensions() -> list[str]:
    """What was registered from outside fusec's source: kernel families, graph passes and graph
    rules (a program compiled without one must not be loaded with it, nor the other way round)."""
    from fusec import passes
    from fusec.codegen import families
    from fusec.passes import patterns
    return ([f"family {f.name} ({f.module})" for f in families.REGISTRY]
            + [f"pass {p.name} ({p.module}, before {p.before})" for p in passes.REGISTERED]
            + [f"rule {r.name}" for r in patterns.REGISTERED])


def settings() -> str:
    """fusec's module-level settings and functions that differ *now* from what its source says:
    a threshold (`passes.small_matmul.SMALL_M`), a device list or a helper can be replaced by a
    test or a user (`monkeypatch.setattr(...)`), and a program compiled under other settings
    must not be loaded. Checked: every UPPER_CASE name that the source assigns a literal, every
    top-level function and class, every method of those classes, and every public name imported
    from another fusec module (`fusec.driver.plan_memory` must still be passes.memory's), in the
    fusec modules this process has imported (one that is not imported yet has its source's
    values). "-" when nothing differs."""
    changed = []
    for name, (constants, functions, imported) in sorted(_defaults().items()):
        module = sys.modules.get(name)
        if module is None:
            continue
        space = vars(module)
        for key, (source, attr) in imported.items():  # `from fusec.x import f`: still x's f?
            origin = sys.modules.get(source)
            if origin is not None and key in space and hasattr(origin, attr) \
                    and space[key] is not getattr(origin, attr):
                value = space[key]
                changed.append(f"{name}.{key} is {getattr(value, '__module__', '?')}."
                               f"{getattr(value, '__qualname__', type(value).__name__)}")
        for key, text in constants.items():
            if key in space and _literal(space[key]) != text:
                changed.append(f"{name}.{key}={_literal(space[key])}")
        for qualname in functions:
            owner, _, attr = qualname.rpartition(".")
            where = vars(space[owner]) if owner and isinstance(space.get(owner), type) else space
            value = where.get(attr)
            value = getattr(value, "__func__", value)  # staticmethod, classmethod
            if getattr(value, "__module__", None) != name or \
                    getattr(value, "__qualname__", None) != qualname:
                changed.append(f"{name}.{qualname} is {getattr(value, '__module__', '?')}."
                               f"{getattr(value, '__qualname__', type(value).__name__)}")
    return ";".join(changed) or "-"


def _literal(value) -> str:
    return repr(sorted(value, key=repr)) if isinstance(value, (set, frozenset)) else repr(value)


_ASSIGN = re.compile(r"^([A-Z][A-Z0-9_]*)(?:\s*:\s*[^=]+)?\s*=\s*(.+?)\s*(?:#.*)?$")
_IMPORT = re.compile(r"^from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^(\n#]+)(?:#.*)?$", re.M)
_DEF = re.compile(r"^(    )?(?:async\s+)?(def|class)\s+(\w+)")


@functools.lru_cache(maxsize=None)
def _defaults() -> dict[str, tuple[dict, list, dict]]:
    """`_read_defaults()`, kept in the cache under the hash of fusec's source: reading them is
    30 ms here but 0.1 s on a GPU host, a tenth of a warm start there."""
    path = cache.cache_dir("programs") / f"defaults-{source_hash()}.json"
    try:
        return {name: (constants, functions, {k: tuple(v) for k, v in imported.items()})
                for name, (constants, functions, imported) in json.loads(cache.read_bytes(path)).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        found = _read_defaults()
        cache.atomic_write(path, json.dumps(found))
        return found


def _read_defaults() -> dict[str, tuple[dict, list, dict]]:
    """module -> (its literal UPPER_CASE constants as their repr, its functions' qualnames, the
    public names it imports from fusec: name -> (module, attribute)), read from the source with
    regular expressions (parsing every file would take 0.25 s)."""
    found = {}
    for name, path in _sources():
        constants, functions, cls, decorated = {}, [], None, False
        text = path.read_text()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = {}
        for source, names in _IMPORT.findall(text):
            if source.startswith("."):  # relative: from the package up
                base = package
                for _ in range(len(source) - len(source.lstrip(".")) - 1):
                    base = base.rpartition(".")[0]
                source = base + ("." + source.lstrip(".") if source.lstrip(".") else "")
            if not source.startswith("fusec"):
                continue
            for item in re.sub(r"#.*", "", names).replace("(", " ").replace(")", " ").split(","):
                parts = item.split()
                if parts and not parts[-1].startswith("_"):
                    imported[parts[-1]] = (source, parts[0])
        for line in text.splitlines():
            match = _DEF.match(line)
            if match:  # (a decorated function is whatever its decorator made: not checked)
                indent, kind, ident = match.groups()
                if not indent:
                    cls = ident if kind == "class" else None
                    if not decorated:
                        functions.append(ident)
                elif cls and kind == "def" and not ident.startswith("__") and not decorated:
                    functions.append(f"{cls}.{ident}")
                decorated = False
                continue
            decorated = decorated or line.lstrip().startswith("@") and len(line) - len(
                line.lstrip()) <= 4
            if line and not line[0].isspace():
                cls = None if not line.startswith(("@", ")", "]", "}")) else cls
            match = _ASSIGN.match(line)
            if match:
                try:
                    value = ast.literal_eval(match.group(2))
                    if value or not isinstance(value, (list, dict, set)):  # `X = {}`: filled later
                        constants[match.group(1)] = _literal(value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    pass
        found[name] = (constants, [f for f in functions if not f.split(".")[-1].startswith("_")],
                       imported)
    return found


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """A hash of fusec's own code (every module and every template): a program saved by another
    version of fusec is never loaded."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]  # fusec/ (this file: fusec/runtime/fast_start/)
    templates = sorted({*root.rglob("*.j2"), *root.rglob("*.h"), *root.parent.glob("codegen/*/templates/*"),
                        *root.parent.glob("extensions/*/templates/*")})
    for name, path in [*_sources(), *((p.name, p) for p in templates)]:
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _sources():
    """(module name, file) for every module of fusec, passes, codegen and extensions included."""
    root = Path(__file__).resolve().parents[2]  # fusec/ (this file: fusec/runtime/fast_start/)
    folders = ((root.parent / name, f"fusec.{name}") for name in ("passes", "codegen", "extensions"))
    for base, prefix in ((root, "fusec"), *folders):
        if not base.is_dir() or (prefix != "fusec" and (root / prefix.split(".")[1]).is_dir()):
            continue  # (installed: passes/ and codegen/ inside fusec/, found from the root)
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            yield ".".join((prefix, *parts)), path


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    """A hash of the CPU's feature flags (AVX2, AVX-512 ...), which the CPU backends read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@functools.lru_cache(maxsize=None)
def _version(package: str) -> str:
    try:
        return __import__(package).__version__
    except Exception:  # noqa: BLE001
        return "none"


@functools.lru_cache(maxsize=None)
def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} sm{props.major}{props.minor}"
