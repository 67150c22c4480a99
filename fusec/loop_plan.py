"""The loop plan of a reduction kernel: which values a row computes before its loops over k, in
which pass, and which ones become known after each pass. Part of the kernel IR (fusec/ir.py,
`ReductionKernel.plan`), decided once by lowering (codegen/lower_reduction.py, `plan_loops`), and
only spelled by the backends.

Note (phases). A reduction's result is known only once the whole row has been seen, so anything
computed from it waits for a pass over the row to end. Softmax of one row x is

    m = amax(x)                       phase 0: a pass over k for the max
    s = sum(exp(x - m))               phase 1: a pass that needs m, for the sum
    exp(x - m) / s                    the last pass: needs s, writes one value per element

Each reduction gets the phase after which all of its operand's inputs are known: its *phase*.
A phase is one pass over k. Inside the pass the loop computes the element values its reductions
read (`Phase.loop`: x, x - m and exp(x - m) for phase 1); values that do not vary along k are
computed once per row, before the loops when they need no reduction at all (`LoopPlan.before`: a
per-row scale), or as soon as the phase that makes them computable ends (`Phase.ready`:
logsumexp's log(s) + m). After the last phase, one more pass (`LoopPlan.last_pass`) computes the
element values that are stored and writes them per element (`element_stores`); a row value
(softmax's sum, if the program returns it) is written once per row (`row_stores`).

Two optional shortcuts are recorded with the plan, and each backend decides whether to take
them: a phase whose sums can ride along in the pass before it (`Phase.folds`: sums of exp(v - max)
with their max, online softmax, and sums of squared deviations (v - c)^2 from a row value c known
only after that pass, online variance; the Triton backend's looped kernels take both), and an
element value the last phase writes into an output for the last pass to read back instead of
computing it again (`Keep`: the two CPU backends take it), and the same for an earlier phase and the
phase after it (`Stash`: a softmax of gelu(x) computes gelu in its max pass and reads it back in its
sum pass; the two CPU backends take it too).
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, replace


@dataclass(frozen=True)
class OnlineSoftmax:
    """A sum of exp(v - c) over k (`total`) whose shift c is the amax of the same v over the same
    row one phase earlier (`peak`): softmax's and log_softmax's denominator, logsumexp's sum.

    `shift` names c: the amax itself, or logsumexp's where(|max| == inf, 0, max). A looped
    kernel may accumulate such a sum in the same pass as its max ("online softmax", Milakov and
    Gimelshein 2018): each lane keeps a running max and the sum of exp(v - running max),
    rescaled by exp(old max - new max) whenever the max grows. Lowering records the pairs
    (codegen/lower_folds.py, online_softmax); a backend decides whether to use them.
    """

    total: str  # the sum Reduce's var
    peak: str  # the amax Reduce's var
    value: str  # v, the element value the amax reduces
    shift: str  # c, the row value subtracted from v before exp

    def renamed(self, names: dict[str, str]) -> "OnlineSoftmax":
        return OnlineSoftmax(*(names[f] for f in astuple(self)))


@dataclass(frozen=True)
class OnlineVariance:
    """A sum of (v - c)^2 over k (`total`), where v (`value`) can be computed one phase earlier
    and c (`shift`) is a row value known once that earlier phase ends: a variance's sum of
    squared deviations from the mean (layer, group, instance and batch norm; `var`).

    A looped kernel may accumulate it in the earlier pass instead of reading the row again
    (Welford 1962): each lane keeps its count n, its own running mean m and the sum of squared
    deviations from that mean, s. Since sum over a lane of (v - c)^2 = s + n (m - c)^2 for any c,
    the total is the sum over lanes of s + n (m - c)^2 once c is known (Chan, Golub and LeVeque's
    way of combining variances). Every term is non-negative: no cancellation, whatever c is.
    """

    total: str  # the sum Reduce's var
    value: str  # v, the element value whose deviations are squared
    shift: str  # c, the row value subtracted from v

    def renamed(self, names: dict[str, str]) -> "OnlineVariance":
        return OnlineVariance(*(names[f] for f in astuple(self)))


@dataclass(frozen=True)
class Phase:
    """One pass over k: the reductions of phase `number`, what the loop computes at each k, and
    the row values that become computable when the pass ends. All are variable names, in
    program order.

    folds: when every reduction of the next phase is a sum of exp(v - max) over a max of this
    phase (OnlineSoftmax) or a sum of squared deviations (OnlineVariance), those sums: a backend
    that keeps running maxes and running means may accumulate the next phase's sums in this pass
    and skip the next pass (`LoopPlan.passes`). Empty otherwise. `loop` then also computes the
    values whose deviations the folded sums square.
    """

    number: int
    reduces: tuple[str, ...]  # the Reduce results this pass accumulates
    loop: tuple[str, ...]  # element values (loads, statements) the loop computes at each k
    ready: tuple[str, ...]  # row values computed once the pass is done
    folds: tuple[OnlineSoftmax | OnlineVariance, ...] = ()


@dataclass(frozen=True)
class Keep:
    """An element value that the last phase computes anyway and writes into an output row,
    where the last pass reads it back instead of computing it again (softmax's exp(x - max): the
    last pass becomes out[k] = out[k] / sum). Chosen in lowering (codegen/lower_reduction.py,
    `keep_choice`, where the note says when it pays off); backends that walk one row at a time
    take it (the row is still in their cache), Triton recomputes.

    last_pass: the element values the last pass computes then (`value` among them, read back);
    stores: the element stores left for the last pass (none: the kept value is the output, and
    there is no last pass)."""

    value: str
    store: int  # the number of the store (kernel.stores) whose place holds the value
    last_pass: tuple[str, ...]
    stores: tuple[int, ...]


@dataclass(frozen=True)
class Stash:
    """An element value that a phase before the last computes and writes into an output row, where
    the next phase's loop reads it back instead of computing it again: Keep for an earlier pass.
    A softmax of gelu(x) computes gelu(x) in its max pass, keeps it in the output, and its sum pass
    reads gelu back, computes exp(gelu - max) and keeps that in the same place for the last pass:
    gelu and exp are each computed once per element. Chosen in lowering (codegen/lower_reduction.py,
    `stash_choice`, under Keep's conditions); backends that walk one row at a time take it, Triton
    computes `Phase.loop` as it is.

    phase: the number of the phase that writes it; loop: what the next phase's loop computes then
    (`value` among them, read back), in place of that phase's `loop`."""

    phase: int
    value: str
    store: int  # the number of the store (kernel.stores) whose place holds the value
    loop: tuple[str, ...]


@dataclass(frozen=True)
class LoopPlan:
    """What a row does, in order: `before`, one pass per phase, the last pass (only when there
    are element stores), then the row stores. See the note on phases above."""

    before: tuple[str, ...]  # row values that need no reduction: once per row, before any loop
    phases: tuple[Phase, ...]
    last_pass: tuple[str, ...]  # element values the last pass computes for its stores
    element_stores: tuple[int, ...]  # stores (numbers into kernel.stores) written per element
    row_stores: tuple[int, ...]  # stores written once per row, after the last phase
    keep: Keep | None = None
    stashes: tuple[Stash, ...] = ()  # at most one per phase before the last, in phase order

    def stash_of(self, number: int) -> Stash | None:
        """The stash phase `number` writes, or None."""
        return next((s for s in self.stashes if s.phase == number), None)

    def keep_stored_again(self) -> bool:
        """Whether the last phase stores the kept value: not when the phase before stashed that
        same value in the same place (the last phase read it back from there, and it is still
        there for the last pass: storing it again only costs a store per element)."""
        read = self.stash_of(self.phases[-1].number - 1) if self.keep else None
        return not (read and read.value == self.keep.value and read.store == self.keep.store)

    def phase_loop(self, phase: Phase) -> tuple[tuple[str, ...], dict[str, int]]:
        """(what the phase's loop computes, {value read back: store}) for a backend that takes
        the stashes: the loop with the value the phase before kept read back, else `Phase.loop`."""
        read = self.stash_of(phase.number - 1)
        return (read.loop, {read.value: read.store}) if read else (phase.loop, {})

    def passes(self, online: bool) -> list[tuple[Phase, ...]]:
        """The phases each pass over k covers: one phase per pass, or, with `online`, a phase
        together with the next one when the next one folds into it (`Phase.folds`): softmax's
        max and sum share one pass, then the last pass stores (two reads of the row, not three);
        layer norm's mean and variance share one pass the same way."""
        passes, i = [], 0
        while i < len(self.phases):
            phase = self.phases[i]
            if online and phase.folds:
                passes.append((phase, self.phases[i + 1]))
                i += 2
            else:
                passes.append((phase,))
                i += 1
        return passes

    def renamed(self, names: dict[str, str]) -> "LoopPlan":
        """The same plan over renamed variables (fusec.ir.canonical)."""
        def each(seq) -> tuple[str, ...]:
            return tuple(names[n] for n in seq)
        phases = tuple(replace(p, reduces=each(p.reduces), loop=each(p.loop), ready=each(p.ready),
                               folds=tuple(o.renamed(names) for o in p.folds))
                       for p in self.phases)
        keep = self.keep and replace(self.keep, value=names[self.keep.value],
                                     last_pass=each(self.keep.last_pass))
        stashes = tuple(replace(s, value=names[s.value], loop=each(s.loop)) for s in self.stashes)
        return replace(self, before=each(self.before), phases=phases,
                       last_pass=each(self.last_pass), keep=keep, stashes=stashes)

    def describe(self, made: dict, stores: list) -> list[str]:
        """The plan as lines for a reader (ReductionKernel.__str__). `made` maps a name to the
        Reduce that makes it; `stores` are the kernel's stores."""
        def names(seq) -> str:
            return ", ".join(seq) or "-"

        lines = ["loop plan, per row:"]
        if self.before:
            lines.append(f"  before the loops: {names(self.before)}")
        for p in self.phases:
            reds = ", ".join(f"{made[n].op}({made[n].operand.name})" for n in p.reduces)
            lines.append(f"  phase {p.number}: {reds} over k; each k computes {names(p.loop)}"
                         + (f"; then {names(p.ready)}" if p.ready else ""))
            for o in p.folds:
                if isinstance(o, OnlineVariance):
                    lines.append(f"    online variance: phase {p.number + 1}'s {o.total} = "
                                 f"sum(({o.value} - {o.shift})^2) may join this pass "
                                 f"(running means per lane)")
                    continue
                lines.append(f"    online softmax: phase {p.number + 1}'s {o.total} = "
                             f"sum(exp({o.value} - {o.shift})) may join this pass "
                             f"(running max {o.peak})")
        if self.element_stores:
            lines.append(f"  last pass: each k computes {names(self.last_pass)}; stores "
                         + ", ".join(stores[n].param for n in self.element_stores))
        if self.row_stores:
            lines.append("  once per row: stores " + ", ".join(stores[n].param for n in self.row_stores))
        for s in self.stashes:
            lines.append(f"  stash: phase {s.phase} also writes {s.value} into "
                         f"{stores[s.store].param}, where phase {s.phase + 1} reads it back "
                         f"(it computes {names(s.loop)})")
        if self.keep and not self.keep_stored_again():
            lines.append(f"  keep: {self.keep.value} stays in {stores[self.keep.store].param} from "
                         f"the stash before, where the last pass reads it back")
        elif self.keep:
            k = self.keep
            lines.append(f"  keep: phase {self.phases[-1].number} also writes {k.value} into "
                         f"{stores[k.store].param}, " + ("where the last pass reads it back"
                                                         if k.stores else "its output: no last pass"))
        return lines
