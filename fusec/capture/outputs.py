"""Outputs of any shape: flatten what a program returns into tensors, and build it again.

A compiled program computes a flat list of tensors; the caller must get back what eager returns,
in the same structure and of the same types. torch's pytree does most of this: tuples, lists,
dicts, namedtuples, and every type a library registers with it (transformers registers each
`ModelOutput` dataclass, so `CausalLMOutputWithPast(logits=..., ...)` flattens to its tensors and
comes back as a `CausalLMOutputWithPast`).

Some objects are not registered: transformers' `DynamicCache`, which LlamaForCausalLM returns by
default, is a plain Python object holding a list of `DynamicLayer` objects, each holding `keys`
and `values` tensors. For those, fusec walks the object's attributes itself:

    DynamicCache                      flat leaves         rebuilt per call
      layers: [DynamicLayer           keys_0, values_0    copy.copy(cache), with
                 keys, values, ...]   keys_1, values_1    .layers = [copy.copy(layer) ...]
      (ints, flags, config: kept)                         holding the new tensors

Every attribute that holds a tensor (directly or deeper down) becomes a child; everything else is
kept from the traced object and shared by the rebuilt ones (a shallow copy, as `copy.copy` makes).
The wrapper `_Object` is registered with pytree once, so the result is an ordinary pytree spec:
`pytree.tree_unflatten(leaves, spec)` gives the user's types back, no special case downstream.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils import _pytree as pytree

# Python values returned as they are (not computed by the program): None, numbers, strings ...
PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
         torch.SymInt, torch.SymFloat, torch.SymBool)  # (a SymInt: a size of a shape family)


class _Object:
    """Stands, during flattening only, for an object pytree does not know (see the module
    docstring). Its children are the attributes that hold tensors; unflattening it builds a
    shallow copy of the original object with the new values in those attributes."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj


class _Template:
    """A pytree context: the traced object (what a rebuilt one copies) and the names of its
    attributes that hold tensors. Two templates are equal when their objects have the same type
    and the same tensor attributes, so that flattening the same program twice (AOT Autograd
    does) gives equal specs."""

    __slots__ = ("obj", "names")

    def __init__(self, obj: Any, names: tuple[str, ...]):
        self.obj, self.names = obj, names

    def __eq__(self, other) -> bool:
        return isinstance(other, _Template) and type(self.obj) is type(other.obj) \
            and self.names == other.names

    def __hash__(self) -> int:
        return hash((type(self.obj), self.names))

    def __repr__(self) -> str:
        return f"{type(self.obj).__name__}({', '.join(self.names)})"

    def __reduce__(self):
        """Pickled (in a saved program: fusec/runtime/fast_start/saved.py) without the traced values: the
        attributes that held them are filled anew by every unflatten anyway."""
        bare = copy.copy(self.obj)
        for name in self.names:
            object.__setattr__(bare, name, None)
        return (_Template, (bare, self.names))


def _object_flatten(node: _Object):
    obj = node.obj
    names = tuple(name for name, value in _attributes(obj) if holds_tensors(value))
    return [wrap(getattr(obj, name)) for name in names], _Template(obj, names)


def _object_unflatten(values, template: _Template):
    new = copy.copy(template.obj)
    for name, value in zip(template.names, values):
        object.__setattr__(new, name, value)  # as the traced object held it, past any __setattr__
    return new


pytree.register_pytree_node(_Object, _object_flatten, _object_unflatten,
                            serialized_type_name="fusec.outputs._Object")


def _attributes(obj: Any):
    """(name, value) of an object's instance attributes (`__dict__` and `__slots__`)."""
    seen = set()
    for name, value in getattr(obj, "__dict__", {}).items():
        seen.add(name)
        yield name, value
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in seen and name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                seen.add(name)
                yield name, getattr(obj, name)


def holds_tensors(value: Any, _depth: int = 0) -> bool:
    """True if a tensor is reachable from `value` through containers and object attributes."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, PLAIN) or _depth > 32 or isinstance(value, (type, torch.nn.Module)):
        return False  # a module's parameters are not outputs; `type` objects hold no values
    if not pytree.tree_is_leaf(value):  # a container or a registered type: its leaves
        return any(holds_tensors(leaf, _depth + 1) for leaf in pytree.tree_leaves(value))
    return any(holds_tensors(v, _depth + 1) for _, v in _attributes(value))


def wrap(value: Any) -> Any:
    """`value` with every object pytree does not know, and that holds tensors, wrapped in
    `_Object`, so that pytree flattens all the way down to tensors."""
    def one(leaf):
        if isinstance(leaf, (torch.Tensor, *PLAIN)) or not holds_tensors(leaf):
            return leaf
        return _Object(leaf)
    return pytree.tree_map(one, value, is_leaf=_is_size)


def _is_size(value: Any) -> bool:
    """torch.Size is one leaf (a plain value): pytree would flatten it into its ints and
    rebuild a plain tuple, and `y.shape` returned from a program must stay a torch.Size."""
    return isinstance(value, torch.Size)


def flatten(value: Any) -> tuple[list, pytree.TreeSpec]:
    """(leaves, spec) of a program's result: tensors and plain values as leaves, whatever the
    nesting of containers, registered types and plain objects. `unflatten` inverts it."""
    return pytree.tree_flatten(wrap(value), is_leaf=_is_size)


def unflatten(leaves: list, spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def leaves(value: Any) -> list:
    return flatten(value)[0]
