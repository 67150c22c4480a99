"""Composite torch functions that fusec traces its own way, above the dispatcher.

A decomposition table (capture/decompositions.py) only sees ATen ops that reach the dispatcher.
A few torch functions are *composite*: they are Python or C++ code that calls other ops before
any table is consulted, and what they call can be the wrong shape for a compiler. Those are
intercepted here, while tracing, by a torch-function mode (`torch_level`), and computed from ops
that fusion handles well. Each entry of TORCH_LEVEL says why, and returns NotImplemented where
torch's own composite should run after all.
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch


# Note (InstanceNorm before autograd): `F.instance_norm` is a composite op: before any
# decomposition table is consulted, it views its (N, C, *spatial) input as (1, N * C, *spatial)
# and runs a training-mode batch norm on that. The view merges N with C, which a channels-last
# tensor cannot do: the layout pass had to copy every convolution output that an InstanceNorm
# reads back to NCHW (one more pass over the tensor, KernelBench-style 7_conv2d_instancenorm_*
# on an H200). So, while tracing, `torch.instance_norm` itself is intercepted at the torch-
# function level (`torch_level`) and computed per image and channel on the tensor as it is:
# the mean and biased variance over the spatial dims (two-pass, as capture/decompositions.py computes `var`), then
# (x - mean) * rsqrt(var + eps), then the affine. The same math eager does, without the view.
def instance_norm(x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                  cudnn_enabled=True):
    if not use_input_stats or running_mean is not None or running_var is not None \
            or x.dim() < 3 or x.dtype not in (torch.float32, torch.float64):
        return NotImplemented  # running statistics to use or update: torch's composite
    dims = list(range(2, x.dim()))
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    shape = [1, x.shape[1]] + [1] * len(dims)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out


def functional_instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                             use_input_stats=True, momentum=0.1, eps=1e-5):
    """`F.instance_norm`'s argument order (a torch-function mode sees it before
    `torch.instance_norm`)."""
    return instance_norm(input, weight, bias, running_mean, running_var, use_input_stats,
                         momentum, eps)


# Note (BatchNorm in inference, before its composite chain): `F.batch_norm` reaches the
# decomposition table through `torch.batch_norm`, `aten.batch_norm`, `_batch_norm_impl_index`
# and `native_batch_norm` (or cuDNN's), every level dispatched through tracing, fake tensors and
# functionalization; the decomposition then emits its own views and pointwise ops, and on a GPU
# the statistics eager returns, which nothing reads. Capture pays per traced op: a warm start of
# resnet50 (53 batch norms) spent more than half of its capture there (on an H200). In
# inference (running statistics, no update) the call is intercepted at the top and written
# straight as capture/decompositions.py's pointwise formula: the same ops the decomposition
# would leave after dead-code elimination, traced once.
def batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps,
               cudnn_enabled=True):
    if training or running_mean is None or running_var is None or x.dim() < 2 \
            or not x.dtype.is_floating_point:
        return NotImplemented  # batch statistics, or running ones to update: torch's path
    from fusec.capture.decompositions import batch_norm_running_statistics
    return batch_norm_running_statistics(x, weight, bias, running_mean, running_var, eps)


def functional_batch_norm(input, running_mean, running_var, weight=None, bias=None,
                          training=False, momentum=0.1, eps=1e-5):
    """`F.batch_norm`'s argument order."""
    return batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


# Note (composites that read sizes as numbers). For a program over a shape family (sizes as
# symbols, fusec/dynamic.py), a C++ composite that reads its input's sizes as plain integers
# (`sizes()`, not `sym_sizes()`) turns every symbol it reads into the number it was traced with
# (a guard `Eq(s0, 5)`): the whole program becomes one size again. `F.linear` of a 3-D input with
# a bias does (it flattens the input for addmm), and so does `F.pad`. For symbolic inputs they
# are written here with the same ops, over symbolic sizes; a static program traces as before.
def linear(input, weight, bias=None):
    if bias is None and input.is_cuda and _symbolic(input):
        return matmul(input, weight.t())
    if bias is None or input.dim() <= 2 or not _symbolic(input):
        return NotImplemented
    if input.is_contiguous():  # what the composite does: one addmm over the flattened rows
        rows = input.reshape(-1, input.shape[-1])
        return torch.addmm(bias, rows, weight.t()).view(*input.shape[:-1], weight.shape[0])
    return torch.matmul(input, weight.t()) + bias


SDPA_READS_SIZES = ("cuda",)  # devices whose SDPA reads sizes as numbers while tracing


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """On CUDA, SDPA picks its kernel (flash, memory-efficient, cuDNN) by reading the sizes as
    numbers, which pins a shape family's symbols (or fails under fake tensors). For symbolic
    inputs on CUDA it is traced as one call of `fusec::attention` (below), whose fake answer
    knows only the output's shape: at run time it is torch's own SDPA, which picks its kernel
    for each call's sizes, as a static program's library call does."""
    if query.device.type not in SDPA_READS_SIZES or not _symbolic(query) or dropout_p:
        return NotImplemented
    if query.dim() != 4 or (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value, attn_mask))):
        # (fusec::attention has no backward: a training graph gets the math formulation, which
        # autograd differentiates and fusion fuses)
        return attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)


@torch.library.custom_op("fusec::attention", mutates_args=())
def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
         enable_gqa: bool) -> torch.Tensor:
    """F.scaled_dot_product_attention of (B, H, L, E) inputs, its output laid out as the fused
    kernels (flash, memory-efficient) write it: (B, L, H, E) in memory, seen as (B, H, L, E). A
    kernel that answers in another layout (the math one) is copied into that one, so the layout
    is the one the fake answer promised whichever kernel torch picks for these sizes. A mask
    broadcast along the keys is made dense there first (`dense_along_keys`)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=dense_along_keys(attn_mask, key.shape[-2]),
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    want = _attention_out(query, value)
    if out.stride() != want.stride():
        want.copy_(out)
        return want
    return out


@sdpa.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return _attention_out(query, value)


def dense_along_keys(mask, keys: int):
    """`mask` with its last dim (the keys) `keys` long and contiguous, the rest as it was.

    SDPA's fused kernels (flash, memory-efficient, cuDNN) read a mask densely along the keys;
    given one broadcast there (a last dim of 1, or stride 0), SDPA runs its math kernel instead:
    two matmuls in float32 around a softmax (capture/tracing.py, Note: attention masks with
    stride 0, says the same of a static program). transformers' BERT in a shape family handed
    `fusec::attention` a (1, 1, 512, 1) mask, and the model ran 1.24x its static program's time
    on an H100; the dense copy is (1, 1, 512, 512), 256 KiB of booleans."""
    if mask is None or mask.dim() == 0 or keys <= 1 \
            or (mask.shape[-1] == keys and mask.stride(-1) == 1):
        return mask
    return mask.expand(*mask.shape[:-1], keys).contiguous()


def _attention_out(query, value):
    """An empty (B, H, L, E) output stored as (B, L, H, E)."""
    b, h, length = query.shape[0], query.shape[1], query.shape[2]
    return query.new_empty((b, length, h, value.shape[-1])).transpose(1, 2)


def attention(q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q @ k^T * scale + mask) @ v, as F.scaled_dot_product_attention defines it, from
    ops that keep sizes symbolic (torch's own math kernel reads them as numbers too)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped heads: each key head serves several
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask
    return matmul(torch.softmax(scores, dim=-1), v)


def matmul(a, b):
    """On CUDA, `matmul`'s composite reads sizes as numbers too (it pinned every transformer's
    projections and rotary products): for symbolic inputs it is written as the mm or bmm it
    folds to, over symbolic sizes. Other shapes (vectors) keep torch's own."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not a.is_cuda \
            or not (_symbolic(a) or _symbolic(b)) or a.dim() < 2 or b.dim() < 2:
        return NotImplemented
    if b.dim() == 2:  # (..., m, k) @ (k, n): the rows of every batch in one mm
        rows = a.reshape(-1, a.shape[-1])
        return torch.mm(rows, b).view(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return torch.bmm(a3, b3).view(*batch, a.shape[-2], b.shape[-1])


def _symbolic(t) -> bool:
    return any(isinstance(n, torch.SymInt) and not n.node.expr.is_number for n in t.shape)


TORCH_LEVEL = {torch.instance_norm: instance_norm,
               torch.nn.functional.instance_norm: functional_instance_norm,
               torch.batch_norm: batch_norm,
               torch.nn.functional.batch_norm: functional_batch_norm,
               torch.nn.functional.linear: linear, torch._C._nn.linear: linear,
               torch.nn.functional.scaled_dot_product_attention: scaled_dot_product_attention,
               torch.matmul: matmul, torch.Tensor.__matmul__: matmul, torch.Tensor.matmul: matmul}


class _TorchLevel(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        ours = TORCH_LEVEL.get(func)
        if ours is not None:
            out = ours(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def torch_level():
    """While tracing, the composite torch functions of TORCH_LEVEL are computed fusec's way
    (see the note on InstanceNorm above), and a slice ending at a size of a shape family has
    that size's length (`backed_slices`, below)."""
    with _TorchLevel(), backed_slices():
        yield


# Note (a slice that ends at a symbol). `positions[:t]`, with `t` a size of the family (a backed
# symbol s0) and `positions` 160 long, is `Min(s0, 160)` long. torch 2.11's fake slice did not
# know that: it could not tell whether s0 <= 160, so it made the length a new unbacked symbol
# u0, a size "from the data", and every later question about it (`u0 == 1`?) failed with
# GuardOnDataDependentSymNode, so the family could not compile and the prefill of
# benchmarks/decode.py compiled every prompt length on the GPU machine. torch 2.12 answers
# `Min(s0, 160)` itself (pytorch/pytorch#175819); `backed_slices` gives older versions the same
# answer while fusec traces, and changes nothing where torch already answers.
_SLICES = {"lock": threading.Lock(), "depth": 0, "torch_own": None}


@contextlib.contextmanager
def backed_slices():
    """Within: a slice whose start or end is a backed symbol has a symbolic length (`Min(s0,
    160)`), not a new unbacked one (see the note above). Re-entrant and thread-safe: torch's
    function is replaced while any capture is inside, and put back after the last. An older
    torch without that function is left as it is."""
    from torch._subclasses import fake_impls
    if not hasattr(fake_impls, "_compute_slice_index"):
        yield
        return
    with _SLICES["lock"]:
        if _SLICES["depth"] == 0:
            _SLICES["torch_own"] = fake_impls._compute_slice_index
            fake_impls._compute_slice_index = _slice_index_of(_SLICES["torch_own"])
        _SLICES["depth"] += 1
    try:
        yield
    finally:
        with _SLICES["lock"]:
            _SLICES["depth"] -= 1
            if _SLICES["depth"] == 0:
                fake_impls._compute_slice_index = _SLICES["torch_own"]


def _slice_index_of(torch_own):
    """torch's `_compute_slice_index(size, index)`, answering for a backed symbol where it gave
    None (None makes the slice's length unbacked): an index >= 0 clamps to the size, one < 0
    counts from the end and clamps to 0, as Python's slices do."""
    def compute_slice_index(size, index):
        out = torch_own(size, index)
        if out is None and isinstance(index, torch.SymInt) and index.node.has_hint():
            from torch.fx.experimental.symbolic_shapes import guard_or_false
            if guard_or_false(index >= 0):
                return torch.sym_min(index, size)
            if guard_or_false(index < 0):
                return torch.sym_max(index + size, 0)
        return out
    return compute_slice_index
