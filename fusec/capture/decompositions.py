"""Decompositions fusec adds to torch's core ATen table, so composite ops become reductions
plus pointwise ops that fusion can see.

Why this file is long: it is one table, every op fusec decomposes its own way (reductions,
norms in inference and training, forward and backward), registered in one dict that capture
reads; split, a reader would look in several files for what one op becomes.

The core ATen opset keeps `_softmax`, `native_layer_norm`, `var` ... as single ops (a backend
might have one fast kernel for each). fusec would rather see their parts:

    softmax(x)   ->  m = amax(x, -1, keepdim); e = exp(x - m); e / sum(e, -1, keepdim)
    var(x, d)    ->  mu = sum(x, d, keepdim) / n; sum((x - mu)**2, d) / (n - correction)

Every reduction then reduces to a few primitives (sum, prod, amax, amin, argmax, argmin, any,
all), and the fusion pass puts a softmax or a layer norm into one kernel. Variance uses the
two-pass formula (mean first, then squared deviations), which is as accurate as eager's.
torch's own decompositions are used where they produce ATen ops; mean and var are written here
because torch's versions produce `prims` ops.

A few are written here so that the whole op stays in the reduction's own iteration space and
fusion can make it one kernel: logsumexp reduces with keepdim and squeezes only the final result
(torch's squeezes the max first, and a squeezed row value cannot be broadcast back inside a
kernel); group_norm normalizes and applies its affine in the (N, groups, C/groups, *spatial) view and
reshapes only the output (torch's reshapes the statistics back to (N, C) first); and batch_norm
in inference mode, which CPU tracing reaches as `native_batch_norm(training=False)`, becomes the
pointwise (x - running_mean) * rsqrt(running_var + eps) * weight + bias.
"""
from __future__ import annotations

import math

import torch
from torch._decomp import get_decompositions
from torch._prims_common import reduction_dims, suggest_memory_format

from fusec.symbolic import hint

aten = torch.ops.aten

FROM_TORCH = [
    aten._softmax.default, aten._log_softmax.default, aten.native_layer_norm.default,
    aten.linalg_vector_norm.default, aten.std.correction, aten.any.dims,
    # activations the core opset keeps whole: a where and a clamp that fusion can see (as
    # externs they split a conv's epilogue in three: KernelBench-style 14_conv2d_leakyrelu_...)
    aten.leaky_relu.default, aten.hardtanh.default,
]

OURS: dict = {}


def register(op):
    def wrap(fn):
        OURS[op] = fn
        return fn
    return wrap


def _dims(x, dim):
    """The reduced dims, sorted and non-negative. An out-of-range or repeated dim raises the
    error eager raises (a bare `d % rank` would quietly reduce over some other dim)."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted(reduction_dims(x.shape, dim)) if x.dim() else []


def _count(x, dims) -> int:
    return math.prod(x.shape[d] for d in dims) if x.dim() else 1


# the names eager's messages give dtypes (c10::ScalarType's)
_C10_NAMES = {torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
              torch.int64: "Long", torch.bool: "Bool"}


@register(aten.mean.dim)
def mean_dim(x, dim, keepdim=False, *, dtype=None):
    dims = _dims(x, dim)
    out_dtype = dtype or x.dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        # eager refuses to average integers (and bools) unless dtype= says what to average in;
        # a kernel would happily divide the integer sum, so refuse here with eager's words
        raise RuntimeError("mean(): could not infer output dtype. Input dtype must be either a "
                           "floating point or complex dtype. Got: " + _C10_NAMES.get(out_dtype,
                                                                                    str(out_dtype)))
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
                          torch.sym_max(0, n - correction))  # (no guard on a size symbol)
    return var, mean if keepdim else aten.squeeze.dims(mean, dims)


@register(aten.var.correction)
def var_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction, keepdim)[0]


@register(aten.var_mean.correction)
def var_mean_correction(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction, keepdim)


@register(aten.cat.default)
def cat_without_empties(tensors, dim=0):
    """Concatenation with empty tensors in the list: the empties dropped. A KV cache that starts
    as `torch.tensor([])` and grows by `torch.cat([cache, k], dim=-2)` is then, at the first
    step, a copy of k, which fusion puts in the kernel that makes k (a cat is an extern).
    torch.cat skips a 1-d empty tensor whatever the dim, and a tensor of size 0 along the dim
    adds nothing; the dtype is still promoted over every tensor, and the memory format is the
    inputs' (the empties' too) when they agree, else contiguous, as eager's cat picks it. Any
    other cat is traced as it is."""
    def skipped(t):  # eager's cat ignores these for shapes (not for the memory format)
        return t.dim() == 1 and t.numel() == 0
    kept = [t for t in tensors if not skipped(t) and t.shape[dim] != 0]
    if not kept or len(kept) == len(tensors):
        return NotImplemented
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    fmt = _cat_format(tensors)
    if len(kept) > 1:
        if _cat_format(kept) != fmt:
            return NotImplemented  # the cat of the rest would pick another layout
        out = aten.cat.default(kept, dim)
        return out if out.dtype == dtype else aten._to_copy.default(out, dtype=dtype)
    return aten._to_copy.default(kept[0], dtype=dtype, memory_format=fmt)


def _cat_format(tensors):
    formats = {suggest_memory_format(t) for t in tensors}
    return formats.pop() if len(formats) == 1 else torch.contiguous_format


@register(aten.sum.default)
def sum_default(x, *, dtype=None):
    return aten.sum.dim_IntList(x, list(range(x.dim())), False, dtype=dtype)


# Note (reductions over an empty dim): a reduction over zero elements is its identity:
# sum -> 0, prod -> 1, any -> False, all -> True (amax, argmax ... have none, and eager raises,
# as tracing does). Such a reduction becomes a `full` of the result's shape here, so no kernel
# ever loops over an empty row. Every other call returns NotImplemented: traced as it is.

def _empty_reduction(identity, dim_pos=1, keep_pos=2, result_dtype=None):
    def decomp(x, *args, **kwargs):
        dim = kwargs.get("dim", args[dim_pos - 1] if len(args) >= dim_pos else None)
        keepdim = kwargs.get("keepdim", args[keep_pos - 1] if len(args) >= keep_pos else False)
        dims = _dims(x, dim)
        if _count(x, dims) != 0:
            return NotImplemented
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)
                 if keepdim or d not in dims]
        dtype = result_dtype(x, kwargs.get("dtype")) if result_dtype else torch.bool
        if dtype == torch.bool and x.dtype == torch.uint8:
            dtype = torch.uint8  # eager's any/all of uint8 are uint8
        return aten.full.default(shape, identity, dtype=dtype, device=x.device)
    return decomp


def _sum_dtype(x, dtype):
    if dtype is not None:
        return dtype
    return x.dtype if x.is_floating_point() or x.is_complex() else torch.int64


register(aten.sum.dim_IntList)(_empty_reduction(0, result_dtype=_sum_dtype))
register(aten.prod.dim_int)(_empty_reduction(1, result_dtype=_sum_dtype))
register(aten.prod.default)(_empty_reduction(1, 9, 9, result_dtype=_sum_dtype))
for _op in (aten.any.dim, aten.any.dims):
    register(_op)(_empty_reduction(False))
register(aten.any.default)(_empty_reduction(False, 9, 9))
register(aten.all.dim)(_empty_reduction(True))
register(aten.all.default)(_empty_reduction(True, 9, 9))


@register(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    if not x.is_floating_point():
        x = aten._to_copy.default(x, dtype=torch.get_default_dtype())
    dims = _dims(x, dim)
    if x.numel() == 0:  # no max to subtract; log(0) = -inf over an empty row, as eager
        return aten.log.default(aten.sum.dim_IntList(aten.exp.default(x), dims, keepdim))
    m = aten.amax.default(x, dims, True)
    m = aten.where.self(aten.eq.Scalar(aten.abs.default(m), math.inf),
                        aten.scalar_tensor.default(0.0, dtype=x.dtype, device=x.device), m)
    out = aten.add.Tensor(aten.log.default(aten.sum.dim_IntList(aten.exp.default(
        aten.sub.Tensor(x, m)), dims, True)), m)
    return out if keepdim else aten.squeeze.dims(out, dims)


def _max_min_dim(reduce, arg):
    def decomp(x, dim, keepdim=False):
        if x.dtype == torch.bool:
            return NotImplemented  # argmax has no bool kernel in eager: max.dim stays one call
        return reduce(x, [dim], keepdim), arg(x, dim, keepdim)
    return decomp


# torch.max(x, dim) is (amax, argmax): two sibling reductions that share one kernel
register(aten.max.dim)(_max_min_dim(aten.amax.default, aten.argmax.default))
register(aten.min.dim)(_max_min_dim(aten.amin.default, aten.argmin.default))
register(aten.max.default)(lambda x: aten.amax.default(x, list(range(x.dim()))))
register(aten.min.default)(lambda x: aten.amin.default(x, list(range(x.dim()))))


def _compute_dtype(x):
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@register(aten.mish.default)
def mish(x):
    """x * tanh(softplus(x)) with one exp instead of exp, log1p and tanh: with n = e^x,
    tanh(log(1 + n)) = ((1 + n)^2 - 1) / ((1 + n)^2 + 1) = n(n + 2) / (n(n + 2) + 2). The
    same number up to a few ulp, at a third of the transcendental work: a conv followed by mish
    is bound by that math on a GPU (KernelBench-style 2_conv2d_mish_mish: 0.195 ms for the
    kernel on an H200, Inductor's 0.148). x is clamped to 20 first, where the ratio is 1.0 in
    float32 already and n(n + 2) cannot overflow; -inf gives -inf * 0 = NaN, as eager's does."""
    if not x.dtype.is_floating_point:
        return NotImplemented
    dtype = _compute_dtype(x)
    wide = x if x.dtype == dtype else aten._to_copy.default(x, dtype=dtype)
    n = aten.exp.default(aten.clamp_max.default(wide, 20.0))
    t = aten.mul.Tensor(n, aten.add.Tensor(n, 2.0))
    out = aten.mul.Tensor(wide, aten.div.Tensor(t, aten.add.Tensor(t, 2.0)))
    return out if out.dtype == x.dtype else aten._to_copy.default(out, dtype=x.dtype)


@register(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n, c, hw, groups, eps):
    # views first, casts after: a view of an input folds into a load index, a view of a
    # computed value would end the kernel
    dtype = _compute_dtype(x)

    def wide(t):
        return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)

    def narrow(t):
        return t if t.dtype == x.dtype else aten._to_copy.default(t, dtype=x.dtype)

    # (N, C, *spatial) -> (N, groups, C/groups, *spatial): only C is cut, so this is a view of
    # a channels-last tensor too (merging C/groups with the spatial dims would not be, and the
    # layout pass would have to copy the convolution's output back to NCHW first)
    spatial = list(x.shape[2:])
    grouped = wide(aten.view.default(x, [n, groups, c // groups] + spatial))
    dims = list(range(2, 3 + len(spatial)))
    var, mean = _var(grouped, dims, 0, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    stats = (aten.view.default(narrow(mean), [n, groups]), aten.view.default(narrow(rstd), [n, groups]))
    if x.device.type in GROUP_NORM_PER_CHANNEL_DEVICES \
            and hint((c // groups) * math.prod(spatial)) >= GROUP_NORM_LONG_ROWS:  # (no guard)
        # (see the note on group norm per channel below)
        def per_channel(t):
            t = aten.expand.default(aten.view.default(t, [n, groups, 1]), [n, groups, c // groups])
            return aten.view.default(aten.clone.default(t), [n, c] + [1] * len(spatial))

        out = aten.mul.Tensor(aten.sub.Tensor(wide(x), per_channel(mean)), per_channel(rstd))
        affine = [1, c] + [1] * len(spatial)
    else:
        out = aten.mul.Tensor(aten.sub.Tensor(grouped, mean), rstd)
        affine = [1, groups, c // groups] + [1] * len(spatial)
    if weight is not None:
        out = aten.mul.Tensor(out, wide(aten.view.default(weight, affine)))
    if bias is not None:
        out = aten.add.Tensor(out, wide(aten.view.default(bias, affine)))
    out = narrow(out)  # (the cast before the view: a view of a computed value ends its kernel)
    if list(out.shape) != list(x.shape):
        out = aten.view.default(out, list(x.shape))
    return (out,) + stats


# Note (group norm per channel). On a GPU, when a group's rows are long (GROUP_NORM_LONG_ROWS,
# fuse_reductions' LONG_PROGRAM), one program per row is slow at normalizing: 256 rows of 131072
# elements (KernelBench-style 35_) took 0.449 ms in one grouped kernel, 0.349 as statistics plus
# a pointwise normalization over every element. And when the rows are also few, the statistics
# become split reductions (passes/split_reductions.py), kernels of their own whatever the
# normalization does. The normalization is then best done in x's own
# (N, C, *spatial) space, with the (N, groups) statistics copied out to (N, C) (a few kilobytes):
# the ops after the norm (a scale, an activation, a pooling's input, a mean) see the same shape
# and fuse with it. Normalized in the grouped view, its result would be a view of a computed
# value, stored whole before the next op could read it (one more pass over the activation,
# KernelBench-style 6_, 24_ and 28_). On the CPU the grouped form stays: one reduction kernel
# computes the statistics and normalizes while the group's rows are in cache, and so it does on
# a GPU when the rows are short (one kernel instead of four).
GROUP_NORM_PER_CHANNEL_DEVICES = ("cuda",)
GROUP_NORM_LONG_ROWS = 1 << 16  # passes/fuse_reductions.py LONG_PROGRAM (capture imports no pass)


@register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(x, weight, bias, running_mean, running_var, momentum, eps):
    return native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)


@register(aten.native_batch_norm.default)
def native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    if training and running_mean is None and running_var is None and x.dtype in (
            torch.float32, torch.float64):
        return batch_norm_batch_statistics(x, weight, bias, eps)
    if training or running_mean is None or running_var is None:
        return NotImplemented  # running-stat updates: traced as is
    out = batch_norm_running_statistics(x, weight, bias, running_mean, running_var, eps)
    if x.device.type == "cpu":  # eager returns empty statistics on the CPU in inference mode
        empty = aten.full.default([0], 0, dtype=x.dtype, device=x.device)
        return out, empty, empty
    return out, running_mean, aten.rsqrt.default(aten.add.Tensor(running_var, eps))


def batch_norm_running_statistics(x, weight, bias, running_mean, running_var, eps):
    """Batch norm in inference: (x - running_mean) * rsqrt(running_var + eps) * weight + bias,
    pointwise, each (C,) vector a view that folds into the kernel's load index; half inputs are
    computed in float32 as eager's kernel does. capture/torch_level.py calls this directly for
    `torch.batch_norm`, above its composite chain."""
    dtype = _compute_dtype(x)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)

    def per_channel(t):  # a view of a (C,) input: folds into the kernel's load index
        t = aten.view.default(t, shape)
        return t if t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)

    wide = x if x.dtype == dtype else aten._to_copy.default(x, dtype=dtype)
    rstd = aten.rsqrt.default(aten.add.Tensor(per_channel(running_var), eps))
    out = aten.mul.Tensor(aten.sub.Tensor(wide, per_channel(running_mean)), rstd)
    if weight is not None:
        out = aten.mul.Tensor(out, per_channel(weight))
    if bias is not None:
        out = aten.add.Tensor(out, per_channel(bias))
    return out if out.dtype == x.dtype else aten._to_copy.default(out, dtype=x.dtype)


def batch_norm_batch_statistics(x, weight, bias, eps):
    """Normalization by the batch's own statistics, with no running statistics to update: what
    InstanceNorm (a batch norm over the (1, N*C, H, W) view of its input) and a BatchNorm with
    track_running_stats=False compute. The mean and the biased variance over every dim but the
    channels, then pointwise: one reduction kernel and its epilogue instead of eager's two
    kernels. Returns (out, mean, 1 / std) as eager does; float32 and float64 only (for half
    inputs eager's statistics dtypes differ between devices)."""
    out, mean, rstd, _ = _batch_statistics(x, weight, bias, eps)
    channels = [x.shape[1]]
    return out, aten.view.default(mean, channels), aten.view.default(rstd, channels)


def _batch_statistics(x, weight, bias, eps):
    """(out, mean, 1 / std, biased variance), the last three of shape (1, C, 1, ...): the
    reduction's own rows (keepdim), so that what is computed from them fits its kernel."""
    dims = [0] + list(range(2, x.dim()))
    var, mean = _var(x, dims, 0, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, eps))
    out = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    return out, mean, rstd, var


@register(aten._native_batch_norm_legit_functional.default)
def batch_norm_training(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm in training, as AOT Autograd's functionalization leaves it: the batch's
    statistics normalize x (as `batch_norm_batch_statistics`), and the new running statistics
    are returned, for the program to copy into the module's buffers:

        new_running_mean = momentum * mean + (1 - momentum) * running_mean
        new_running_var  = momentum * var * n / (n - 1) + (1 - momentum) * running_var

    (n: the values per channel; eager's running variance is the unbiased one). Each new
    statistic is pointwise on the reduction's results, computed in their keepdim shape
    (1, C, 1, ...), the rows of the reduction's loop, and viewed as (C,) only at the end (a
    (C,) value would not fit that loop: it broadcasts along the last dim), so fusion computes
    it in the reduction kernel: one reduction kernel (mean, variance, running statistics) and
    one pointwise kernel (the normalization, with what follows it, a ReLU or a residual add),
    where the op as an extern call is eager's kernel plus copies of what it returns.

    Half inputs (a convolution's bfloat16 output under autocast, with float32 weights and
    running statistics) are computed in float32, as eager's kernels compute them: x is widened
    as the kernels load it, the output rounded to x's dtype as they store it, and the saved
    mean and 1 / std stay float32 (what eager returns on either device at run time, and what
    `batch_norm_backward` below reads)."""
    if not training or running_mean is None or running_var is None \
            or not _norm_dtypes(x, weight, bias, running_mean, running_var):
        return NotImplemented
    dtype = _compute_dtype(x)
    out, mean, rstd, var = _batch_statistics(*(_widened(t, dtype) for t in (x, weight, bias)), eps)
    n = x.numel() // x.shape[1]
    unbiased = aten.mul.Tensor(var, n / (n - 1)) if n > 1 else aten.div.Tensor(var, 0)
    shape, channels = list(mean.shape), [x.shape[1]]

    def updated(running, batch):  # momentum * batch + (1 - momentum) * running, as (C,)
        new = aten.add.Tensor(aten.mul.Tensor(batch, momentum), aten.mul.Tensor(
            _widened(aten.view.default(running, shape), dtype), 1 - momentum))
        return _widened(aten.view.default(new, channels), running.dtype)

    return (_widened(out, x.dtype), aten.view.default(mean, channels),
            aten.view.default(rstd, channels), updated(running_mean, mean),
            updated(running_var, unbiased))


def _norm_dtypes(x, *others) -> bool:
    """Whether a training norm's decomposition takes these: x float32 or float64, or half (then
    computed in float32), and every other tensor given of x's dtype or of that compute dtype."""
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return False
    return all(t is None or t.dtype in (x.dtype, _compute_dtype(x)) for t in others)


def _widened(t, dtype):
    """`t` converted to `dtype` (None and a tensor of that dtype as they are): a conversion
    fusion folds into the load or store of the kernel that reads or writes it."""
    return t if t is None or t.dtype == dtype else aten._to_copy.default(t, dtype=dtype)


@register(aten.native_batch_norm_backward.default)
def batch_norm_backward(dy, x, weight, running_mean, running_var, mean, rstd, train, eps,
                        output_mask):
    """Batch norm's backward in training, torch's formula written in the reduction's own rows:

        sum_dy = sum(dy, dims, keepdim)                 dot = sum(dy * (x - mean), dims, keepdim)
        dx     = (dy - (x - mean) * dot / n * rstd**2 - sum_dy / n) * rstd * weight
        dweight = dot * rstd                            dbias = sum_dy

    torch's decomposition sums to (C,) and computes the per-channel scales there, then reshapes
    them to (1, C, 1, ...) to broadcast over dx: each reshape of a computed (C,) value ends a
    kernel (three kernels a layer: the sums, the scales, dx). Here the sums keep their dims and
    the per-channel math stays in that shape (the (C,) weight and statistics are views that fold
    into loads), so the sums, the scales and dx (with what produced dy: a ReLU's backward, a
    residual's sum) are one reduction kernel; only dweight and dbias are viewed as (C,) at the
    end. Training mode only (the eval-mode backward is pointwise already); half inputs are
    computed in float32, as eager computes them, with dx rounded to x's dtype and dweight and
    dbias to the weight's."""
    if not train or mean is None or rstd is None \
            or not _norm_dtypes(x, dy, weight, mean, rstd) or dy.dtype != x.dtype:
        return NotImplemented
    dtype = _compute_dtype(x)
    grads = _norm_backward_wide(*(_widened(t, dtype) for t in (dy, x, weight, mean, rstd)),
                                output_mask)
    out_dtypes = (x.dtype, *(2 * [x.dtype if weight is None else weight.dtype]))
    return tuple(None if g is None else _widened(g, d) for g, d in zip(grads, out_dtypes))


def _norm_backward_wide(dy, x, weight, mean, rstd, output_mask):
    """`batch_norm_backward`'s formula on tensors of one dtype."""
    dims = [0] + list(range(2, x.dim()))
    shape, channels = [1, x.shape[1]] + [1] * (x.dim() - 2), [x.shape[1]]
    norm = 1.0 / (x.numel() // x.shape[1])
    mean, rstd = aten.view.default(mean, shape), aten.view.default(rstd, shape)
    centered = aten.sub.Tensor(x, mean)
    sum_dy = aten.sum.dim_IntList(dy, dims, True)
    dot = aten.sum.dim_IntList(aten.mul.Tensor(dy, centered), dims, True)
    proj_scale = aten.mul.Tensor(aten.mul.Tensor(dot, norm), aten.mul.Tensor(rstd, rstd))
    grad_scale = rstd if weight is None else aten.mul.Tensor(
        rstd, aten.view.default(weight, shape))
    dx = aten.mul.Tensor(aten.sub.Tensor(
        aten.sub.Tensor(dy, aten.mul.Tensor(centered, proj_scale)),
        aten.mul.Tensor(sum_dy, norm)), grad_scale)
    dweight = aten.view.default(aten.mul.Tensor(dot, rstd), channels) if output_mask[1] else None
    dbias = aten.view.default(sum_dy, channels) if output_mask[2] else None
    return dx, dweight, dbias


# Note (attention stays eager's): torch's core table decomposes CPU flash attention
# (`_scaled_dot_product_flash_attention_for_cpu`, what F.scaled_dot_product_attention runs on the
# CPU) into math attention: two batched matmuls around a softmax that fusion can see. On the CPU
# that is 1.5-3x slower than eager's own kernel, which never writes the attention matrix (2 x 12
# heads x 256 x 64, one thread: 43 ms eager vs 69 ms decomposed, causal 39 vs 103). The op runs
# as an extern instead: the same SDPA variant eager uses, with its real logsumexp output, which
# its backward (`..._for_cpu_backward`, also an extern) reads in training.
#
# Note (index_add stays eager's): torch's index_add decomposition is an index_put with
# accumulate=True, and index_put takes a negative index as counted from the end, where eager's
# index_add raises "index out of range" for it: `x.index_add(0, tensor([0, -1]), s)` added
# into the last row instead of raising. As an extern it checks its indices as eager does.
# (index_copy has the same flaw, left: /work/notes/ask_probe_num.md.)
#
# Note (multilabel margin loss stays eager's): torch's decomposition of
# `multilabel_margin_loss_forward` disagrees with eager's kernel once a target row holds a -1
# (the end of its labels): 3.11 where eager says 1.33 for a (2, 4) input.
KEEP_AS_EXTERN = [aten._scaled_dot_product_flash_attention_for_cpu.default,
                  aten.index_add.default, aten.index_add_.default,
                  aten.multilabel_margin_loss_forward.default]


@register(aten.mv.default)
def mv_of_one_dtype(matrix, vector):
    """torch's mv decomposition, `(matrix * vector).sum(1)`, promotes mixed dtypes where eager's
    kernel refuses them: checked first, with eager's message (fusec/capture/tracing.py, SAME_DTYPE)."""
    torch._check(matrix.dtype == vector.dtype, lambda: "addmv input tensors must have the same "
                 f"dtype, but got {matrix.dtype} and {vector.dtype}")
    return torch._decomp.decompositions.mv(matrix, vector)


def table() -> dict:
    decomps = dict(get_decompositions(FROM_TORCH))
    for op, ours in OURS.items():
        theirs = decomps.get(op)
        decomps[op] = ours if theirs is None else _either(ours, theirs)
    return decomps


def keep_as_extern(table: dict) -> dict:
    """`table` without the ops that must run as eager runs them (see the note above)."""
    return {op: fn for op, fn in table.items() if op not in KEEP_AS_EXTERN}


def _either(ours, theirs):
    """Ours where it applies (it returns NotImplemented where it does not), else torch's."""
    def decomp(*args, **kwargs):
        out = ours(*args, **kwargs)
        return theirs(*args, **kwargs) if out is NotImplemented else out
    return decomp
