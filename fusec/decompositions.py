"""Decompositions fusec adds to torch's core ATen table, so composite ops become reductions
plus pointwise ops that fusion can see.

The core ATen opset keeps `_softmax`, `native_layer_norm`, `var` ... as single ops (a backend
might have one fast kernel for each). fusec would rather see their parts:

    softmax(x)   ->  m = amax(x, -1, keepdim); e = exp(x - m); e / sum(e, -1, keepdim)
    var(x, d)    ->  mu = sum(x, d, keepdim) / n; sum((x - mu)**2, d) / (n - correction)

Every reduction then reduces to a few primitives (sum, prod, amax, amin, argmax, argmin, any,
all), and the fusion pass puts a softmax or a layer norm into one kernel. Variance uses the
two-pass formula (mean first, then squared deviations), which is as accurate as eager's.
torch's own decompositions are used where they produce ATen ops; mean and var are written here
because torch's versions produce `prims` ops.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

FROM_TORCH = [
    aten._softmax.default, aten._log_softmax.default, aten.native_layer_norm.default,
    aten.native_group_norm.default, aten._native_batch_norm_legit_no_training.default,
    aten.linalg_vector_norm.default, aten.std.correction, aten.any.dims,
]

OURS: dict = {}


def register(op):
    def wrap(fn):
        OURS[op] = fn
        return fn
    return wrap


def _dims(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted(d % max(x.dim(), 1) for d in dim)


def _count(x, dims) -> int:
    return math.prod(x.shape[d] for d in dims) if x.dim() else 1


@register(aten.mean.dim)
def mean_dim(x, dim, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    out_dtype = dtype or x.dtype
    if out_dtype in (torch.float16, torch.bfloat16):  # like eager: sum and divide in float32
        total = aten.sum.dim_IntList(x, dims, keepdim, dtype=torch.float32)
        return aten._to_copy.default(aten.div.Tensor(total, _count(x, dims)), dtype=out_dtype)
    total = aten.sum.dim_IntList(x, dims, keepdim, dtype=out_dtype)
    return aten.div.Tensor(total, _count(x, dims))


@register(aten.mean.default)
def mean_default(x, *, dtype=None):
    return mean_dim(x, None, False, dtype=dtype)


def _var(x, dim, correction, keepdim):
    if x.dtype in (torch.float16, torch.bfloat16):  # like eager: compute in float32
        var, mean = _var(aten._to_copy.default(x, dtype=torch.float32), dim, correction, keepdim)
        return aten._to_copy.default(var, dtype=x.dtype), aten._to_copy.default(mean, dtype=x.dtype)
    dims = _dims(x, dim)
    n = _count(x, dims)
    correction = 1 if correction is None else correction
    mean = aten.div.Tensor(aten.sum.dim_IntList(x, dims, True), n)
    dev = aten.sub.Tensor(x, mean)
    var = aten.div.Tensor(aten.sum.dim_IntList(aten.mul.Tensor(dev, dev), dims, keepdim),
                          max(0, n - correction))
    return var, mean if keepdim else aten.squeeze.dims(mean, dims)


@register(aten.var.correction)
def var_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction, keepdim)[0]


@register(aten.var_mean.correction)
def var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction, keepdim)


@register(aten.sum.default)
def sum_default(x, *, dtype=None):
    return aten.sum.dim_IntList(x, list(range(x.dim())), False, dtype=dtype)


def table() -> dict:
    from torch._decomp import get_decompositions
    decomps = dict(get_decompositions(FROM_TORCH))
    decomps.update(OURS)
    return decomps
