"""The fast path: a call that looks like the last one runs its program with almost no Python.

`CompiledFunction.__call__` (fusec/api.py) first tries `self._fast(args)`: a guard written out
as straight-line Python for the last signature (`guarded_call`; `make_fast_path` makes one for a
program), which returns `MISS` when the arguments differ and otherwise runs the program and
returns the user's outputs in the user's structure (`_direct_runner`, `_packer`). `call_signature`
is the key every compiled program is kept under; `complete` puts back the outputs a program
does not compute (constants, inputs returned as they are). Whether inputs share memory is
aliasing.py's question; the fast path spells its check out (`_overlap_lines`).
"""
from __future__ import annotations

import builtins
import operator
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from fusec.aliasing import input_overlaps, mutated_inputs, span  # noqa: F401 (importable here)
from fusec.capture.frontend import Captured
from fusec.runtime.threads import one_at_a_time
from fusec.symbolic import at_call, is_symbolic


class _Miss:
    """What a fast path returns when the call is not the one it was made for."""

    def __repr__(self) -> str:
        return "MISS"


MISS = _Miss()


# The argument types a fast path is made for: plain tensors, and parameters (a Parameter is a
# plain tensor to every op; AOT Autograd passes a module's parameters to a training program's
# forward as they are). Each argument's guard checks the type it had; other subclasses take the
# general path.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def no_fast_path(args: tuple) -> _Miss:
    """The fast path before the first call (and after a call that cannot take one)."""
    return MISS


def guarded_call(run: Callable, tensors: list, n_static: int, state_refs: list, module,
             mutated: tuple = (), python_state: tuple = ((), {}),
             sizes: str | None = None, ints: dict | None = None) -> Callable:
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
    program is an inference one: it runs only while grad mode is off. A program that writes
    into inputs (`mutated`: their positions in `tensors`) also checks that none of them shares
    memory with another input ("Note (aliased inputs)" in fusec/aliasing.py); one that writes
    none checks nothing more. `python_state`: (lines, their globals) that check the Python state
    the program read (`m.scale`, a global flag: fusec/capture/guards.py `Guards.fast_lines`);
    none for a program that read none.

    `sizes`: for a program over a shape family (fusec/dynamic.py), its guards as one Python
    expression over `L['t0']`, `L['t1']`... (the ShapeEnv's, with every static size and stride):
    each tensor's sizes and strides are then checked by it instead of by constants.

    `ints`: for a call of tensors and ints (AOT Autograd's backward of a shape family, which
    gets the sizes the forward saved among its tensors: Note: calls of tensors and ints), {the
    int's position among the arguments: what it must be}, `int_checks`'s; the program runs on
    the tensors alone.
    """
    glob = {"MISS": MISS, "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "run": run,
            "is_grad_enabled": torch.is_grad_enabled}
    ints = ints or {}
    n_args = len(tensors) - n_static + len(ints)
    names = [f"a{i}" for i in range(n_args)]
    args = [name for i, name in enumerate(names) if i not in ints]  # (the tensors)
    lines = [f"if len(args) != {n_args}:", "    return MISS", *autocast_lines(glob)]
    if names:
        lines.append(f"{', '.join(names)}{',' if n_args == 1 else ''} = args")
    if module is not None:
        glob["module"] = module
        lines += [f"if module.training is not {module.training}:", "    return MISS"]
    state = [f"p{i}" for i in range(n_static)]
    start = len(lines)  # (the checks from here on read the module's state)
    for i, ref in enumerate(state_refs):
        glob[f"owner{i}"] = ref.owner
        lines.append(f"p{i} = {ref.expression(f'owner{i}')}")  # (`owner0._parameters['weight']`)
    for k, (var, t) in enumerate(zip(state + args, tensors)):
        # a family's guards (`sizes`) check the sizes of the inputs they name; the others are
        # fixed (a model's weights), checked here as a static program's are
        lines += _tensor_lines(var, t, glob, sizes is None or f"L['t{k}']" not in sizes)
    lines += _int_lines(names, ints)
    if sizes is not None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP  # (Eq, Mod, FloorDiv...)
        glob.update({k: v for k, v in SYMPY_INTERP.items() if k not in glob})
        lines += _family_lines(state + args, sizes)
    if any(t.requires_grad for t in tensors):
        lines += ["if is_grad_enabled():  # an inference program: training takes `_call`",
                  "    return MISS"]
    if mutated:
        lines += _overlap_lines(state + args, tensors, mutated)
    lines += python_state[0]
    glob.update(python_state[1])
    if state_refs:  # a parameter set to None (`p.shape` fails) or deleted: the general path
        lines[start:] = ["try:", *(f"    {line}" for line in lines[start:]),
                         "except (AttributeError, KeyError):", "    return MISS"]
    everything = "args" if not state and not ints else f"[{', '.join(state + args)}]"
    lines.append(f"return run({everything})")
    source = "def fast(args):\n" + "".join(f"    {line}\n" for line in lines)
    exec(builtins.compile(source, "<fusec fast path>", "exec"), glob)  # (fusec's compile is ours)
    fast = glob["fast"]
    fast.source, fast.run = source, run
    return fast


def _tensor_lines(var: str, t: torch.Tensor, glob: dict, sized: bool) -> list[str]:
    """The lines that return MISS unless `var` is a tensor like `t`: its type (an argument's;
    the module's state is read where it lives), shape and strides (`sized`; else its rank
    only), dtype, device and requires_grad."""
    dtype, device = str(t.dtype).replace("torch.", ""), str(t.device).replace(":", "")
    glob[dtype], glob[device] = t.dtype, t.device
    kind = "Parameter" if type(t) is torch.nn.Parameter else "Tensor"  # (the type it was)
    shape = [f"{var}.shape != {tuple(t.shape)}", f"{var}.stride() != {tuple(t.stride())}"] \
        if sized else [f"{var}.dim() != {t.dim()}"]
    checks = ([f"type({var}) is not {kind}"] if var.startswith("a") else []) + shape + [
        f"{var}.dtype is not {dtype}",
        # is_cpu reads a flag; .device builds a torch.device to compare
        f"not {var}.is_cpu" if device == "cpu" else f"{var}.device != {device}",
        f"{'not ' if t.requires_grad else ''}{var}.requires_grad"]
    rows = [" or ".join(checks[i:i + 3]) for i in range(0, len(checks), 3)]
    return [f"if ({rows[0]}", *[f"        or {row}" for row in rows[1:-1]],
            f"        or {rows[-1]}):", "    return MISS"]


# Note: calls of tensors and ints. AOT Autograd hands a shape family's backward the sizes the
# forward saved as Python ints among its tensors (`bw(s0, s1, t0, t1, ...)`): each such int is
# a size of one of the tensors (fusec/dynamic.py `from_examples` records which, as `derived`),
# and the program reads sizes from its tensors, so it runs on the tensors alone. The general
# path keys such an int by where it comes from when it equals that size, else by its value
# (`dynamic.derive`); the fast path checks the same, written out: `a0 == a5.shape[1]` for a
# size, `type(a0) is int and a0 == 7` for any other int (then part of the fast path's key,
# `fast_path_key`). A call whose ints differ takes the general path, which decides as before.


def flat_args(args: tuple) -> bool:
    """Whether a call's positional arguments can take a fast path: plain tensors, and ints
    (Note: calls of tensors and ints)."""
    return all(type(a) in PLAIN_TENSORS or type(a) is int for a in args)


def int_checks(args: tuple, derived: dict) -> dict:
    """{position: ("size of", j, d) or ("value", v)} for each int among `args` (see the Note):
    a size of tensor argument j where `derived` says so and it is that size now, else its value."""
    checks = {}
    for i, a in enumerate(args):
        if type(a) is not int:
            continue
        j, d = derived.get(i, (None, None))
        sized = j is not None and j < len(args) and type(args[j]) in PLAIN_TENSORS \
            and args[j].dim() > d and args[j].shape[d] == a
        checks[i] = ("size of", j, d) if sized else ("value", a)
    return checks


def fast_path_key(key: tuple, compiled: "CompiledGraph", args: tuple, derived: dict) -> tuple:
    """What a fast path is kept under: the signature `key`, or, for a shape family's program,
    the family (one fast path for every size) and the values of the ints that are not sizes."""
    if compiled.captured.shape_env is None:
        return key
    values = tuple((i, c[1]) for i, c in int_checks(args, derived).items() if c[0] == "value")
    return ("family", id(compiled)) + ((values,) if values else ())


def _int_lines(names: list[str], ints: dict) -> list[str]:
    """The checks of a call's ints (`int_checks`), written out (see the Note)."""
    tests = []
    for i, check in sorted(ints.items()):
        if check[0] == "size of":
            want = f"{names[check[1]]}.shape[{check[2]}]"
        else:
            want = repr(check[1])
        tests.append(f"type({names[i]}) is not int or {names[i]} != {want}")
    return [line for test in tests for line in (f"if {test}:", "    return MISS")]


def _family_lines(names: list[str], code: str) -> list[str]:
    """The shape family's guard expression (see `guarded_call`) over the fast path's names: each
    tensor's sizes and strides read once (`z0 = a0.shape`, `y0 = a0.stride()`)."""
    import re
    used = sorted({int(k) for k in re.findall(r"L\['t(\d+)'\]", code)})
    lines = []
    for k in used:
        if f"L['t{k}'].size()" in code:
            lines.append(f"z{k} = {names[k]}.shape")
        if f"L['t{k}'].stride()" in code:
            lines.append(f"y{k} = {names[k]}.stride()")
        code = code.replace(f"L['t{k}'].size()", f"z{k}").replace(f"L['t{k}'].stride()", f"y{k}")
        code = code.replace(f"L['t{k}']", names[k])
    return lines + [f"if not ({code}):", "    return MISS  # the shape family's guards"]


def make_fast_path(compiled: "CompiledGraph", tensors: list, n_args, owner,
                   state_refs: list, module, python_state: tuple,
                   derived: dict | None = None) -> Callable:
    """The fast path for calls like this one (`n_args` positional plain tensors after the
    module's state, all as in `tensors`; or `n_args` the call's positional arguments, tensors
    and ints, with `derived` the ints that are sizes: Note: calls of tensors and ints): a guard,
    written out as Python (`guarded_call`), then the run. A program CUDA graphs may replay runs
    as the general path runs it: through its CompiledFunction's (`owner`'s) `_run`, which
    decides between a plain run, a capture and a replay (looked up on every call, as in the
    general path)."""
    ints = None
    if not isinstance(n_args, int):  # the call's arguments themselves
        ints = int_checks(n_args, derived or {})
        n_args = len(n_args) - len(ints)
    captured, n_static = compiled.captured, len(tensors) - n_args
    if compiled.graph_blocker is None or getattr(owner, "graph_pair", None) is not None:
        # CUDA graphs may replay it (runtime/training_graphs.py for training): the general run
        pack = _packer(captured.out_spec)

        def run(tensors):
            tensors = list(tensors)
            return pack(complete(compiled, owner._run(compiled, tensors, n_static), tensors))
    else:  # steps run directly: the straight-line function returns the user's outputs itself
        run = _direct_runner(compiled.program, captured)
    sizes = None
    if captured.shape_env is not None:  # a shape family's program: its guards check the sizes
        from fusec.dynamic import guard_expression
        sizes = guard_expression(captured, fixed_apart=True)
    return guarded_call(one_at_a_time(run, compiled), tensors, n_static, state_refs, module,
                    mutated_inputs(compiled.program), python_state, sizes, ints)


def complete(compiled: "CompiledGraph", flat_out: list, tensors: list) -> list:
    """A program's output list, completed with the outputs that are not tensors it computes:
    constants (None, a number) and inputs returned as they are."""
    for k, value in sorted(compiled.captured.output_constants.items()):
        if is_symbolic(value) or isinstance(value, (torch.SymFloat, torch.SymBool)):
            value = at_call(value, compiled.program.size_bindings, tensors)  # (a family's size)
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


def _direct_runner(program, captured: Captured) -> Callable:
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


def call_signature(leaves: list, grad: bool) -> tuple:
    """A call's key: its flag (grad, or the module's training flag), each tensor's shape,
    strides, dtype, device and requires_grad, each other argument's `argument_key`. Under
    autocast the flag is paired with the autocast state: a program traced under autocast holds
    its casts, and one traced without it would run its matmuls in bfloat16 under it and feed
    the result to kernels that read float32 (`autocast_state`)."""
    state = autocast_state()
    key = [grad if not state else (grad, state)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device,
                        leaf.requires_grad))
        else:
            key.append(argument_key(leaf))
    return tuple(key)


any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """((device type, dtype), ...) of the autocast regions the call runs in; () outside any
    (the common case, read in ~0.15 us: the fast paths check it on every call)."""
    if not any_autocast():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def autocast_lines(glob: dict) -> list[str]:
    """A fast path's check that the call runs under the autocast state its program was traced
    under (the state now, when the fast path is made for this call)."""
    state = autocast_state()
    glob.update(any_autocast=any_autocast, autocast_state=autocast_state, AUTOCAST=state)
    if not state:
        return ["if any_autocast():  # traced outside autocast", "    return MISS"]
    return ["if autocast_state() != AUTOCAST:  # traced under this autocast", "    return MISS"]


def argument_key(leaf) -> tuple:
    """A non-tensor argument as part of a signature. Most are their own key: numbers, strings,
    dtypes by value, functions and modules by identity. But a tracing run reads an argument
    object's attributes once and bakes them in (`x * cfg.scale` is `mul(x, 2.0)`), and the
    caller may change them between calls (`cfg.scale = 3.0`); and Python 3.11's slices and a
    dataclass (eq without hash) cannot be hashed at all. So a slice is its (start, stop, step),
    and an object that holds settings (plain values, nested such objects) is its type and its
    attributes' values: a changed setting compiles again, an equal object reuses the program.
    Anything else unhashable is keyed by identity."""
    if isinstance(leaf, _SETTINGS_VALUES):
        return (type(leaf), leaf)
    if type(leaf) is slice:
        return (slice, leaf.start, leaf.stop, leaf.step)
    try:
        return (type(leaf), "settings", _settings(leaf, [64]))
    except TypeError:
        pass
    try:
        hash(leaf)
        return (type(leaf), leaf)
    except TypeError:
        return (type(leaf), "identity", id(leaf))


def _settings(value, budget: list):
    """An object's attributes as nested tuples of plain values (see `argument_key`), or raise
    TypeError: not such an object, or more than `budget` values."""
    if isinstance(value, _SETTINGS_VALUES):
        return value
    if type(value) in (tuple, list):
        budget[0] -= len(value)
        if budget[0] < 0:
            raise TypeError("too many values")
        return (type(value), tuple(_settings(v, budget) for v in value))
    if isinstance(value, (torch.Tensor, torch.nn.Module, type)) or callable(value):
        raise TypeError("not a setting")
    attributes = getattr(value, "__dict__", None)
    if type(attributes) is not dict:
        raise TypeError("no attributes")
    budget[0] -= len(attributes)
    if budget[0] < 0:
        raise TypeError("too many values")
    return (type(value), tuple((k, _settings(v, budget)) for k, v in attributes.items()))


_SETTINGS_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


# ---- inputs that share memory: see "Note (aliased inputs)" in fusec/aliasing.py ------------

def _overlap_lines(names: list[str], tensors: list, mutated: tuple) -> list[str]:
    """The fast path's check that no input the program writes shares memory with another
    (aliasing.input_overlaps, spelled out): one data pointer read per input involved, and two
    comparisons per pair. (Shapes, strides and devices are guarded already: spans are constants.)"""
    pairs = [(m, o) for m in mutated for o in range(len(tensors))
             if o != m and (o not in mutated or o > m) and span(tensors[m]) and span(tensors[o])
             and tensors[m].device == tensors[o].device]
    used = sorted({i for pair in pairs for i in pair})
    lines = [f"d{i} = {names[i]}.data_ptr()" for i in used]
    for m, o in pairs:
        lines += [f"if d{m} < d{o} + {span(tensors[o])} and d{o} < d{m} + {span(tensors[m])}:",
                  "    return MISS  # an input the program writes shares memory with another"]
    return lines
