"""`fusec.explain(model, *inputs)`: every stage of the pipeline, printable and as a dict.

    e = fusec.explain(f, x)
    print(e)            # the walk through the pipeline, below
    e.to_dict()         # the same facts as plain data (JSON-ready)
    e.dot("before")     # Graphviz pictures of the graph before / after fusion (fusec/graphviz.py)

`str(e)` walks the pipeline in order:

1. the captured ATen graph: every value with its dtype, shape (and strides when it is not
   contiguous), the op that computes it, what kind of op that is, and the user's source line;
2. the graph after each pass, with what the pass changed: nodes removed, groups formed (and from
   which ops), fusions refused and why;
3. the fusion groups as a table: kernel, ops, inputs, outputs, and the bytes the kernel reads
   and writes, counted from the kernel IR (see `kernel_traffic`);
4. every extern step (an eager ATen call between kernels) with the reason it is not a kernel;
5. the schedule, and each kernel's source.

Nothing is run on the inputs' data: the program is captured and compiled exactly as
`fusec.compile` would (the kernels are built, so their sources are the real ones).

A program that cannot be one graph (graph breaks, fusec/breaks.py) is explained region by
region: `fusec.explain` then returns a `RegionsExplanation`, which first lists every region,
every break with the user's line and torch's reason, and what ran eagerly, then walks each
region's program as above. Finding the regions means running the program once through
TorchDynamo (a break can depend on the data), under torch.no_grad(). The same holds for a
`torch.compile(model, backend="fusec")` object: `fusec.explain(opt, *inputs)` compiles its
regions afresh; `fusec.explain(opt)` with no inputs explains the regions it already compiled.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

import torch
import torch.fx as fx

from .api import CompiledGraph, compile_graph, resolve_backend, _prepare_triton
from .frontend import capture
from .ir import TensorMeta, contiguous_strides, short_dtype
from .errors import FusecError, GraphBreakError


# ---- source lines ---------------------------------------------------------------------------------

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')


def user_frames(node: fx.Node) -> list[dict]:
    """The user's stack frames (outermost first) recorded for `node` while tracing, without
    frames inside torch or fusec. Empty when the graph was captured without stack traces."""
    trace = node.meta.get("stack_trace") or ""
    import os
    torch_dir = os.path.dirname(torch.__file__)
    fusec_dir = os.path.dirname(os.path.abspath(__file__))
    frames = []
    for m in _FRAME.finditer(trace):
        path = m.group("file")
        if path.startswith(torch_dir) or (path.startswith(fusec_dir)
                                          and not path.startswith(os.path.join(fusec_dir, "examples"))):
            continue
        frames.append({"file": path, "line": int(m.group("line")), "function": m.group("func"),
                       "code": m.group("code").strip()})
    return frames


def user_line(node: fx.Node) -> str:
    """`file.py:12  y = torch.sin(x)`: the innermost user frame, or "" if unknown."""
    frames = user_frames(node)
    if not frames:
        return ""
    f = frames[-1]
    import os
    return f"{os.path.basename(f['file'])}:{f['line']}  {f['code']}"


# ---- the captured graph ---------------------------------------------------------------------------

def _meta_str(m) -> str:
    if isinstance(m, TensorMeta):
        text = str(m)
        if m.stride != contiguous_strides(m.shape) and m.numel > 1:
            text += f" stride={m.stride}"
        return text
    if isinstance(m, tuple):
        return "(" + ", ".join(_meta_str(x) for x in m) + ")"
    return ""


def _arg_str(a) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg_str(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return short_dtype(a)
    return repr(a)


def op_kind(node: fx.Node) -> str:
    """pointwise | reduction | view | extern, as the op table classifies the node's op."""
    from fusec import ops
    if node.op != "call_function":
        return node.op
    if node.target.__name__ == "getitem":
        return "getitem"
    reduction = getattr(ops, "reduction", None)
    if reduction is not None and reduction(node) is not None:
        return "reduction"
    kind = ops.classify(node.target)
    if kind == ops.POINTWISE and ops.normalize(node) is None:
        return "extern"
    return kind


def node_rows(gm: fx.GraphModule) -> list[dict]:
    """One dict per node of a (captured) graph: name, kind, op, args, dtype/shape, source line."""
    rows = []
    for node in gm.graph.nodes:
        row = {"name": node.name, "op": node.op, "value": _meta_str(node.meta.get("fusec")),
               "line": user_line(node)}
        if node.op == "call_function":
            row["target"] = str(node.target)
            row["kind"] = op_kind(node)
            row["args"] = [_arg_str(a) for a in node.args] + \
                [f"{k}={_arg_str(v)}" for k, v in node.kwargs.items()]
        elif node.op == "output":
            row["args"] = [_arg_str(a) for a in node.args[0]]
        rows.append(row)
    return rows


def graph_listing(gm: fx.GraphModule) -> str:
    """The captured graph, one value per line, readable:

        inputs:
          x       f32[4, 16]
        ops:
          sin     f32[4, 16]  = aten.sin(x)            pointwise  # f.py:12  y = torch.sin(x)
        outputs: mul
    """
    rows = node_rows(gm)
    name_w = min(max([len(r["name"]) for r in rows] + [4]), 24)
    val_w = min(max([len(r["value"]) for r in rows] + [4]), 32)
    ins = [r for r in rows if r["op"] in ("placeholder", "get_attr")]
    body = [r for r in rows if r["op"] == "call_function"]
    outs = [r for r in rows if r["op"] == "output"]
    lines = ["inputs:"]
    for r in ins:
        what = "" if r["op"] == "placeholder" else "  (constant)"
        lines.append(f"  {r['name']:<{name_w}}  {r['value']}{what}")
    lines.append("ops:")
    exprs = {r["name"]: f"= {r['target'].replace('aten.', '').replace('.default', '')}"
                        f"({', '.join(r['args'])})" for r in body}
    expr_w = min(max([len(e) for e in exprs.values()] + [4]), 60)
    for r in body:
        line = f"  {r['name']:<{name_w}}  {r['value']:<{val_w}}  {exprs[r['name']]:<{expr_w}}  " \
               f"{r['kind']:<9}"
        if r["line"]:
            line += f"  # {r['line']}"
        lines.append(line.rstrip())
    if outs:
        lines.append("outputs: " + ", ".join(outs[0].get("args", [])))
    return "\n".join(lines)


# ---- bytes moved --------------------------------------------------------------------------------

def loop_shape(ir) -> tuple[int, ...]:
    """The iteration space a kernel's index strides refer to."""
    if hasattr(ir, "row_shape"):
        return tuple(ir.row_shape) + tuple(ir.k_shape)
    return tuple(ir.shape)


def distinct_elements(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How many different elements an index touches over the loop: a dim with stride 0 (a
    broadcast) revisits the same element, so only dims with a nonzero stride multiply."""
    return prod(size for size, st in zip(shape, strides) if st != 0) if shape else 1


def kernel_traffic(ir) -> dict:
    """Bytes a kernel reads and writes, computed from its IR.

    Each load reads `distinct elements x dtype size` bytes: a (1, 8) row broadcast over 8390 rows
    counts 8 elements, not 67120 (the repeats hit the cache). Each store writes its whole output.
    `flops` counts one operation per statement per element it runs on (a rough figure, for the
    roofline's arithmetic intensity).
    """
    shape = loop_shape(ir)
    numel = prod(shape)
    loads = []
    for l in getattr(ir, "loads", []):
        n = distinct_elements(shape, l.index.strides)
        loads.append({"param": l.param, "dtype": short_dtype(l.dtype), "elements": n,
                      "bytes": n * _itemsize(l.dtype), "broadcast": n < numel})
    stores = []
    for s in getattr(ir, "stores", []):
        n = distinct_elements(shape, s.index.strides)
        stores.append({"param": s.param, "dtype": short_dtype(s.dtype), "elements": n,
                       "bytes": n * _itemsize(s.dtype)})
    stmts = list(getattr(ir, "stmts", None) or getattr(ir, "body", None) or [])
    varying = getattr(ir, "varying", None)
    rows = prod(getattr(ir, "row_shape", ())) if hasattr(ir, "row_shape") else numel
    flops = 0
    for s in stmts:
        if getattr(s, "op", "") in ("to", "copy", "full"):
            continue
        per_element = varying is None or s.var.name in varying or type(s).__name__ == "Reduce"
        flops += numel if per_element else rows
    read = sum(l["bytes"] for l in loads)
    written = sum(s["bytes"] for s in stores)
    return {"read_bytes": read, "write_bytes": written, "bytes": read + written, "flops": flops,
            "intensity": flops / (read + written) if read + written else 0.0,
            "numel": numel, "loads": loads, "stores": stores}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n} B"


# ---- fusion groups ------------------------------------------------------------------------------

def group_rows(gm: fx.GraphModule, kernels) -> list[dict]:
    """One row per fused kernel: name, kind, ops, inputs, outputs, shape, bytes (from the IR when
    `kernels` is given), and the user lines its ops came from."""
    by_name = {k.name: k for k in kernels or []}
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        g = node.meta.get("fusec_group", {})
        sub = getattr(gm, node.target)
        members = [n for n in sub.graph.nodes if n.op == "call_function"]
        lines = []
        for n in members:
            line = user_line(n)
            if line and line not in lines:
                lines.append(line)
        row = {"name": node.target, "kind": g.get("kind", "pointwise"),
               "ops": [str(n.target).replace("aten.", "") for n in members],
               "nodes": [n.name for n in members],
               "inputs": [_io(a) for a in node.args],
               "outputs": [_io(u) for u in sorted(node.users, key=lambda u: u.args[1])],
               "shape": list(g.get("shape", ())), "lines": lines,
               "read_bytes": None, "write_bytes": None, "flops": None}
        k = by_name.get(node.target)
        if k is not None:
            t = kernel_traffic(k.ir)
            row.update(read_bytes=t["read_bytes"], write_bytes=t["write_bytes"], flops=t["flops"],
                       loads=t["loads"], stores=t["stores"])
        rows.append(row)
    return rows


def _io(node: fx.Node) -> str:
    return f"{node.name} {_meta_str(node.meta.get('fusec'))}".strip()


def format_groups(rows: list[dict]) -> str:
    if not rows:
        return "fusion groups: none (no kernel)"
    table = [("kernel", "ops", "inputs", "outputs", "read", "written")]
    for r in rows:
        ops = ", ".join(o.split(".")[0] for o in r["ops"])
        table.append((r["name"], ops, ", ".join(r["inputs"]), ", ".join(r["outputs"]),
                      fmt_bytes(r["read_bytes"]), fmt_bytes(r["write_bytes"])))
    return _text_table(table)


def _text_table(rows: list[tuple], max_width: int = 48) -> str:
    def cut(s):
        s = str(s)
        return s if len(s) <= max_width else s[: max_width - 1] + "…"
    rows = [tuple(cut(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def refusal_dicts(gm: fx.GraphModule) -> list[dict]:
    return [dict(vars(r)) for r in gm.meta.get("fusec_refusals", [])]


def format_refusals(gm: fx.GraphModule) -> str:
    refusals = refusal_dicts(gm)
    return "fusion refused:" + ("".join(
        f"\n  {r['producer']} -> {r['consumer']}: {r['reason']}" for r in refusals) or " nothing")


# ---- externs ------------------------------------------------------------------------------------

_LIBRARY = ("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_scaled_dot_product",
            "linear")


def extern_reason(node: fx.Node) -> str:
    """Why `node` runs as an eager ATen call instead of inside a kernel."""
    from fusec import ops
    target = node.target
    name = str(target).replace("aten.", "")
    base = name.split(".")[0]
    if base in ("copy_",):
        return "writes the new value back into an input the program updates in place"
    if base in ("reshape", "view", "_unsafe_view") or (isinstance(target, torch._ops.OpOverload)
                                                       and ops.classify(target) == ops.VIEW):
        return ("a view that cannot be expressed as strides over its input's buffer as fusec laid "
                "it out, so it is copied (like reshape)")
    if any(base.startswith(p) for p in _LIBRARY):
        return ("matrix product / convolution: runs as a vendor-library (BLAS, cuBLAS, oneDNN) "
                "call; fusec does not generate these kernels")
    if base in ("rand", "randn", "rand_like", "randn_like", "bernoulli", "native_dropout",
                "randint", "uniform", "normal", "randperm", "multinomial"):
        return "random numbers: drawn by ATen so they match torch's generator"
    reduction = getattr(ops, "reduction", None)
    if reduction is not None and reduction(node) is not None:
        return "a reduction that no fusion group took (see the refusals above)"
    if target in ops.ATEN:
        if target is torch.ops.aten._to_copy.default and "device" in node.kwargs:
            return "moves data to another device"
        return "in the op table, but not with these arguments (e.g. cat of several tensors)"
    return f"not in the op table (fusec/ops.py): {base} runs as an eager ATen call"


def fallback_rows(gm: fx.GraphModule) -> list[dict]:
    by_name = {n.name: n for n in gm.graph.nodes}
    rows = []
    for step in gm.meta.get("fusec_schedule", []):
        if step.kind != "extern":
            continue
        node = by_name[step.node]
        rows.append({"op": step.name, "node": step.node, "reason": extern_reason(node),
                     "line": user_line(node), "reads": list(step.reads),
                     "writes": list(step.writes)})
    return rows


# ---- what each pass changed ---------------------------------------------------------------------

_TOP = re.compile(r'^        (\w+)(?:: "[^"]*")? = (.*)$')
_CLASS = re.compile(r"^    class (\w+)\(torch\.nn\.Module\):")
_INNER = re.compile(r'^            (\w+)(?:: "[^"]*")? = torch\.ops\.aten\.(\S+?)\(')
_CALL = re.compile(r"self\.(\w+)\(")


def _parse_snapshot(code: str) -> tuple[list[str], dict[str, list[str]]]:
    """Top-level value names, and group name -> member node names, from a printed snapshot."""
    top, groups, current = [], {}, None
    for line in code.splitlines():
        m = _CLASS.match(line)
        if m:
            current = m.group(1)
            groups[current] = []
            continue
        if current is None:
            m = _TOP.match(line)
            if m and not _CALL.search(m.group(2)):
                top.append(m.group(1))
        else:
            m = _INNER.match(line)
            if m:
                groups[current].append(m.group(1))
    return top, groups


def pass_changes(captured_gm: fx.GraphModule, gm: fx.GraphModule, snapshots) -> list[dict]:
    """For each recorded stage: a one-line summary, detail lines, and the graph as Python."""
    changes = []
    prev_nodes: set[str] | None = None
    prev_groups: dict[str, list[str]] = {}
    kinds = {n.name: op_kind(n) for n in captured_gm.graph.nodes if n.op == "call_function"}
    final_groups = {r["name"]: r for r in group_rows(gm, None)}
    for snap in snapshots:
        top, groups = _parse_snapshot(snap.code)
        nodes = set(top) | {n for members in groups.values() for n in members}
        details: list[str] = []
        if prev_nodes is None:
            counts: dict[str, int] = {}
            for k in kinds.values():
                counts[k] = counts.get(k, 0) + 1
            summary = f"{len(kinds)} ATen op(s): " + ", ".join(
                f"{v} {k}" for k, v in sorted(counts.items())) if kinds else "no ATen ops"
        else:
            removed = [n for n in kinds if n in prev_nodes and n not in nodes]
            formed = {k: v for k, v in groups.items() if k not in prev_groups}
            dissolved = [k for k in prev_groups if k not in groups]
            parts = []
            if removed:
                parts.append(f"removed {len(removed)} node(s)")
                details.append("removed (no user, no side effect): " + ", ".join(removed))
            if dissolved:
                parts.append(f"merged {len(dissolved)} earlier group(s)")
                details.append("regrouped: " + ", ".join(dissolved))
            if formed:
                parts.append(f"formed {len(formed)} group(s)")
                for k, members in formed.items():
                    info = final_groups.get(k, {})
                    shape = tuple(info.get("shape", ()))
                    why = ("connected ops over one iteration space " + str(shape)) if shape else \
                        "connected ops over one iteration space"
                    if info.get("kind") == "reduction":
                        why = f"a reduction with its prologue/epilogue ops over {shape}"
                    details.append(f"{k}: {', '.join(members)}  ({why})")
            if snap.after == "unfuse_bias" and gm.meta.get("fusec_unfuse_bias"):
                done = gm.meta["fusec_unfuse_bias"]
                parts.append(f"unfused {len(done)} linear bias(es)")
                details += [f"{addmm} -> {mm} + {add} (the add fuses into the kernel after it)"
                            for addmm, mm, add in done]
            if snap.after == "small_matmul" and gm.meta.get("fusec_small_matmul"):
                decisions = gm.meta["fusec_small_matmul"]
                taken = sum(1 for _, t, _ in decisions if t)
                if taken:
                    parts.append(f"{taken} matmul(s) rewritten as GEMV reductions")
                details += [f"{name}: {'GEMV' if t else 'library matmul'}: {why}"
                            for name, t, why in decisions]
            if snap.after == "pad_matmul" and gm.meta.get("fusec_pad_matmul"):
                decisions = gm.meta["fusec_pad_matmul"]
                if any(t for _, t, _ in decisions):
                    parts.append(f"padded {sum(1 for _, t, _ in decisions if t)} misaligned matmul(s)")
                details += [f"{name}: {'padded' if t else 'kept'}: {why}" for name, t, why in decisions]
            if snap.after == "layout" and getattr(gm.meta.get("fusec_layout_plan"), "convs", None):
                plan = gm.meta["fusec_layout_plan"]
                if plan.choice != "unchanged":
                    parts.append(plan.summary())
                details.append(f"layout: {plan.choice} ({plan.reason}); see === memory layout ===")
            if snap.after == "schedule":
                steps = gm.meta.get("fusec_schedule", [])
                nk = sum(1 for s in steps if s.kind == "kernel")
                ne = len(steps) - nk
                parts.append(f"{len(steps)} step(s): {nk} kernel launch(es), {ne} extern call(s)")
                folded = [n.name for n in gm.graph.nodes if "fusec_layout" in n.meta
                          and n.op == "call_function" and n.meta["fusec_layout"].root != n.name]
                if folded:
                    details.append("views folded into load indices (no copy): " + ", ".join(folded))
            summary = "; ".join(parts) or "no change"
        changes.append({"after": snap.after, "summary": summary, "details": details,
                        "graph": snap.code})
        prev_nodes, prev_groups = nodes, groups
    return changes


# ---- the explanation ----------------------------------------------------------------------------

@dataclass
class Explanation:
    compiled: CompiledGraph

    @property
    def kernels(self) -> list:
        return self.compiled.kernels

    # pieces, also used by fusec.profile and FUSEC_DEBUG_DIR
    def groups(self) -> list[dict]:
        return group_rows(self.compiled.gm, self.compiled.kernels)

    def fallbacks(self) -> list[dict]:
        return fallback_rows(self.compiled.gm)

    def graph(self) -> str:
        return graph_listing(self.compiled.captured.gm)

    def dot(self, stage: str = "after") -> str:
        """Graphviz DOT text of the graph "before" or "after" fusion (see fusec/graphviz.py)."""
        from .graphviz import dot_after, dot_before
        if stage == "before":
            return dot_before(self.compiled.captured.gm, self.compiled.gm)
        if stage == "after":
            return dot_after(self.compiled.gm)
        raise ValueError(f"stage must be 'before' or 'after', not {stage!r}")

    def svg(self, stage: str = "after") -> str | None:
        """The same picture as SVG, or None when Graphviz's `dot` is not installed."""
        from .graphviz import render_svg
        return render_svg(self.dot(stage))

    def _llvm_kernel(self, kernel: int | str):
        kernels = self.compiled.kernels
        k = kernels[kernel] if isinstance(kernel, int) else \
            next((k for k in kernels if k.name == kernel), None)
        if k is None:
            raise FusecError(f"fusec: no kernel named {kernel!r}; the kernels are "
                             f"{', '.join(k.name for k in kernels) or 'none'}")
        if k.backend != "llvm":
            raise FusecError(f"fusec: kernel {k.name} was built by the {k.backend} backend; the "
                             "optimized IR and host assembly come from backend='llvm'")
        return k

    def optimized_ir(self, kernel: int | str = 0) -> str:
        """LLVM backend: the kernel's IR after LLVM's O3 pipeline, where the loop vectorizer has
        turned `float` loads and math into `<8 x float>` ones (by position or by name)."""
        from fusec.codegen import llvm
        k = self._llvm_kernel(kernel)
        return llvm.optimized_ir(k.source, k.name)

    def assembly(self, kernel: int | str = 0, target: str | None = None) -> str:
        """LLVM backend: the kernel's machine code, as assembly: for this CPU, or for `target`,
        one of fusec.codegen.llvm_build.NAMED_TARGETS ("haswell", "sapphirerapids", "aarch64",
        ...) to see what the same kernel becomes on another CPU."""
        from fusec.codegen import llvm, llvm_build
        k = self._llvm_kernel(kernel)
        if target is None:
            return llvm.assembly(k.source, k.name)
        chosen = llvm_build.available_targets().get(target)
        if chosen is None:
            raise FusecError(f"fusec: unknown or unavailable LLVM target {target!r}; choose one "
                             f"of {', '.join(llvm_build.available_targets())}")
        return llvm.assembly(llvm.render(k.ir, chosen), k.name, chosen)

    def to_dict(self) -> dict:
        from fusec.passes.schedule import format_schedule
        gm = self.compiled.gm
        cg = self.compiled
        return {
            "backend": cg.backend,
            "graph": node_rows(cg.captured.gm),
            "stages": [{"after": s.after, "graph": s.code} for s in cg.stages()],
            "passes": [{k: v for k, v in c.items() if k != "graph"}
                       for c in pass_changes(cg.captured.gm, gm, cg.stages())],
            "removed_by_dce": list(gm.meta.get("fusec_dce", [])),
            "refusals": refusal_dicts(gm),
            "groups": self.groups(),
            "kernels": [{"name": k.name, "ops": k.ops, "source": k.source, "backend": k.backend,
                         "shape": list(k.ir.source_shape)} for k in cg.kernels],
            "externs": [s.name for s in gm.meta["fusec_schedule"] if s.kind == "extern"],
            "fallbacks": self.fallbacks(),
            "schedule": format_schedule(gm.meta["fusec_schedule"]),
            "layout": gm.meta["fusec_layout_plan"].to_dict() if "fusec_layout_plan" in gm.meta
            else None,
            "dot": {"before": self.dot("before"), "after": self.dot("after")},
        }

    def __str__(self) -> str:
        from fusec.passes.schedule import format_schedule
        cg = self.compiled
        gm = cg.gm
        out = [f"fusec explain ({cg.backend} backend): {len(cg.kernels)} kernel(s), "
               f"{len(self.fallbacks())} extern call(s)"]
        out.append("\n=== captured ATen graph ===\n" + self.graph())
        changes = pass_changes(cg.captured.gm, gm, cg.stages())
        fuse_stages = [c["after"] for c in changes if c["after"].startswith("fuse")]
        previous = None
        for change in changes:
            out.append(f"\n=== graph after {change['after']} === ({change['summary']})")
            out += ["  " + d for d in change["details"]]
            same = change["graph"] == previous
            out.append("(the graph is the same as before this pass)" if same
                       else change["graph"].rstrip())
            previous = change["graph"]
            if change["after"] == "dce":
                out.append(f"dce removed: {', '.join(gm.meta.get('fusec_dce', [])) or 'nothing'}")
            if fuse_stages and change["after"] == fuse_stages[-1]:
                out.append(format_refusals(gm))
        if getattr(gm.meta.get("fusec_layout_plan"), "convs", None):  # each tensor's layout, why
            out.append("\n=== memory layout ===\n" + str(gm.meta["fusec_layout_plan"]))
        out.append("\n=== fusion groups ===\n" + format_groups(self.groups()))
        fallbacks = self.fallbacks()
        out.append("\n=== extern (eager ATen) calls ===")
        if fallbacks:
            out.append("extern (eager ATen) calls: " + ", ".join(f["op"] for f in fallbacks))
            for f in fallbacks:
                where = f"  # {f['line']}" if f["line"] else ""
                out.append(f"  {f['node']} = {f['op']}: {f['reason']}{where}")
        else:
            out.append("none: every op runs inside a fused kernel")
        out.append(f"\n=== schedule ===\n{format_schedule(gm.meta['fusec_schedule'])}")
        for k in cg.kernels:
            out.append(f"\n=== kernel {k.name} over {tuple(k.ir.source_shape)} ===\n{k.source}")
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):  # IPython / Jupyter print the walk, not the dataclass
        p.text(str(self))


def explain(model, *inputs, backend: str = "auto", **kwargs):
    """Capture and compile `model(*inputs, **kwargs)` and return every stage (see module doc).

    `model` may be a plain function or module, one already wrapped by fusec.compile, or one
    returned by `torch.compile(..., backend="fusec")`. Returns an Explanation, or a
    RegionsExplanation when the program runs in regions with graph breaks between them.
    """
    from .breaks import original, regions
    torch_compiled = original(model)
    if torch_compiled is not None:  # torch.compile(..., backend="fusec"): Dynamo's regions
        collected = regions(model)
        if not inputs and not kwargs:
            return RegionsExplanation(collected)
        backend = collected.backend if backend == "auto" else backend
        return explain_regions(torch_compiled, inputs, kwargs, backend)
    fullgraph = getattr(getattr(model, "_compiled", model), "fullgraph", False)
    model, backend = unwrap(model, backend)
    try:
        captured, chosen = capture_for(model, inputs, kwargs, backend)
    except GraphBreakError as cause:
        if fullgraph:
            raise
        return explain_regions(model, inputs, kwargs, backend, cause)
    return Explanation(compile_graph(captured, chosen, record=True, label=_label(model)))


def explain_regions(model, inputs: tuple, kwargs: dict, backend: str,
                    cause: GraphBreakError | None = None) -> "RegionsExplanation":
    """Run `model` once through TorchDynamo with fusec compiling each region, and explain them."""
    from .breaks import collect_regions
    return RegionsExplanation(collect_regions(model, inputs, kwargs, backend, label=_label(model),
                                              cause=cause))


@dataclass
class RegionsExplanation:
    """`fusec.explain` of a program in regions: the regions and breaks, then each region's
    Explanation (forward program, and backward program when one was compiled)."""

    regions: "Regions"  # noqa: F821 (fusec.breaks.Regions)

    def explanations(self) -> list[tuple]:
        """(region, [Explanation of each compiled part]) for every region of the last call."""
        return [(r, [Explanation(cg) for cg in r.compiled_graphs])
                for r in self.regions.last_call or self.regions.regions]

    @property
    def kernels(self) -> list:
        return self.regions.kernels

    def breaks(self) -> list[dict]:
        return [b.to_dict() for b in self.regions.breaks]

    def _owner(self, kernel: int | str) -> tuple["Explanation", str]:
        """The region program's Explanation that holds `kernel` (by position or name)."""
        name = self.kernels[kernel].name if isinstance(kernel, int) else kernel
        for _, parts in self.explanations():
            for e in parts:
                if any(k.name == name for k in e.kernels):
                    return e, name
        raise FusecError(f"fusec: no kernel named {kernel!r}; the kernels are "
                         f"{', '.join(k.name for k in self.kernels) or 'none'}")

    def optimized_ir(self, kernel: int | str = 0) -> str:
        e, name = self._owner(kernel)
        return e.optimized_ir(name)

    def assembly(self, kernel: int | str = 0, target: str | None = None) -> str:
        e, name = self._owner(kernel)
        return e.assembly(name, target)

    def dot(self, stage: str = "after") -> str:
        raise FusecError("fusec: graph pictures are drawn per region: "
                         "e.explanations()[i][1][0].dot(stage) for region i's program")

    def svg(self, stage: str = "after") -> str | None:
        return self.dot(stage)

    def to_dict(self) -> dict:
        return {"label": self.regions.label, "backend": self.regions.backend,
                "breaks": self.breaks(),
                "cause": ({"reason": self.regions.cause.reason, "where": self.regions.cause.where}
                          if self.regions.cause is not None else None),
                "regions": [{"index": r.index, "function": r.function, "span": r.span(),
                             "lines": [str(f) for f in r.lines()],
                             "ended_by": r.ended_by.to_dict() if r.ended_by else None,
                             "kernels": [k.name for k in r.kernels],
                             "programs": [e.to_dict() for e in parts]}
                            for r, parts in self.explanations()]}

    def __str__(self) -> str:
        out = ["fusec explain (graph breaks): " + self.regions.summary()]
        for region, parts in self.explanations():
            out.append(f"\n##### {region.title()} #####")
            out.append("Dynamo's graph (torch ops, with your lines):\n" + region.listing())
            for name, e in zip(("forward", "backward"), parts):
                text = str(e).replace("fusec explain", f"region {region.index}, {name} program", 1)
                out.append("\n" + text)
            if region.ended_by is not None:
                out.append("\n" + "\n".join(region.ended_by.describe()))
        return "\n".join(out)

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def unwrap(model, backend: str):
    """The plain function or module behind a fusec.compile wrapper, and the backend to use."""
    from .api import CompiledFunction, CompiledModule
    if isinstance(model, CompiledModule):
        backend = model._compiled.backend if backend == "auto" else backend
        model = model._orig_mod
    if isinstance(model, CompiledFunction):
        backend = model.backend if backend == "auto" else backend
        model = model.fn
    return model, backend


def capture_for(model, inputs: tuple, kwargs: dict, backend: str):
    """Pick the backend for the inputs' device and capture with source lines recorded."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    chosen = resolve_backend(backend, device)
    if chosen == "triton":
        _prepare_triton(device)
    with torch.no_grad():
        captured = capture(model, inputs, kwargs, stack_traces=True)
    return captured, chosen


def _label(model) -> str:
    from .api import _label as label
    return label(model)
