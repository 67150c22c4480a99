"""Reshapes inside a dequantization, moved out of the way: the weight computed in its finest shape.

Quantized checkpoints pack their weights in many ways, and the code that unpacks them reshapes
as it goes. GPTQ's packing, for instance, keeps eight 4-bit values along K in each int32, and
unpacking it in plain torch reads:

    w   = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 15     # (K/8, 8, N)
    w   = w.reshape(K / G, G, N)                                   # (groups, G, N): per-group scales
    w   = (w - zeros) * scales.unsqueeze(1)                        # (K/G, G, N)
    out = x @ w.reshape(K, N)

A kernel that computes `w - zeros` cannot read through the reshape before it: the shift's value
at (group, g, n) is the one at (8 * group + g // 8, g % 8, n), which is not where any stride
leads. So each reshape of a computed tensor becomes a stored intermediate, here two full copies
of the weight (int32, then bf16), and the GEMV reads the last one.

But a reshape only regroups the same elements, in the same row-major order. Write the
dimensions of every shape in the chain as cuts in that order (a dim ends where the stride of the
next one begins): (K/8, 8, N) cuts after N and 8N, (K/G, G, N) after N and G*N. If the cuts of all
shapes nest (each divides the next), there is one shape that refines them all, here
(K/G, G/8, 8, N), and every tensor of the chain is that shape with some dims merged. Element-wise
ops do not care how dims are grouped, so the whole chain can be computed in the fine shape, its
inputs *viewed* in it (splitting a dim is always a view, whatever the strides):

    w   = (qweight.view(K/G, G/8, 1, N) >> shifts.view(1, 1, 8, 1)) & 15    # (K/G, G/8, 8, N)
    w   = (w - zeros.view(K/G, 1, 1, N)) * scales.view(K/G, 1, 1, N)
    out = sum over (K/G, G/8, 8) of x.view(1, K/G, G/8, 8, 1) * w             # extensions/quant_gemv/small_matmul.py

and nothing is stored: the GEMV computes each weight in registers from the packed words.

For the weight of a small-M matmul (extensions/quant_gemv/small_matmul.py asks), `refined_dims` walks the chain
from the weight through element-wise ops and reshapes, collects the cuts and says how K and N are
split; `refine_weight` then cuts the weight's dims that way, all at once, and passes/unflatten.py
(`Unflattener.refine`) moves the cuts up through the ops and through each reshape of an
element-wise value to the inputs. An operand that broadcasts (fewer elements, as scales and zero
points) is viewed in the fine shape as it is, computed or not; a full-size tensor made by
anything else (a `cat`, a gather) is computed as before and viewed.

N may be cut too. AWQ packs eight 4-bit weights along N in each int32, so its unpacking reshapes
(K, N/8, 8) to (K, N), and with per-group scales the fine shape is (K/G, G, N/8, 8): the GEMV's
output columns are then two dims, (N/8, 8), and each column's word and shift are addressed by
its coordinates (extensions/quant_gemv/triton_gemv.py; `ReductionKernel.matmul_rows`). With the weight stored
(N, K) (an `F.linear`), N stays whole.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec import ops

from fusec.passes.grouping import val
from fusec.passes.schedule import fake_mode_of
from fusec.passes.unflatten import RESHAPES, Unflattener, pushable

def needs_refining(top: fx.Node) -> bool:
    """Whether the weight `top` is computed through a reshape of a computed tensor."""
    return isinstance(val(top), torch.Tensor) and _chain(top, val(top).numel())[1]


def refined_dims(top: fx.Node, n_first: bool):
    """(K's dims, N's dims) when the weight `top`, (N, K) if n_first else (K, N), is computed
    in the shape that refines every shape of its chain; None if the shapes do not nest, if no
    cut falls between K and N, or if an (N, K) weight would split N."""
    fine = _fine_shape(_chain(top, val(top).numel())[0])
    if fine is None:
        return None
    n, k = val(top).shape if n_first else val(top).shape[::-1]
    cut = next((i for i in range(len(fine) + 1) if math.prod(fine[:i]) == (n if n_first else k)), None)
    if cut is None:
        return None
    head, tail = tuple(fine[:cut]), tuple(fine[cut:])
    n_dims, k_dims = (head, tail) if n_first else (tail, head)
    if len(n_dims) != 1 and n_first:
        return None
    return k_dims, n_dims


def refine_weight(graph: fx.Graph, top: fx.Node, n_first: bool) -> fx.Node:
    """The weight `top` computed in the fine shape, (N, *k_dims) or (*k_dims, *n_dims)
    (refined_dims must have said yes): its dims cut, the cuts moved up through the element-wise
    ops and reshapes to the inputs (passes/unflatten.py), so that no reshape of a computed tensor
    is left. The old chain is left to dead-code elimination."""
    k_dims, n_dims = refined_dims(top, n_first)
    # the new nodes go right after `top`: what they read comes before it, what reads it after
    cut = Unflattener(graph, top.next, fake_mode_of(graph.owning_module))
    runs = [n_dims, k_dims] if n_first else [k_dims, n_dims]
    return cut.refine(top, runs)


def _reshape_of_computed(a: fx.Node) -> bool:
    return a.op == "call_function" and a.target in RESHAPES and not _leafish(a.args[0])


def _leafish(a) -> bool:
    """A graph input, or views of one: a kernel reads it where it lies."""
    while isinstance(a, fx.Node) and a.op == "call_function" and ops.classify(a.target) == ops.VIEW:
        a = a.args[0]
    return not isinstance(a, fx.Node) or a.op in ("placeholder", "get_attr")


def _cuts(shape) -> set[int]:
    """Where the dims of `shape` end, as element counts in row-major order."""
    out, p = set(), 1
    for s in reversed(list(shape)):
        p *= s
        out.add(p)
    return out - {1}


def _chain(top: fx.Node, size: int):
    """The cuts of every full-size shape met walking up from `top` through element-wise ops and
    reshapes, and whether some reshape of a computed tensor is among them."""
    seen, cuts, found, stack = set(), set(), False, [top]
    while stack:
        a = stack.pop()
        if a in seen or not isinstance(val(a), torch.Tensor) or val(a).numel() != size:
            continue
        seen.add(a)
        cuts |= _cuts(val(a).shape)
        if a.op != "call_function" or _leafish(a):
            continue
        if a.target in RESHAPES:
            found |= _reshape_of_computed(a)
            stack.append(a.args[0])
        elif pushable(a):
            stack += [t for t in a.args if isinstance(t, fx.Node)]
    return cuts, found


def _fine_shape(cuts: set[int]):
    """The shape whose dims end at every cut, if each cut divides the next; else None."""
    fine, last = [], 1
    for c in sorted(cuts):
        if c % last:
            return None
        fine.append(c // last)
        last = c
    return fine[::-1]
