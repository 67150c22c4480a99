"""Known results: how a fingerprint skips the fake calls that are slow the first time.

A warm start's fingerprint (fingerprint.py) runs the model once under fake tensors. On a GPU
host that was most of a convolution network's warm start: 0.5 s for ResNet-50, MobileNetV3 or
EfficientNet-B0, of which about 70% was batch norm. A fake tensor has no CUDA batch-norm kernel
to ask for the output's shape, so torch runs batch norm's Python decomposition, twenty small ops,
each met for the first time in the process. A second fingerprint in the same process takes
0.1 s: torch's fake-tensor cache remembers each op and shape. That cache lives in memory; this
one is a file, and serves the next process.

For a few functions (`PURE`: each returns one new tensor and changes no tensor's shape or
strides), a fingerprint writes down what a call returned (shape, strides, dtype, device) under
a key that names the function and every argument, tensors by those same four properties and
everything else by value, and the switches that steer it (autocast, cuDNN and oneDNN on or off):

    torch.nn.functional.batch_norm((32, 64, 56, 56)/(200704, 1, 3584, 64)+0 torch.bfloat16
        cuda:0, ..., False, 0.1, 1e-05) -> (32, 64, 56, 56) (200704, 1, 3584, 64) bfloat16 cuda:0

A later process making the same call gets an empty fake tensor of that description instead of
running the call. The fingerprint's text is the same either way (its result is the one the call
returned), and a fingerprint never reads a tensor's data, so nothing else could tell. One file
per environment (`fingerprint.environment`: fusec's source hash, versions, flags), in the cache:

    ~/.cache/fusec/programs/known-<hash of the environment>.json

A call that raised, returned one of its arguments, a view, or anything but a plain tensor is
not written down, and runs every time. `FUSEC_SAVED_PROGRAMS=0` (no fingerprints) leaves it
unused.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import resolve_name

from fusec import cache

# Functions whose result is a new tensor, never an argument or a view of one, and that change
# no argument's shape or strides (batch norm's running statistics change in data only). An
# in-place form (`inplace=True`) returns its argument: those calls are run, not remembered.
PURE = {F.batch_norm, torch.batch_norm, torch.conv1d, torch.conv2d, torch.conv3d,
        F.hardsigmoid, F.hardswish, F.silu, F.relu, F.relu6, F.gelu, F.mish,
        F.adaptive_avg_pool2d, F.avg_pool2d, F.layer_norm, F.group_norm}
MAX_ENTRIES = 50_000  # a table grown past this (many models, many shapes) starts afresh


class Known:
    """The known results of one environment: read from the cache once, written back after a
    fingerprint that learned something new."""

    def __init__(self, environment: str):
        digest = hashlib.sha256(environment.encode()).hexdigest()[:16]
        self.path = cache.cache_dir("programs") / f"known-{digest}.json"
        self.table: dict[str, list] = _read(self.path)
        self.new: dict[str, list] = {}
        self.hits = 0  # calls answered from the table (tests read it)

    def call(self, func, args: tuple, kwargs: dict):
        """`func(*args, **kwargs)`, or the empty fake tensor it returned last time."""
        key = _key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        known = _replay(self.table.get(key))
        if known is not None:
            self.hits += 1
            return known
        out = func(*args, **kwargs)
        if _plain_result(out, args, kwargs):
            self.new[key] = self.table[key] = [list(out.shape), list(out.stride()),
                                               str(out.dtype).removeprefix("torch."),
                                               str(out.device)]
        return out

    def save(self) -> None:
        """Add what this process learned to the file (another process's additions are kept;
        if two write at once, one's are lost, and learned again)."""
        if not self.new:
            return
        table = _read(self.path)
        table = {} if len(table) + len(self.new) > MAX_ENTRIES else table
        table.update(self.new)
        try:
            cache.atomic_write(self.path, json.dumps(table))
        except OSError:
            return  # a read-only cache: learned again next time
        self.new = {}


_TABLES: dict[str, Known] = {}


def known(environment: str) -> Known:
    """This process's known results for `environment` (read from the cache on first use)."""
    table = _TABLES.get(environment)
    if table is None:
        table = _TABLES[environment] = Known(environment)
    return table


def _replay(entry):
    """An empty fake tensor as an entry describes it (made under the fingerprint's fake mode), or
    None for no entry, or one that does not describe a tensor (a damaged file): then the call
    runs, and its result replaces the entry."""
    if entry is None:
        return None
    try:
        shape, stride, dtype, device = entry
        dtype = getattr(torch, dtype)
        if not isinstance(dtype, torch.dtype):
            return None
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    except (TypeError, ValueError, AttributeError, RuntimeError):
        return None


def _read(path) -> dict:
    try:
        table = json.loads(cache.read_bytes(path))  # (this user's file only)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _key(func, args: tuple, kwargs: dict) -> str | None:
    """The text naming a call of a PURE function and everything its result's shape, strides,
    dtype and device can depend on; None for any other call."""
    try:
        if func not in PURE:
            return None
    except TypeError:  # an unhashable callable
        return None
    if kwargs.get("inplace") or \
            (func in _INPLACE_SECOND and len(args) > 1 and args[1] is True):
        return None
    try:
        text = _encode((args, kwargs))
    except _Unknown:
        return None
    # (the convolution libraries, when on, decide a fake convolution's output layout)
    return (f"{resolve_name(func) or repr(func)}{text} autocast {_autocast('cuda')} "
            f"{_autocast('cpu')} cudnn {torch.backends.cudnn.enabled} "
            f"mkldnn {torch.backends.mkldnn.enabled}")


# the activations whose second argument is `inplace` (`F.relu(x, True)`)
_INPLACE_SECOND = {F.hardsigmoid, F.hardswish, F.silu, F.relu, F.relu6, F.mish}


class _Unknown(Exception):
    """An argument this table does not describe: the call is run."""


def describe(t: torch.Tensor) -> str:
    """A tensor's shape, strides, offset, dtype and device (and autograd), as the fingerprint and
    this table write them."""
    return (f"{tuple(t.shape)}/{t.stride()}+{t.storage_offset()} {t.dtype} {t.device}"
            f"{' grad' if t.requires_grad else ''}")


def _encode(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if not isinstance(value, FakeTensor) or value.layout != torch.strided \
                or value.is_conj() or value.is_neg() or value.requires_grad:
            raise _Unknown
        return describe(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}(" + ",".join(_encode(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_encode(v)}" for k, v in value.items()) + "}"
    raise _Unknown


def _autocast(device: str) -> str:
    if not torch.is_autocast_enabled(device):
        return "off"
    return str(torch.get_autocast_dtype(device))


def _plain_result(out, args: tuple, kwargs: dict) -> bool:
    """A new, plain fake tensor: not an argument, not a view, no autograd history."""
    if not isinstance(out, FakeTensor) or out._base is not None or out.storage_offset() != 0 \
            or out.layout != torch.strided or out.requires_grad or out.is_conj() or out.is_neg():
        return False
    return all(out is not a for a in (*args, *kwargs.values()))
