"""A call's arguments: flatten them into named leaves, find the module's parameters and buffers,
pick the device the program runs on, and refuse arguments a captured graph cannot take.

Capture (frontend.py), training (training.py) and the driver's call path (fusec/api.py) all see a
call through these: `flatten_call` gives each tensor a name from the function's signature
(`x`, `xs_0`, `kwargs_mask`), `module_state` says where each lifted parameter lives, so a call
reads it without walking the module.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from fusec.capture import outputs
from fusec.errors import DeviceError, GraphBreakError


@dataclass(frozen=True)
class StateRef:
    """Where one lifted parameter or buffer lives: `owner._parameters[attr]` (or `_buffers`)."""

    name: str  # the qualified name, `transformer.wte.weight`
    owner: torch.nn.Module
    attr: str
    is_param: bool

    def get(self) -> torch.Tensor:
        return (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr]

    def set(self, value: torch.Tensor) -> None:
        """Put `value` where the tensor lives (while tracing a module the program reaches
        through a global or a closure: capture/guards.py `substituted`)."""
        (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr] = value

    def expression(self, var: str) -> str:
        """Python that reads the tensor, with the owner in variable `var` (the fast path's)."""
        return f"{var}.{'_parameters' if self.is_param else '_buffers'}[{self.attr!r}]"


def module_state(module: torch.nn.Module) -> list[StateRef]:
    """The module's parameters, then its buffers, each tensor once: the order capture lifts them.

    Note: tied weights. A tensor reachable under several names (GPT-2's `lm_head.weight` and
    `transformer.wte.weight`, T5's `shared.weight` and `encoder.embed_tokens.weight`, a submodule
    used twice) is one tensor: it becomes one graph input, under the first name
    `named_parameters()` gives it. `torch.func.functional_call` (with its default
    `tie_weights=True`) then hands that input to every name tied to it, and in training its
    gradient is the sum over all its uses, as eager's is.
    """
    seen: set[int] = set()
    refs = []
    for is_param, table in ((True, "_parameters"), (False, "_buffers")):
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for attr, value in getattr(sub, table).items():
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    refs.append(StateRef(f"{prefix}.{attr}" if prefix else attr, sub, attr, is_param))
    return refs


# Leaves of a call's arguments that pytree would not open (None is not one: pytree opens it).
LEAF_TYPES = (torch.Tensor, torch.nn.Parameter, int, float, bool)
_flat_names: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # fn -> {n args: names}


def flatten_call(fn: Callable, args: tuple, kwargs: dict):
    """Flatten a call's arguments into leaves, with names taken from fn's signature.

    Returns (leaves, names, rebuild) where rebuild(leaves) -> (args, kwargs).

    A call of positional leaves only (tensors and numbers: AOT Autograd calls a backward with its
    saved tensors and the sizes it needs as ints, a hundred arguments) is already flat: its
    leaves are `args`, and its names, found once per function and count, are kept.
    """
    if not kwargs and all(type(a) in LEAF_TYPES for a in args):
        try:
            known = _flat_names.setdefault(fn, {})
        except TypeError:  # (not weakly referable: named each time)
            known = {}
        names = known.get(len(args))
        if names is None:
            names = known[len(args)] = _flatten_call(fn, args, kwargs)[1]
        return list(args), names, lambda new_leaves: (tuple(new_leaves), {})
    return _flatten_call(fn, args, kwargs)


def _flatten_call(fn: Callable, args: tuple, kwargs: dict):
    try:
        sig = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    if bound is None:
        tree = {"args": list(args), "kwargs": dict(kwargs)}
    else:
        tree = dict(bound.arguments)
    paths_leaves, spec = pytree.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in paths_leaves]
    names = [_path_name(path) for path, _ in paths_leaves]

    def rebuild(new_leaves):
        rebuilt = pytree.tree_unflatten(list(new_leaves), spec)
        if bound is None:
            return tuple(rebuilt["args"]), rebuilt["kwargs"]
        b = inspect.BoundArguments(bound.signature, rebuilt)
        return b.args, b.kwargs

    return leaves, names, rebuild


_flat_specs: dict = {}  # id(spec) -> (spec, list or tuple when it is a flat one, else None)


def unflatten_outputs(flat: list, spec):
    """`pytree.tree_unflatten(flat, spec)`, with the common case made cheap: a spec that is one
    list or tuple of leaves (a backward's gradients, a hundred of them) gives that list or tuple
    of `flat` directly. Which specs are flat is found once per spec (by unflattening 0..n-1)."""
    known = _flat_specs.get(id(spec))
    if known is None or known[0] is not spec:
        n = spec.num_leaves
        probe = pytree.tree_unflatten(list(range(n)), spec)
        kind = type(probe) if type(probe) in (list, tuple) and list(probe) == list(range(n)) else None
        known = _flat_specs[id(spec)] = (spec, kind)
    kind = known[1]
    if kind is not None:
        return kind(flat)
    return pytree.tree_unflatten(flat, spec)


def _path_name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    name = "_".join(parts) or "arg"
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return name if name[0].isalpha() else "arg_" + name


def is_cpu_scalar(t: torch.Tensor) -> bool:
    """A 0-dim CPU tensor: eager lets it meet tensors of any device, as a number would."""
    return t.dim() == 0 and t.device.type == "cpu"


def program_device(tensors: list[torch.Tensor]) -> torch.device:
    """The device a program runs on: its tensors' device, not counting 0-dim CPU tensors
    (`torch.tensor(2.0)` next to CUDA activations runs on CUDA, as in eager)."""
    devices = [t.device for t in tensors if not is_cpu_scalar(t)]
    # an accelerator wins over the CPU: CPU indices next to CUDA data (`x[idx]`) are moved
    # to the device with the scalars (frontend.scalars_to_device)
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))


def graph_device(gm) -> torch.device | None:
    """The device of a program that was given no tensors: the first device other than the CPU
    that one of its values lives on, else the CPU; None if it makes no tensor at all."""
    devices = [m.device for n in gm.graph.nodes for m in [n.meta.get("fusec")]
               if isinstance(getattr(m, "device", None), str)]
    if not devices:
        return None
    return torch.device(next((d for d in devices if d != "cpu"), "cpu"))


def check_devices(tensors: list[torch.Tensor], names: list[str], device: torch.device) -> None:
    devices = {str(t.device) for t in tensors if not is_cpu_scalar(t) and t.device.type != "cpu"}
    if len(devices) > 1:  # (CPU tensors next to one device: frontend.scalars_to_device)
        where = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise DeviceError(f"fusec: inputs live on different devices ({where}); "
                          "move them to one device before calling the compiled program")


def check_arguments(leaves: list, names: list[str]) -> None:
    """Refuse, as one graph, arguments that hide tensors in objects pytree cannot open (a
    `DynamicCache` passed back in, as `model.generate` does on every step): their tensors would be
    baked into the graph as constants, and whatever the program does to the object (a cache
    appends this step's keys) would happen to the traced copy only. It is a graph break: with
    fullgraph=False the program is compiled in regions through TorchDynamo, which opens such
    objects, tracks what the program does to them and does it to the caller's object. A module
    argument with parameters or buffers is a graph break too: TorchDynamo lifts its state as
    inputs of the graph, where one traced graph would hold it as constants."""
    for leaf, name in zip(leaves, names):
        if isinstance(leaf, torch.nn.Module) and _holds_state(leaf):
            kind = type(leaf).__name__
            raise GraphBreakError(
                f"fusec: argument {name!r} is a {kind} module with parameters or buffers; one "
                "captured graph would hold them as constants (no gradients for them, a replaced "
                "parameter unseen). Compile the module itself (fusec.compile(module)), or let "
                "fusec compile in regions through TorchDynamo, which takes them as inputs",
                reason=f"argument {name!r} is a {kind} module whose parameters one graph would "
                "hold as constants")
        if not isinstance(leaf, torch.Tensor) and outputs.holds_tensors(leaf):
            kind = type(leaf).__name__
            raise GraphBreakError(
                f"fusec: argument {name!r} is a {kind} holding tensors; one captured graph takes "
                "tensors in tuples, lists, dicts and pytree-registered types as arguments. Pass "
                "its tensors directly, or register the type with torch.utils._pytree",
                reason=f"argument {name!r} is a {kind} holding tensors, which one graph cannot "
                "take")


def argument_containers(args: tuple, kwargs: dict) -> list[tuple]:
    """(container, a copy of its items) for every list and dict among the arguments a traced
    call is given, nested ones too: `check_containers` compares them after the call."""
    found: list[tuple] = []

    def walk(value, depth: int) -> None:
        if depth > 8:
            return
        if type(value) is list:
            found.append((value, list(value)))
        elif type(value) is dict:
            found.append((value, dict(value)))
        elif type(value) is not tuple:
            return
        for item in (value.values() if type(value) is dict else value):
            walk(item, depth + 1)
    walk((args, kwargs), 0)
    return found


def check_containers(found: list[tuple]) -> None:
    """A program that appends to, removes from or assigns into a list or dict argument
    (`xs.append(y)`, `out["h"] = h`) changes the caller's container in eager; a captured graph
    returns tensors and would not (it traces a rebuilt copy): a graph break, whose regions
    TorchDynamo runs with the caller's containers changed as eager changes them."""
    for container, then in found:
        if type(container) is list:
            same = len(container) == len(then) and all(a is b for a, b in zip(container, then))
        else:
            same = container.keys() == then.keys() and all(container[k] is then[k] for k in then)
        if not same:
            kind = type(container).__name__
            raise GraphBreakError(
                f"fusec: the program changes a {kind} it is given (append, pop, item "
                "assignment); a captured graph returns tensors but cannot change the caller's "
                f"{kind}", reason=f"changes a {kind} argument")


def _holds_state(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


# Note (argument objects while tracing): an argument pytree cannot open that holds no tensors yet
# (a fresh `DynamicCache`, which HF's GPT-2 hands every block when it is compiled block by block,
# as FSDP2's per-block recipe does) passes `check_arguments`, but the program may put tensors
# into it (the cache appends this block's keys). Tracing runs the program on fake tensors, so
# the caller's object would end up holding them (a cache of fake tensors handed back to the user,
# and AOT Autograd, which traces twice, finding the first trace's fake tensors in the second as
# constants); and the compiled program, which only computes tensors, would never do it at all.
# So tracing calls the program with a copy of each such object (`traced_copies`), the caller's
# object stays as it was, and a program that wrote tensors into the copy is a graph break
# (`check_copies`): TorchDynamo tracks what a program does to such objects and does it to the
# caller's object, as eager does.


def _is_object(leaf) -> bool:
    """An argument pytree cannot open: not a tensor, a plain value, a type, a module, a random
    generator (whose state the program must advance, not a copy's) or a function (which a
    program calls, not fills)."""
    return not isinstance(leaf, (torch.Tensor, *outputs.PLAIN, type, torch.nn.Module,
                                 torch.Generator)) and not callable(leaf)


def traced_copies(leaves: list) -> dict[int, object]:
    """{position: a deep copy} of every argument object among `leaves` (see the Note above);
    an object that cannot be copied is traced as itself."""
    import copy
    copies = {}
    for i, leaf in enumerate(leaves):
        if _is_object(leaf):
            try:
                copies[i] = copy.deepcopy(leaf)
            except Exception:  # noqa: BLE001 (locks, handles ...: `check_copies` still looks)
                copies[i] = leaf
    return copies


def check_copies(copies: dict[int, object]) -> None:
    """After tracing: refuse, as a graph break, a program that put tensors into an argument
    object (see the Note above)."""
    for copied in copies.values():
        if outputs.holds_tensors(copied):
            kind = type(copied).__name__
            raise GraphBreakError(
                f"fusec: the program puts tensors into its argument, a {kind} (a cache filled "
                "as it runs); a captured graph returns tensors but cannot change the caller's "
                "objects",
                reason=f"puts tensors into an argument {kind}, which one graph cannot do")
