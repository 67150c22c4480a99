"""The training fast path: a training call that looks like the last one skips the general path.

A training step calls the compiled module with the same kind of batch every time
(`model(input_ids=ids, labels=ids)`), while autograd records and the module's ~100 parameters
and buffers require grad or not as before. The general path (`CompiledFunction._call` and
`_train` in fusec/api.py) works that out again on every call: it binds the keyword arguments to
the forward's signature (inspect.signature), builds the signature of every parameter, buffer
and argument as a tuple, and looks the program up by it. `training_fast_path` writes that check
out once per signature as straight-line Python, as fusec/fastpath.py does for inference calls:

    def fast(args, kwargs):
        if args or len(kwargs) != 2 or not is_grad_enabled():
            return MISS
        if module.training is not True:
            return MISS
        try:
            a0 = kwargs['input_ids']
            a1 = kwargs['labels']
        except KeyError:
            return MISS
        if tuple(kwargs) != NAMES:                       # the same keywords in the same order
            return MISS
        p0 = owner0._parameters['weight']                # read where it lives (an optimizer,
        if (type(p0) is not Parameter or p0.shape != (256, 64) or p0.stride() != (64, 1)
                or p0.dtype is not float32 or not p0.is_cpu or not p0.requires_grad):
            return MISS                                  # or the user, may replace it)
        ...
        return hit(p0, ..., a0, a1)

Every value the general path's key holds is checked: each tensor's type (one of the plain ones;
a subclass takes the general path), shape, strides, dtype, device and requires_grad,
`module.training`, and the Python state the capture read (capture/guards.py `fast_lines`).
Anything else (a new shape, a replaced parameter of another shape, a requires_grad flip,
`eval()`, grad mode off, other keywords) returns MISS, and the general path decides as before:
it compiles again, or raises, and says why. A call that hits runs AOT Autograd's compiled
forward (capture/training.py `aot_compile`'s `run`), whose backward autograd calls later.
"""
from __future__ import annotations

import builtins
from typing import Callable

import torch

from fusec import env
from fusec.fastpath import MISS, PLAIN_TENSORS, autocast_lines


def training_fast_path_on() -> bool:
    """FUSEC_TRAIN_FAST_PATH (default on): training calls like the last one take the fast path;
    off, every training call takes the general path (to compare: benchmarks/train.py's
    `fusec-general` system does)."""
    return env.flag("FUSEC_TRAIN_FAST_PATH", True)


def fast_path_leaves(args: tuple, kwargs: dict, leaves: list) -> bool:
    """Whether a call can take the training fast path: its flat arguments (`leaves`, in the
    order the program takes them) are its positional arguments and then its keyword arguments'
    values, in the order given, each a plain tensor. (A nested or non-tensor argument, or
    keywords that the forward's signature puts in another order, take the general path.)"""
    given = [*args, *kwargs.values()]
    return len(given) == len(leaves) and all(
        a is b and type(a) in PLAIN_TENSORS for a, b in zip(given, leaves))


def _tensor_check(var: str, t: torch.Tensor, glob: dict, sized: bool = True) -> list[str]:
    """The lines that return MISS unless `var` is a tensor like `t` (what fusec.fastpath's
    `call_signature` keys a program by, and its type); `sized` False: its rank only, for a
    tensor whose sizes and strides a shape family's check decides."""
    dtype, device = str(t.dtype).replace("torch.", ""), str(t.device).replace(":", "")
    glob[dtype], glob[device] = t.dtype, t.device
    kind = "Parameter" if type(t) is torch.nn.Parameter else "Tensor"
    shape = [f"{var}.shape != {tuple(t.shape)}", f"{var}.stride() != {tuple(t.stride())}"] \
        if sized else [f"{var}.dim() != {t.dim()}"]
    checks = [f"type({var}) is not {kind}", *shape, f"{var}.dtype is not {dtype}",
              f"not {var}.is_cpu" if device == "cpu" else f"{var}.device != {device}",
              f"{'not ' if t.requires_grad else ''}{var}.requires_grad"]
    cut = len(checks) // 2
    return [f"if ({' or '.join(checks[:cut])}", f"        or {' or '.join(checks[cut:])}):",
            "    return MISS"]


def training_fast_path(hit: Callable, lifted: list, args: tuple, kwargs: dict,
                       state_refs: list, module, python_state: tuple,
                       family_check: Callable | None = None) -> Callable:
    """`fast(args, kwargs)`: `hit(*lifted, *tensors)` when the call matches the one that
    `lifted` (the module's state) and `args`/`kwargs` (plain tensors: `fast_path_leaves`) came
    from, else MISS. `python_state`: (lines, their globals) from `Guards.fast_lines`.

    `family_check`: for a shape family's training pair, the family's guard over the flat
    tensors (lifted state first, as `hit` takes them), which must check every size and stride
    of the caller's tensors: those are then checked here for type, rank, dtype, device and
    requires_grad only, and the family's check decides their sizes (the lifted state, whose
    sizes are fixed, keeps its exact checks), so one fast path serves every size of the family."""
    glob = {"MISS": MISS, "Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "hit": hit,
            "is_grad_enabled": torch.is_grad_enabled, "NAMES": tuple(kwargs),
            "family_check": family_check}
    n_pos, n_kw = len(args), len(kwargs)
    lines = [f"if len(args) != {n_pos} or len(kwargs) != {n_kw} or not is_grad_enabled():",
             "    return MISS", *autocast_lines(glob)]
    if module is not None:
        glob["module"] = module
        lines += [f"if module.training is not {module.training}:", "    return MISS"]
    names = [f"a{i}" for i in range(n_pos + n_kw)]
    if n_pos:
        lines.append(f"{', '.join(names[:n_pos])}, = args")
    if n_kw:
        lines += ["try:", *[f"    {var} = kwargs[{key!r}]" for var, key in
                            zip(names[n_pos:], kwargs)],
                  "except KeyError:", "    return MISS",
                  "if tuple(kwargs) != NAMES:", "    return MISS"]
    state = [f"p{i}" for i in range(len(lifted))]
    for i, ref in enumerate(state_refs):
        glob[f"owner{i}"] = ref.owner
        lines.append(f"p{i} = {ref.expression(f'owner{i}')}")
    for var, t in zip(state + names, [*lifted, *args, *kwargs.values()]):
        lines += _tensor_check(var, t, glob, family_check is None or var.startswith("p"))
    if family_check is not None:
        lines += [f"if not family_check([{', '.join(state + names)}]):",
                  "    return MISS  # the shape family's guards"]
    lines += python_state[0]
    glob.update(python_state[1])
    lines.append(f"return hit({', '.join(state + names)})")
    source = "def fast(args, kwargs):\n" + "".join(f"    {line}\n" for line in lines)
    exec(builtins.compile(source, "<fusec training fast path>", "exec"), glob)
    fast = glob["fast"]
    fast.source, fast.hit = source, hit
    return fast
