"""Kernel IR: the fully decided description of one fused kernel, which templates only print.

Why this file is long: it is the one kernel IR, the dataclasses every lowering builds and every
backend reads, with their printed form and the canonical form the cache keys on; split, a reader
would chase one kernel's description across files.

A pointwise kernel walks a flat index over its iteration space (the shape of its outputs). For each
position it loads its inputs, computes a few SSA statements and stores its outputs:

    PointwiseKernel fused_sin_mul_0 over (4096, 4096), looped as (16777216,)
      load  v0_x = x[offset=0, strides=(1,)]  f32
      v1_sin = sin(v0_x)  f32
      v2_mul = mul(v1_sin, 2.0)  f32
      store mul[offset=0, strides=(1,)] = v2_mul  f32

Index expressions already fold in every view (transpose, slice, expand ...) and broadcast: an input
is read through `offset + sum(i_d * strides[d])` where `i_d` is the coordinate along loop dim
`d`. A broadcast dim has stride 0. The loop visits dims in the memory order of the first output,
and dims that are contiguous for every tensor are merged, so a plain elementwise kernel has one
dim and reads `x_ptr + offsets`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Union

import torch

from fusec.symbolic import hashable
from fusec.loop_plan import (Keep, LoopPlan, OnlineSoftmax, OnlineVariance,  # noqa: F401 (part of the IR)
                              Phase)

_SHORT = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64", torch.bool: "b8",
}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class TensorMeta:
    """What fusec knows about a tensor value in the graph (node.meta["fusec"])."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: str

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, tuple(t.stride()), str(t.device))

    def __str__(self) -> str:
        return f"{short_dtype(self.dtype)}[{', '.join(map(str, self.shape))}]"

    def __hash__(self) -> int:  # (a SymInt is no dict key: its sympy expression is, fusec/symbolic.py)
        return hash((hashable(self.shape), self.dtype, hashable(self.stride), self.device))


@dataclass(frozen=True)
class ValueMeta:
    """What fusec knows about a value in the graph that is not a tensor: an int, a SymInt or None
    among the outputs of a multi-output op (flash attention's `max_seqlen_q`, an unused seed). It
    lives in Python between steps, never in a buffer; `kind` names its type."""

    kind: str

    def __str__(self) -> str:
        return self.kind


def meta_of(val):
    """What fusec records on a node (`node.meta["fusec"]`) for its fake value `val`: a TensorMeta,
    a tuple of them for several outputs, or a ValueMeta for anything that is not a tensor."""
    if isinstance(val, torch.Tensor):
        return TensorMeta.of(val)
    if isinstance(val, (tuple, list)):
        return tuple(meta_of(v) for v in val)
    return ValueMeta(type(val).__name__)


@dataclass(frozen=True)
class Layout:
    """Where a value lives: `shape`/`stride`/`offset` (in elements) inside its root buffer.

    A root buffer is a program input, a constant, or a buffer written by a kernel or extern call.
    Views never own memory: `x.t()[1:]` is the root `x` seen through another Layout.
    """

    root: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int = 0

    def __hash__(self) -> int:
        return hash((self.root, hashable(self.shape), hashable(self.stride), hashable(self.offset)))


@dataclass(frozen=True)
class Index:
    """Element offset of a tensor at iteration position (i_0, ..., i_k): offset + sum(i_d * s_d)."""

    offset: int
    strides: tuple[int, ...]

    def __hash__(self) -> int:
        return hash((hashable(self.offset), hashable(self.strides)))

    def is_flat(self, shape: tuple[int, ...]) -> bool:
        """True when the index is simply the flat position (contiguous over the whole space)."""
        return self.offset == 0 and self.strides == contiguous_strides(shape)


@dataclass(frozen=True)
class Param:
    """A pointer argument of a kernel: a root buffer it reads or a buffer it writes."""

    name: str
    dtype: torch.dtype
    is_output: bool


@dataclass(frozen=True)
class Var:
    name: str
    dtype: torch.dtype  # the dtype the value has inside the kernel (half precision lives in f32)


@dataclass(frozen=True)
class Const:
    value: Union[bool, int, float]
    dtype: torch.dtype


Operand = Union[Var, Const]


@dataclass(frozen=True)
class Load:
    """`var = param[index]`. A piece of a concatenation (`torch.cat`) is read only where the
    output position along the cat's dim falls inside the piece: `valid` = (loop dim, lo, hi)
    says so, and elsewhere `var` takes the value `other` (the next piece's load, or 0 for the
    last one), so the first piece's var holds the whole concatenation."""

    var: Var
    param: str
    dtype: torch.dtype  # storage dtype in memory
    index: Index
    valid: tuple[int, int, int] | None = None  # (loop dim, lo, hi): read only where lo <= i < hi
    other: Var | None = None  # the value where it does not read (None: zero)
    # a gathered read (fusec.ops.gathered_read, `scales[g_idx]`): (position var, stride, size).
    # The address gets row * stride added, row being the position var's value (negative:
    # counted from the end, as eager does), kept inside [0, size): a value out of range reads
    # some row of the buffer, never past it, and the program's check (passes/check_gathers.py)
    # raises the error eager would.
    gather: tuple[str, int, int] | None = None


@dataclass(frozen=True)
class Stmt:
    """`var = op(operands)`, computed in `compute_dtype`, kept as `var.dtype`.

    operand_dtypes: the dtype each operand is converted to before the op (usually compute_dtype).
    result_dtype: the dtype the op's expression produces (bool for comparisons).
    round_to: a half-precision result is rounded through its dtype (then kept in float32), as
        eager rounds after every op: (x * 2).half() overflows to inf exactly where eager's does.
    """

    var: Var
    op: str
    operands: tuple[Operand, ...]
    operand_dtypes: tuple[torch.dtype, ...]
    result_dtype: torch.dtype
    round_to: torch.dtype | None = None
    origin: str = ""  # the ATen node this statement came from, for comments


@dataclass(frozen=True)
class Store:
    param: str
    var: Var
    dtype: torch.dtype
    index: Index
    # an indexed write (passes/grouping.py, `indexed_write`): (position var, stride, size). The
    # address gets position * stride added, a negative position counting from the end as in
    # eager; a position outside [0, size) writes nothing.
    scatter: tuple[str, int, int] | None = None


@dataclass
class PointwiseKernel:
    name: str
    shape: tuple[int, ...]  # the coalesced iteration space actually looped over
    source_shape: tuple[int, ...]  # the iteration space as the graph sees it
    params: list[Param]
    loads: list[Load]
    stmts: list[Stmt]
    stores: list[Store]
    ops: list[str] = field(default_factory=list)  # ATen ops fused, in order

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def __str__(self) -> str:
        lines = [f"PointwiseKernel {self.name} over {self.source_shape}, looped as {self.shape}"]
        lines += [f"  load  {l.var.name} = {l.param}[{_fmt_index(l.index)}]  {short_dtype(l.dtype)}"
                  + _fmt_valid(l) for l in self.loads]
        for s in self.stmts:
            args = ", ".join(o.name if isinstance(o, Var) else repr(o.value) for o in s.operands)
            lines.append(f"  {s.var.name} = {s.op}({args})  {short_dtype(s.var.dtype)}")
        lines += [f"  store {s.param}[{_fmt_index(s.index)}] = {s.var.name}  {short_dtype(s.dtype)}"
                  for s in self.stores]
        return "\n".join(lines)


def _fmt_valid(load: Load) -> str:
    if load.gather is not None:
        pos, stride, size = load.gather
        return f"  + row({pos} of {size}) * {stride}"
    if load.valid is None:
        return ""
    dim, lo, hi = load.valid
    other = load.other.name if load.other is not None else "0"
    return f"  where {lo} <= i{dim} < {hi}, else {other}"


def _fmt_index(index: Index) -> str:
    return f"offset={index.offset}, strides={index.strides}"


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Reduce:
    """`var = reduce(operand)` over the reduced dims, accumulating in `acc_dtype`.

    phase: reductions whose operand depends on no other reduction run in phase 0; one that needs
    phase-0 results (softmax's sum needs the max) runs in phase 1, and so on. A looped kernel
    makes one pass over the row per phase; a persistent kernel keeps the row in registers.
    """

    var: Var
    op: str
    operand: Var
    acc_dtype: torch.dtype
    phase: int
    origin: str = ""
    round_to: torch.dtype | None = None  # a half-precision result is rounded, as eager's is


@dataclass
class ReductionKernel:
    """Reduce over (rows, k): every load/store index has len(row_shape) + len(k_shape) strides.

    `varying` names the values that change along k (element values); the rest are row values.
    `level[v]` is the phase after which a value can be computed (0: before any reduction).
    `plan` says which loop computes what (fusec/loop_plan.py): decided in lowering, only spelled
    by the backends.
    """

    name: str
    source_shape: tuple[int, ...]  # the shape being reduced
    reduce_dims: tuple[int, ...]
    row_shape: tuple[int, ...]  # coalesced dims of the rows
    k_shape: tuple[int, ...]  # coalesced reduced dims
    params: list[Param]
    loads: list[Load]
    body: list  # Stmt and Reduce, in dependency order
    stores: list[Store]
    varying: set[str] = field(default_factory=set)
    level: dict = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)
    online: list[OnlineSoftmax] = field(default_factory=list)  # sums a pass can share with a max
    # a matmul computed as a sum over K (node meta "fusec_matmul"): {"m", "n", "k", "dtype"};
    # a kernel family may render it with a block of output columns per program, all M rows
    matmul: dict | None = None
    plan: LoopPlan | None = None  # set by lowering (codegen/lower_reduction.py, plan_loops)
    variances: list[OnlineVariance] = field(default_factory=list)  # sums of squared deviations
    # a pass can accumulate before their shift is known (fusec/loop_plan.py, OnlineVariance)

    @property
    def rows(self) -> int:
        return prod(self.row_shape)

    @property
    def k(self) -> int:
        return prod(self.k_shape)

    @property
    def matmul_rows(self) -> tuple[int, tuple[int, ...]] | None:
        """A matmul's rows as (M, the dims of N): rows (N,) are (1, (N,)), rows (M, N) are
        (M, (N,)). A weight computed with N cut in parts (eight 4-bit columns packed in each
        int32 along N, say) has rows (N/8, 8): (1, (N/8, 8)). None when this is no matmul, or
        its rows are something else."""
        if self.matmul is None or not self.row_shape:
            return None
        n = self.matmul["n"]
        for lead in (0, 1):
            cols = self.row_shape[lead:]
            if cols and prod(cols) == n and prod(self.row_shape[:lead]) == self.matmul["m"]:
                return (self.row_shape[0] if lead else 1), tuple(cols)
        return None

    @property
    def split_columns(self) -> bool:
        """Whether a matmul's output columns are computed in several dims (see matmul_rows)."""
        rows = self.matmul_rows
        return rows is not None and len(rows[1]) > 1

    @property
    def numel(self) -> int:
        return self.rows * self.k

    def values_needed(self, targets, given=(), only_varying: bool = True) -> list[str]:
        """The loads and statements that computing `targets` needs, in program order: what a
        loop over k must (re)compute. The walk goes back through operands and stops at
        reductions, at `given` values (already at hand), and, with only_varying, at row values
        (those are computed once per row, outside the loops)."""
        producers = {l.var.name: l for l in self.loads}
        producers.update((item.var.name, item) for item in self.body)
        need: set[str] = set()
        stack = list(targets)
        while stack:
            name = stack.pop()
            if name in need or (only_varying and name not in self.varying):
                continue
            need.add(name)
            item = producers.get(name)
            if isinstance(item, Stmt) and name not in given:
                stack += [o.name for o in item.operands if isinstance(o, Var)]
            elif isinstance(item, Load) and item.other is not None:  # a cat's next piece
                stack.append(item.other.name)
            if isinstance(item, Load) and item.gather is not None:  # the row's index value
                stack.append(item.gather[0])
        return [n for n in producers if n in need]

    @property
    def phases(self) -> int:
        return 1 + max((s.phase for s in self.body if isinstance(s, Reduce)), default=-1)

    def __str__(self) -> str:
        lines = [f"ReductionKernel {self.name}: {self.source_shape} over dims {self.reduce_dims}, "
                 f"looped as rows {self.row_shape} x k {self.k_shape}"]
        lines += [f"  load  {l.var.name} = {l.param}[{_fmt_index(l.index)}]  {short_dtype(l.dtype)}"
                  for l in self.loads]
        for s in self.body:
            if isinstance(s, Reduce):
                lines.append(f"  {s.var.name} = {s.op}({s.operand.name}) over k  "
                             f"[phase {s.phase}, acc {short_dtype(s.acc_dtype)}]")
            else:
                args = ", ".join(o.name if isinstance(o, Var) else repr(o.value) for o in s.operands)
                where = "elem" if s.var.name in self.varying else "row"
                lines.append(f"  {s.var.name} = {s.op}({args})  {short_dtype(s.var.dtype)} [{where}]")
        lines += [f"  store {s.param}[{_fmt_index(s.index)}] = {s.var.name}  {short_dtype(s.dtype)}"
                  for s in self.stores]
        if self.plan is not None:
            made = {item.var.name: item for item in self.body}
            lines += ["  " + line for line in self.plan.describe(made, self.stores)]
        return "\n".join(lines)


# ---- one build per distinct kernel ---------------------------------------------------------------

def family(name: str) -> str:
    """A kernel's name without its position in the program: `fused_add_gelu_13` -> `fused_add_gelu`.
    Every layer of a model has its own `fused_add_gelu_<k>`; all of them are one family."""
    stem, _, position = name.rpartition("_")
    return stem if stem and position.isdigit() else name


def canonical(kernel):
    """The same kernel with every name that comes from the graph replaced by a generic one.

    Note: one build per distinct kernel. A model repeats its layers, and each layer's kernels
    are the same code with different pointers: `fused_add_gelu_13` in layer 0 and
    `fused_add_gelu_27` in layer 1 differ only in names (the kernel's position, the graph
    values their parameters and variables are named after, the ATen nodes their comments cite).
    `canonical` renames consistently and in order of appearance, so two kernels get the same
    canonical IR exactly when they compute the same thing from the same shapes, strides and
    dtypes:

        kernel       fused_add_gelu_13          ->  fused_add_gelu
        parameters   mm_5, arg7_1, gelu_2       ->  in0, in1, out2
        variables    v0_mm_5, v2_add_9          ->  v0_in0, v2_add
        comments     add_9 = aten.add.Tensor(mm_5, arg7_1)  ->  aten.add.Tensor

    The renaming is one-to-one (every name gets its own new name) and keeps the order of
    parameters, so a binary built from one kernel's canonical source is the binary of every
    kernel with the same canonical source, called with its own buffers in the same order. The
    api builds each distinct canonical source once (fusec/api.py) and the cache stores it once;
    `cf.kernels` keep their descriptive names and sources."""
    params = {p.name: f"{'out' if p.is_output else 'in'}{i}" for i, p in enumerate(kernel.params)}
    names: dict[str, str] = {}  # variables
    body = kernel.stmts if isinstance(kernel, PointwiseKernel) else kernel.body
    for load in kernel.loads:
        names.setdefault(load.var.name, f"v{len(names)}_{params[load.param]}")
    for item in body:
        names.setdefault(item.var.name, f"v{len(names)}_{item.op}")

    def var(v: Var) -> Var:
        return Var(names[v.name], v.dtype)

    def operand(o):
        return var(o) if isinstance(o, Var) else o

    def origin(text: str) -> str:  # "add_9 = aten.add.Tensor(mm_5, 1.0)" -> "aten.add.Tensor"
        return text.partition(" = ")[2].partition("(")[0]

    def item(s):
        if isinstance(s, Reduce):
            return replace(s, var=var(s.var), operand=var(s.operand), origin=origin(s.origin))
        return replace(s, var=var(s.var), operands=tuple(operand(o) for o in s.operands),
                       origin=origin(s.origin))

    common = dict(name=family(kernel.name),
                  params=[replace(p, name=params[p.name]) for p in kernel.params],
                  loads=[replace(l, var=var(l.var), param=params[l.param],
                                 other=var(l.other) if l.other is not None else None,
                                 gather=l.gather and (names[l.gather[0]], *l.gather[1:]))
                         for l in kernel.loads],
                  stores=[replace(s, var=var(s.var), param=params[s.param],
                                  scatter=s.scatter and (names[s.scatter[0]], *s.scatter[1:]))
                          for s in kernel.stores])
    if isinstance(kernel, PointwiseKernel):
        return replace(kernel, stmts=[item(s) for s in body], **common)
    return replace(kernel, body=[item(s) for s in body],
                   varying={names[v] for v in kernel.varying},
                   level={names[k]: v for k, v in kernel.level.items()},
                   online=[o.renamed(names) for o in kernel.online],
                   variances=[o.renamed(names) for o in kernel.variances],
                   plan=kernel.plan and kernel.plan.renamed(names), **common)
