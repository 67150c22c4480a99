"""Recurrent layers (nn.RNN, nn.LSTM, nn.GRU) as one extern step each.

`nn.LSTM.forward` ends in one call, `torch._VF.lstm(input, hx, weights, ...)`, which eager runs as
one fused library kernel (cuDNN on a GPU, oneDNN on a CPU). Traced as it is, that call becomes
torch's decomposition instead: a Python loop over layers, directions and *time steps*, so a
6-layer LSTM over 512 steps is 6144 unrolled cells, tens of thousands of graph nodes, and a
program far slower than the one library call it replaced.

So while fusec traces, a TorchFunctionMode catches the four `_VF` calls and records each as one
op of fusec's own, `fusec::lstm` (`fusec::gru`, `fusec::rnn_tanh`, `fusec::rnn_relu`):

    before (decomposed)                         after
    mm, add, sigmoid, tanh, mul ... x 6144      lstm = fusec.lstm(x, [h0, c0], [w_ih_l0, ...], ...)
                                                output, h_n, c_n = lstm[0], lstm[1], lstm[2]

The op's real implementation is the `_VF` call itself, so the extern step runs exactly what eager
runs; its fake implementation only states the output shapes. The weights stay lifted graph inputs
like any parameter.

Two limits keep this exact:
- Training (an input or weight that needs grad) keeps torch's decomposition: AOT Autograd
  differentiates that, where our op has no derivative.
- `flatten_parameters` (what `_update_flat_weights` calls when the weights were swapped, as
  functional_call swaps them) asks cuDNN to move every weight into one buffer, in place, with
  storage tricks a fake tensor cannot follow. While tracing it does nothing: it only picks a
  memory layout, never a value, and the extern call takes the weights wherever they are.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


def _output_shapes(input: Tensor, hidden: Tensor, bidirectional: bool, batch_first: bool):
    """Output shape of a recurrent layer stack: (seq, batch, directions * hidden) as `input` is
    laid out (batch first or not); `hidden` is h0, whose last dim is the output's feature size."""
    features = (2 if bidirectional else 1) * hidden.shape[-1]
    return (*input.shape[:-1], features)


@torch.library.custom_op("fusec::lstm", mutates_args=())
def lstm(input: Tensor, hx: Sequence[Tensor], params: Sequence[Tensor], has_biases: bool,
         num_layers: int, dropout: float, train: bool, bidirectional: bool,
         batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`torch._VF.lstm` (aten.lstm.input), eagerly: (output, h_n, c_n)."""
    out, h, c = torch._VF.lstm(input, list(hx), list(params), has_biases, num_layers, dropout,
                               train, bidirectional, batch_first)
    return out, h, c


@lstm.register_fake
def _(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    shape = _output_shapes(input, hx[0], bidirectional, batch_first)
    return input.new_empty(shape), hx[0].new_empty(hx[0].shape), hx[1].new_empty(hx[1].shape)


def _one_state_rnn(name: str, vf):
    """fusec::gru, fusec::rnn_tanh, fusec::rnn_relu: one hidden state, (output, h_n)."""
    @torch.library.custom_op(f"fusec::{name}", mutates_args=())
    def op(input: Tensor, hx: Tensor, params: Sequence[Tensor], has_biases: bool,
           num_layers: int, dropout: float, train: bool, bidirectional: bool,
           batch_first: bool) -> tuple[Tensor, Tensor]:
        out, h = vf(input, hx, list(params), has_biases, num_layers, dropout, train,
                    bidirectional, batch_first)
        return out, h

    @op.register_fake
    def _(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        shape = _output_shapes(input, hx, bidirectional, batch_first)
        return input.new_empty(shape), hx.new_empty(hx.shape)
    op.__doc__ = f"`torch._VF.{name}` ({name}.input), eagerly: (output, h_n)."
    return op


gru = _one_state_rnn("gru", torch._VF.gru)
rnn_tanh = _one_state_rnn("rnn_tanh", torch._VF.rnn_tanh)
rnn_relu = _one_state_rnn("rnn_relu", torch._VF.rnn_relu)

# torch._VF.lstm is torch._C._VariableFunctions.lstm, the function a TorchFunctionMode is shown
_EXTERNS = {torch._C._VariableFunctions.lstm: lstm, torch._C._VariableFunctions.gru: gru,
            torch._C._VariableFunctions.rnn_tanh: rnn_tanh,
            torch._C._VariableFunctions.rnn_relu: rnn_relu}


def _needs_grad(args) -> bool:
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
               if isinstance(t, Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class RecurrentAsExtern(TorchFunctionMode):
    """Active while fusec traces: see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._cudnn_rnn_flatten_weight:
            return None  # a layout for cuDNN, chosen in place: nothing to trace
        op = _EXTERNS.get(func)
        # the `.input` overload (padded sequences) has `has_biases` 4th; `.data`
        # (PackedSequence) has the weights there, and keeps torch's decomposition
        if op is not None and not kwargs and len(args) == 9 and isinstance(args[3], bool) \
                and not _needs_grad(args):
            return op(*args)
        return func(*args, **kwargs)
