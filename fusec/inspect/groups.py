"""What fusion made: the groups as a table with the bytes each kernel reads and writes (counted
from the kernel IR: `kernel_traffic`), the merges fusion refused and why, and every extern
step (an eager ATen call between kernels) with the reason it is not a kernel.
"""
from __future__ import annotations

from math import prod

import torch
import torch.fx as fx

from fusec.symbolic import hint
from fusec import ops
from fusec.ir import short_dtype
from fusec.record import group_info
from fusec.record import record_of

from fusec.inspect.listing import meta_str, distinct_lines, group_members, user_line


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
    n = hint(n)  # (a shape family's: at the size it was traced with)
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
        g = group_info(node)
        sub = getattr(gm, node.target)
        members = group_members(sub)
        lines = distinct_lines(members)
        row = {"name": node.target, "kind": g.kind if g else "pointwise",
               "ops": [str(n.target).replace("aten.", "") for n in members],
               "nodes": [n.name for n in members],
               "inputs": [_io(a) for a in node.args],
               "outputs": [_io(u) for u in sorted(node.users, key=lambda u: u.args[1])],
               "shape": list(g.shape if g else ()), "lines": lines,
               "read_bytes": None, "write_bytes": None, "flops": None}
        k = by_name.get(node.target)
        if k is not None:
            t = kernel_traffic(k.ir)
            row.update(read_bytes=t["read_bytes"], write_bytes=t["write_bytes"], flops=t["flops"],
                       loads=t["loads"], stores=t["stores"])
        rows.append(row)
    return rows


def _io(node: fx.Node) -> str:
    return f"{node.name} {meta_str(node.meta.get('fusec'))}".strip()


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
    return [dict(vars(r)) for r in record_of(gm).refusals]


def format_refusals(gm: fx.GraphModule) -> str:
    refusals = refusal_dicts(gm)
    return "fusion refused:" + ("".join(
        f"\n  {r['producer']} -> {r['consumer']}: {r['reason']}" for r in refusals) or " nothing")


# ---- externs ------------------------------------------------------------------------------------

_LIBRARY = ("mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_scaled_dot_product",
            "linear")


def extern_reason(node: fx.Node) -> str:
    """Why `node` runs as an eager ATen call instead of inside a kernel."""
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
    for step in record_of(gm).schedule:
        if step.kind != "extern":
            continue
        node = by_name[step.node]
        rows.append({"op": step.name, "node": step.node, "reason": extern_reason(node),
                     "line": user_line(node), "reads": list(step.reads),
                     "writes": list(step.writes)})
    return rows
