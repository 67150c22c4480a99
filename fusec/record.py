"""Records: what each stage decided, as typed data that the next stage and every tool read.

A compiler's stages talk to each other. Here they do it through two records, never through
string keys or globals:

    PassRecord    what the passes decided about one graph: nodes DCE removed, values CSE merged,
                  the rewrites taken or declined, the layout plan, the fusion refusals, and
                  the schedule. It travels with the graph: `record_of(gm).schedule`.
    Compilation   what the driver made of one input signature: the captured graph, the graph
                  after the passes (and their PassRecord), the memory plan, the in-place plan,
                  the kernels, the program and the time each stage took. `CompiledGraph`
                  (fusec/driver.py) is a Compilation plus what running it needs.

    fusec.compile(f)(x) ── driver.compile_graph ──> CompiledGraph (a Compilation)
                                                     .passes.refusals   ← fuse_pointwise
                                                     .schedule          ← schedule
                                                     .memory, .inplace  ← planned once, after lowering
                                                     .kernels, .program ← codegen, runtime
    explain, profile, FUSEC_LOG, cf.source(), cf.schedule read these fields.

Passes stay `GraphModule -> GraphModule` functions (docs/architecture.md): a pass fills its field
of `record_of(gm)`. The record lives in `gm.meta` under one key, so it follows the graph through
every pass that keeps the graph's meta, and `fusec.graphmodule.copy_graph_module` gives a copy its
own record (the captured graph's stays as capture left it). Per-node facts (a value's Layout, a
group's description) stay on the nodes: `node.meta["fusec_layout"]` (read it with `layout_of`,
`owns_buffer`, `folded_view` below) and a group's `GroupInfo` (`group_info`).

This module imports nothing of fusec: every stage may import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch.fx as fx

# ---- the schedule (passes/schedule.py) ---------------------------------------------------------


@dataclass
class Step:
    """One launch of the program: a fused kernel or an eager ATen (extern) call, with the root
    buffers it reads and writes (a kernel that reads `x.t()` reads `x`) and their shapes."""

    kind: str  # "kernel" or "extern"
    name: str  # kernel name or ATen op
    node: str
    reads: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    shapes: dict = field(default_factory=dict)

    def __str__(self) -> str:
        def fmt(names):
            return ", ".join(f"{n} {self.shapes.get(n, '')}".strip() for n in names) or "-"
        return f"{self.kind:<6} {self.name:<32} reads {fmt(self.reads)}  writes {fmt(self.writes)}"


def format_schedule(steps: list[Step]) -> str:
    """The steps numbered from 1, one a line."""
    return "\n".join(f"{i + 1:>3}. {s}" for i, s in enumerate(steps))


# ---- the memory plan (passes/memory.py) --------------------------------------------------------


@dataclass
class Placement:
    """A kernel's output buffer inside the pool: bytes [offset, offset + nbytes), needed from
    step `first` (the kernel that writes it) to step `last` (its last reader)."""

    name: str
    offset: int
    nbytes: int
    first: int
    last: int


@dataclass
class MemoryPlan:
    """Intermediate buffers share one pool; a buffer reuses the bytes of one whose last use has
    passed. Program outputs, inputs and extern results are not planned: outputs must outlive the
    call, and ATen allocates what extern calls return. Outputs written over a dying input
    (`Compilation.inplace`) need no bytes of their own and are not planned either."""

    placements: dict = field(default_factory=dict)  # buffer name -> Placement
    pool_bytes: int = 0
    naive_bytes: int = 0  # what allocating every planned buffer separately would take
    per_size: bool = False  # a shape family's: planned again at each size a call brings

    def __str__(self) -> str:
        lines = [f"memory plan: pool {self.pool_bytes} bytes for {len(self.placements)} "
                 f"intermediate buffer(s), {self.naive_bytes} bytes without reuse"
                 + (" (at the traced sizes: a shape family's program plans again at each size, "
                    "fusec/runtime/family_pool.py)" if self.per_size else "")]
        for p in sorted(self.placements.values(), key=lambda p: (p.first, p.offset)):
            lines.append(f"  {p.name:<24} offset {p.offset:>10}  {p.nbytes:>10} bytes  "
                         f"live steps {p.first + 1}-{p.last + 1}")
        return "\n".join(lines)


# ---- the decisions of the other passes ---------------------------------------------------------


@dataclass
class Refusal:
    """Fusion declined to merge `producer` into `consumer`, and says why (fuse_pointwise,
    fuse_reductions)."""

    producer: str
    consumer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.producer} -> {self.consumer}: {self.reason}"


class Merge(NamedTuple):
    """CSE replaced node `removed` by the equal value `kept`."""

    removed: str
    kept: str


class Unfused(NamedTuple):
    """unfuse_bias split `op` (an addmm or a convolution) into `plain` (no bias) and `add`."""

    op: str
    plain: str
    add: str


class Decision(NamedTuple):
    """A rewrite a pass considered for `node` (pad_matmul, split_reductions, ...): taken or not,
    and why."""

    node: str
    taken: bool
    why: str


class Reinplaced(NamedTuple):
    """A buffer update reinplace considered: the in-place node that replaced it (None: kept)."""

    update: str
    in_place: str | None
    why: str


@dataclass
class Folded:
    """A value computed once while compiling (passes/fold_constants.py): the node it replaced,
    the graph attribute that holds it now, its shape and dtype."""

    node: str
    attr: str
    shape: tuple
    dtype: str


@dataclass
class PassRecord:
    """What the passes decided about one graph, one field per pass that decides something.

    A field stays at its default until its pass runs. `backend` is set by the driver before the
    passes run (fuse_reductions plans reductions differently for backends that walk rows)."""

    backend: str | None = None
    skipped: list[str] = field(default_factory=list)  # passes with nothing to look at (passes/__init__.py)
    extensions: dict[str, list] = field(default_factory=dict)  # registered passes' decisions, by pass
    picks: list[Decision] = field(default_factory=list)  # gathers/scatters of one position a row
    fold_constants: list[Folded] = field(default_factory=list)
    dce: list[str] = field(default_factory=list)  # names of the nodes removed
    cse: list[Merge] = field(default_factory=list)
    constant_gathers: list[Decision] = field(default_factory=list)  # gathers moved onto constants
    check_gathers: list[Decision] = field(default_factory=list)  # index checks, casts dropped
    check_divisors: list[Decision] = field(default_factory=list)  # integer divisors checked
    canonicalize: list[Decision] = field(default_factory=list)  # spellings in canonical form
    simplify: list[Decision] = field(default_factory=list)
    filled_slices: list[Decision] = field(default_factory=list)  # slice writes that are a cat
    computed_pieces: list[Decision] = field(default_factory=list)
    reinplace: list[Reinplaced] = field(default_factory=list)
    unfuse_bias: list[Unfused] = field(default_factory=list)
    pad_matmul: list[Decision] = field(default_factory=list)
    pooling: list[Decision] = field(default_factory=list)
    layout: Any = None  # passes/layout_plan.py LayoutPlan: channels-last or not, and why
    move_permutes: list[Decision] = field(default_factory=list)
    split_reductions: list[Decision] = field(default_factory=list)
    fuse_pointwise: list[Decision] = field(default_factory=list)  # reshapes lifted onto loads
    fuse_reductions: list[Decision] = field(default_factory=list)  # sibling reductions merged
    refusals: list[Refusal] = field(default_factory=list)
    schedule: list[Step] = field(default_factory=list)


_KEY = "fusec_record"


def record_of(gm: fx.GraphModule) -> PassRecord:
    """The PassRecord of `gm`, made empty the first time it is asked for."""
    record = gm.meta.get(_KEY)
    if record is None:
        record = gm.meta[_KEY] = PassRecord()
    return record


def copy_record(source: fx.GraphModule, target: fx.GraphModule) -> None:
    """Give `target` a record of its own with `source`'s decisions so far (a shallow copy:
    passes replace a field's value, they do not change it in place)."""
    if _KEY in source.meta:
        target.meta[_KEY] = replace(source.meta[_KEY])


# ---- what a fused group is (per group, set by the fusion passes) -------------------------------

@dataclass
class GroupInfo:
    """One fused group, as the fusion passes outline it (passes/grouping.py): on the group's
    sub-GraphModule and on the node that calls it. `device` is filled by the driver once the
    group is lowered."""

    name: str
    ops: list[str]  # its ATen ops, in graph order
    kind: str  # "pointwise" or "reduction"
    shape: tuple[int, ...]  # the iteration space
    perms: dict = field(default_factory=dict)  # horizontally fused: value -> dim order
    reduce_dims: tuple[int, ...] | None = None
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    device: str | None = None


_GROUP = "fusec_group"


def group_info(gm_or_node) -> GroupInfo | None:
    """The GroupInfo of a group's sub-GraphModule or of the node that calls it (None: neither)."""
    return gm_or_node.meta.get(_GROUP)


def set_group_info(gm_or_node, info: GroupInfo) -> None:
    gm_or_node.meta[_GROUP] = info


# ---- where a value lives (per node, set by the schedule pass) -----------------------------------


def layout_of(node: fx.Node):
    """The fusec.ir.Layout the schedule gave node's value (its root buffer, shape, strides,
    offset), or None: the node is no tensor value, or the schedule has not run."""
    return node.meta.get("fusec_layout")


def owns_buffer(node: fx.Node) -> bool:
    """Node's value is a root buffer: an input, a constant, a kernel output, an extern result."""
    layout = node.meta.get("fusec_layout")
    return layout is not None and layout.root == node.name


def folded_view(node: fx.Node) -> bool:
    """Node is a view folded into its readers' indices: no buffer, no tensor of its own."""
    layout = node.meta.get("fusec_layout")
    return node.op == "call_function" and layout is not None and layout.root != node.name


# ---- one compilation -----------------------------------------------------------------------------


@dataclass
class Compilation:
    """Everything the driver made for one input signature, stage by stage.

    `captured` is fusec.capture.frontend.Captured (the ATen graph, the lifted parameters),
    `kernels` a list of fusec.driver.Kernel, `program` a fusec.runtime.program.Program."""

    backend: str
    captured: Any
    gm: fx.GraphModule  # after the passes
    snapshots: list | None  # the graph after each pass, if recorded (CompiledGraph.stages())
    kernels: list
    program: Any
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    inplace: dict = field(default_factory=dict)  # kernel output -> the dying input it overwrites
    times: dict = field(default_factory=dict)  # seconds per stage of the compile

    @property
    def passes(self) -> PassRecord:
        """What the passes decided (the record that travelled with the graph)."""
        return record_of(self.gm)

    @property
    def schedule(self) -> list[Step]:
        """The ordered kernel launches and extern calls."""
        return self.passes.schedule

    def schedule_text(self) -> str:
        """The numbered steps (kernel or extern, buffers read and written) and the memory plan."""
        text = format_schedule(self.schedule) + "\n" + str(self.memory)
        for out, over in self.inplace.items():
            text += f"\n  {out:<24} written over {over} (its last use): no buffer of its own"
        return text
