"""The captured graph as a reader wants it: one row per value, with its dtype, shape, the op that
computes it, what kind of op that is, and the user's source line that produced it.

`graph_listing(gm)` is the first section of `fusec.explain` and what `FUSEC_LOG=graph` prints;
`node_rows(gm)` is the same as data; `user_line(node)` is the `file:line  code` of a node.
"""
from __future__ import annotations

import os
import re

import torch
import torch.fx as fx

from fusec import ops
from fusec.ir import TensorMeta, contiguous_strides, short_dtype
from fusec.passes.grouping import is_cat


# ---- source lines ---------------------------------------------------------------------------------

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')


def user_frames(node: fx.Node) -> list[dict]:
    """The user's stack frames (outermost first) recorded for `node` while tracing, without
    frames inside torch or fusec. Empty when the graph was captured without stack traces."""
    trace = node.meta.get("stack_trace") or ""
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
    return f"{os.path.basename(f['file'])}:{f['line']}  {f['code']}"


# ---- the captured graph ---------------------------------------------------------------------------

def meta_str(m) -> str:
    if isinstance(m, TensorMeta):
        text = str(m)
        if m.stride != contiguous_strides(m.shape) and m.numel > 1:
            text += f" stride={m.stride}"
        return text
    if isinstance(m, tuple):
        return "(" + ", ".join(meta_str(x) for x in m) + ")"
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
    if node.op != "call_function":
        return node.op
    if node.target.__name__ == "getitem":
        return "getitem"
    reduction = getattr(ops, "reduction", None)
    if reduction is not None and reduction(node) is not None:
        return "reduction"
    if is_cat(node):  # a concatenation a kernel does (its pieces read where they lie)
        return ops.POINTWISE
    kind = ops.classify(node.target)
    if kind == ops.POINTWISE and ops.normalize(node) is None:
        return "extern"
    return kind


def node_rows(gm: fx.GraphModule) -> list[dict]:
    """One dict per node of a (captured) graph: name, kind, op, args, dtype/shape, source line."""
    rows = []
    for node in gm.graph.nodes:
        row = {"name": node.name, "op": node.op, "value": meta_str(node.meta.get("fusec")),
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


def group_members(sub: fx.GraphModule) -> list[fx.Node]:
    """The ATen nodes a fused group's sub-GraphModule computes, in order."""
    return [n for n in sub.graph.nodes if n.op == "call_function"]


def distinct_lines(nodes: list[fx.Node]) -> list[str]:
    """The user's source lines of `nodes` (`user_line`), each once, in order."""
    lines: list[str] = []
    for n in nodes:
        line = user_line(n)
        if line and line not in lines:
            lines.append(line)
    return lines
