"""constant_gathers: a gather whose index is known while compiling, moved onto the constants.

Some checkpoints pack eight 4-bit weights along N in each int32, in the interleaved order
0 2 4 6 1 3 5 7. Their plain-torch unpacking shifts every nibble out, then puts the columns back
in order with a gather by a table of positions that the program builds from `arange`:

    w     = (qweight[:, :, None] >> shifts).to(int8).view(K, N)     # shifts = [0, 4, ..., 28]
    order = arange(N).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].view(-1)
    w     = w[:, order] & 15

After passes/fold_constants.py, `order` is a constant. A gathered read of a computed value cannot
join the kernel that computes the value (passes/grouping.py, `gathered_from`), so `w` would be
unpacked into memory in full, then gathered into memory again: two weight-sized tensors, where a
fused matmul reads only the packed words. But this gather only reorders the eight nibbles of each
word, the same way in every word: `order` is `8 * block + [0, 4, 1, 5, 2, 6, 3, 7]`. Seen as
(K, N/8, 8), `w[:, order]` is `w.view(K, N/8, 8)[:, :, P]` with P = [0, 4, 1, 5, 2, 6, 3, 7], and a
gather along a dim commutes with element-wise ops: each operand that varies along that dim is
gathered, one that broadcasts over it stays. Here `qweight[:, :, None]` broadcasts, and `shifts`
is a constant, which is gathered now, while compiling:

    before                                         after
    w   = view(to(rshift(q3, shifts)), [K, N])     w = view(to(rshift(q3, shifts_p)), [K, N])
    w_o = index(w, [None, order])                  # shifts_p = shifts[P] = [0, 16, 4, 20, ...]

No gather is left, and the weight is an element-wise function of the packed words again: the
prologue of the matmul that reads it can unpack each word as it loads it.

The pass takes a gathered read (fusec.ops.gathered_read) whose index is a 1-D constant folded
by fold_constants (a tensor the program holds, the caller could change: those are not trusted)
with every value in range and as many values as the dim has rows. It looks for the smallest
block b such that the index reorders each block of b rows the same way; the whole dim is one
such block. It then pushes the gather up through element-wise ops to constants (gathered now)
and to operands that broadcast along the dim. Anything else on the way (a program input, a
reduction, an extern) keeps the gather as it is. Each gather is a `Decision` in
`record_of(gm).constant_gathers`.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fusec import ops
from fusec.graphmodule import looks_for
from fusec.record import Decision

from .fold_constants import known_value
from .grouping import constant_node, meta, record_decisions
from .layout import run_fake, set_meta
from .schedule import fake_mode_of
from .unflatten import RESHAPES, pushable

aten = torch.ops.aten


@looks_for(*ops.GATHER_TARGETS)
def constant_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for node in list(gm.graph.nodes):
        gather = ops.gathered_read(node)
        if gather is None:
            continue
        index = known_value(gm, gather.index)
        if index is None or index.dim() != 1:
            continue  # an index the program computes, or one the caller could change
        size = gather.size
        if index.numel() != size or not bool(((index >= gather.lowest) & (index < size)).all()):
            decisions.append(Decision(node.name, False, f"{gather.index.name} has other "
                                      f"than {size} values in [{gather.lowest}, {size}): kept"))
            continue
        index = index.long().cpu() % size  # (a table on the GPU: its pattern is read here)
        new, why = _rewrite(gm, node, gather, index)
        if new is None:
            decisions.append(Decision(node.name, False, why))
            continue
        node.replace_all_uses_with(new)
        decisions.append(Decision(node.name, True, why))
    return record_decisions(gm, "constant_gathers", decisions)


def _rewrite(gm, node, gather, index):
    """(the gathered value computed without the gather, why) or (None, why not)."""
    source, dim, size = gather.source, gather.dim, gather.size
    for b in [b for b in range(2, size + 1) if size % b == 0]:
        pattern = index.view(-1, b) - torch.arange(0, size, b)[:, None]
        if not bool((pattern == pattern[:1]).all()):
            continue
        perm = pattern[0]
        if b == size:
            at, dim_at = source, dim
        else:  # the source must be a reshape that merged (size / b, b) into the dim
            inner = source.args[0] if source.op == "call_function" and source.target in RESHAPES \
                else None
            shape = list(meta(source).shape)
            if inner is None or list(meta(inner).shape) != shape[:dim] + [size // b, b] + shape[dim + 1:]:
                continue
            at, dim_at = inner, dim + 1
        pusher = _Pusher(gm, node)
        if not pusher.can(at, dim_at, len(perm)):
            continue
        new = pusher.push(at, dim_at, perm)
        if at is not source:
            new = pusher.add(aten.view.default, (new, list(meta(source).shape)), like=source)
        what = "the whole dim" if b == size else f"each block of {b}"
        return new, (f"{gather.index.name} reorders {what} the same way: the gather moved onto "
                     f"the constants {', '.join(sorted(pusher.constants))} (gathered now); "
                     f"{source.name} is computed in order, nothing is gathered per call")
    return None, (f"{gather.index.name} is no reordering of blocks that reaches only constants "
                  "and broadcast operands: the gathered read stays")


class _Pusher:
    """Moves a gather along one dim, by a constant permutation, up through element-wise ops."""

    def __init__(self, gm: fx.GraphModule, before: fx.Node):
        self.gm, self.before = gm, before
        self.mode = fake_mode_of(gm)
        self.constants: set[str] = set()

    def can(self, value, dim: int, n: int) -> bool:
        """Whether `value`, gathered along `dim` by n positions, reaches only constants and
        operands that broadcast along the dim."""
        if known_value(self.gm, value) is not None:
            return True
        if not pushable(value):
            return False
        rank = len(meta(value).shape)
        for a in value.args:
            if isinstance(a, fx.Node):
                p = dim - (rank - len(meta(a).shape))
                if p >= 0 and meta(a).shape[p] != 1 and not self.can(a, p, n):
                    return False
        return True

    def push(self, value, dim: int, perm: torch.Tensor) -> fx.Node:
        known = known_value(self.gm, value)
        if known is not None:  # a constant: gathered now
            self.constants.add(value.name)
            picked = known.index_select(dim, perm.to(known.device)).contiguous()
            with self.gm.graph.inserting_before(self.before):
                new = constant_node(self.gm, f"_gathered_{value.name}", picked)
            set_meta(new, self.mode.from_tensor(picked), like=value)
            return new
        rank = len(meta(value).shape)
        args = []
        for a in value.args:
            if isinstance(a, fx.Node):
                p = dim - (rank - len(meta(a).shape))
                if p >= 0 and meta(a).shape[p] != 1:
                    a = self.push(a, p, perm)
            args.append(a)
        return self.add(value.target, tuple(args), dict(value.kwargs), like=value)

    def add(self, target, args, kwargs=None, like=None) -> fx.Node:
        with self.gm.graph.inserting_before(self.before):
            new = self.gm.graph.call_function(target, args, kwargs or {})
        val = run_fake(self.mode, new)
        if val is None:
            raise RuntimeError(f"fusec: {new.format_node()} does not run on its fake inputs")
        set_meta(new, val, like=like)
        return new
