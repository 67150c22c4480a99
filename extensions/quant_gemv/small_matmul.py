"""Small-M matmuls with a dequantized weight become reductions: the GEMV of LLM decoding.

Decoding one token multiplies a handful of activation rows (M = batch size, often 1) by every
weight matrix: out[m, n] = sum_k x[m, k] * W[n, k]. Each weight is used M times, so the time is
the weight's bytes over the memory bandwidth. Storing weights as int8 (or two 4-bit values per
byte) halves (or quarters) those bytes, but only if the kernel reads the *quantized* weight:

    _to_copy = _to_copy(w, dtype=bf16)        # int8 -> bf16: writes a full bf16 copy of W ...
    permute  = permute(_to_copy, [1, 0])
    mm       = mm(x, permute)                 # ... which the library matmul then reads again
    mul      = mul(mm, s)                     # per-channel scale: one more kernel

Three steps and three times the bytes. This pass writes the product as what it is, a sum over K
of element-wise products, so the passes after it can fuse everything into one reduction kernel:
the dequantization becomes its *prologue* (computed in registers from the int8 bytes), the
scale, bias, activation and residual its *epilogue*:

    before                                    after
    mm = mm(x, permute(w_bf16, [1, 0]))       x3   = unsqueeze(x, 1)                  # (M, 1, K)
                                              xf   = _to_copy(x3, dtype=f32)
                                              wf   = _to_copy(w_bf16, dtype=f32)       # (N, K)
                                              prod = mul(xf, wf)                       # (M, N, K)
                                              acc  = sum(prod, [2])                    # (M, N)
                                              mm   = _to_copy(acc, dtype=bf16)

(`prod` is never stored: fuse_reductions puts it, the sum and the dequantization in one kernel,
and codegen renders that kernel as a GEMV: each program owns a block of output columns and walks
K.) Products and the sum are computed in float32 (float64 for float64 inputs) and rounded once at
the end, as the library matmul does, so the result is as accurate as eager's.

Packed int4 weights are unpacked with `stack([lo, hi], -1).view(N, K)`, a `cat` that no kernel
can read through. The product distributes over it: with x seen as (M, 1, K/2, 2),
x @ W.T = sum_j x[..., j, 0] * lo[n, j] + x[..., j, 1] * hi[n, j], so the pass sums the two
products instead, and the nibbles are unpacked in registers too. A weight viewed from a grouped
shape (N, K/G, G), as per-group scales need, is handled the same way: x is viewed as
(M, 1, K/G, G) and the sum runs over the last two dims.

The pass rewrites `mm(x, B)` and `addmm(bias, x, B)` when
* M (x's rows) is at most SMALL_M: a larger batch reads each weight element from cache several
  times, where the library's tiled GEMM (tensor cores) wins;
* B is *computed* (a dequantization, a cast) rather than a stored weight: for a plain weight the
  library GEMV already streams it once at full speed, and there is no prologue to fuse (except a
  bf16/fp16 weight at M = 1 on a GPU, where fusec's GEMV measured faster: STORED_GEMV_DEVICES);
* the dtype is floating point and nothing is empty.
Every decision, taken or declined, is recorded with its reason in
`record_of(gm).extensions["small_matmul"]` (a `Decision(node, taken, why)`, fusec/record.py) and
printed by `fusec.explain` in DECISION_WORDS.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fusec import ops
from fusec.record import Decision
from fusec.symbolic import is_symbolic

from . import packed_chunks, refine_views
from fusec.passes.grouping import new_node, record_decisions, val

aten = torch.ops.aten

# At most this many activation rows: a decode step's batch. On a GPU 16, the most rows its
# kernel pads to: at M = 16 the Triton GEMV (tensor-core dots from M = 2 on) measured two to
# three times as fast as dequantizing for the library matmul on an H200
# (`python benchmarks/quant_linear.py --sweep`; docs/performance.md).
# The CPU kernels read the weight row once per output (M times), so there it stays at 8.
SMALL_M = 8
SMALL_M_GPU = 16

# A stored bf16/fp16 weight at M = 1 on these devices becomes a GEMV too: with the weight's loads
# marked evict_first, the Triton GEMV streams a bf16 weight at 3.24 TB/s where cuBLAS's reaches
# 2.99-3.04 on an H200 (diagnostics/gemv_variants.py). On a CPU the library wins.
STORED_GEMV_DEVICES = ("cuda",)

# A weight packed along N (AWQ) is computed with its columns in parts, (N/8, 8) (refine_views.py).
# Without the tensor-core kernel for such words (triton_gemv_packed_mma.py, sm_80+) the generic
# GEMV beat dequantizing for the library matmul up to M = 4 only (diagnostics/awq_shapes.py); with
# it, every SMALL_M_GPU row (docs/performance.md). On a CPU the GEMV keeps all SMALL_M rows.
SPLIT_COLUMNS_MAX_M = 4
SPLIT_COLUMNS_LIMITED = ("cuda",)  # the devices where that limit applies
SPLIT_DECLINED = "a weight packed along N"  # (how that decision's reason starts)

_MATMULS = (aten.mm.default, aten.addmm.default)

# The GEMV's sum in kernel names (passes/grouping.py, kernel_name): `fused_dequant_gemv_mul_0`
GEMV_NAME = {"name": "gemv", "prologue": "dequant"}
# Why split_reductions and fuse_reductions' few-long-rows rule leave a GEMV over a weight stored
# N-contiguous alone (fuse_reductions.spread_columns): a column reduction to them, whose kernel
# takes only as many neighbouring columns per program as keep every SM busy. (GPTQ's int4 weight
# at K = N = 8192, M = 1 on an H200: 0.185 ms split in two reductions, the product stored whole
# first as an extern's operand before.)
SPREADS_COLUMNS = ("a GEMV's sum (extensions/quant_gemv/small_matmul.py): its kernel spreads "
                   "them over the GPU itself (extensions/quant_gemv/triton_gemv.py, "
                   "gemv_blocks_n_major)")

# explain's words for the decisions (fusec/inspect/changes.py): the summary, a taken one, a kept one
DECISION_WORDS = ("{n} matmul(s) rewritten as GEMV reductions", "GEMV", "library matmul")
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)


def small_matmul(gm: fx.GraphModule) -> fx.GraphModule:
    decisions: list[Decision] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        plan, reason = _plan(node)
        if plan is not None:
            _rewrite(gm.graph, node, plan)
        elif reason.startswith(SPLIT_DECLINED):
            _dequantize_in_one_kernel(node)
        decisions.append(Decision(node.name, plan is not None, reason))
    if any(d.why.startswith(SPLIT_DECLINED) for d in decisions):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return record_decisions(gm, "small_matmul", decisions)


def _dequantize_in_one_kernel(node: fx.Node) -> None:
    """For the library matmul: the weight packed along N computed in its fine shape
    (extensions/quant_gemv/refine_views.py), then viewed as (K, N), so that one kernel writes it (its reshapes
    would each store a copy, and repeat_interleave's scales and zero points a full-size one)."""
    b = node.args[-1]
    fine = refine_views.refine_weight(node.graph, b, n_first=False)
    with node.graph.inserting_before(node):
        view = node.graph.call_function(aten.view.default, (fine, list(val(b).shape)))
    view.meta.update({k: b.meta[k] for k in ("val", "fusec") if k in b.meta})
    node.replace_input_with(b, view)


def _plan(node: fx.Node):
    """(plan, reason): how to rewrite `node` as a reduction, or None and why it stays a call to
    the matrix library."""
    if node.target is aten.addmm.default:
        if len(node.args) > 3 or any(v != 1 for v in node.kwargs.values()):
            return None, "addmm with beta or alpha != 1: library matmul"
        bias, x, b = node.args[:3]
    else:
        (x, b), bias = node.args[:2], None
    out, xv, bv = val(node), val(x), val(b)
    if not all(isinstance(t, torch.Tensor) for t in (out, xv, bv)):
        return None, "operands without shapes: library matmul"
    if bias is not None and not isinstance(val(bias), torch.Tensor):
        return None, "a scalar bias: library matmul"
    (m, k), n = xv.shape, bv.shape[1]
    if is_symbolic((m, k, n)):  # (a shape family's: 1 row is a program of its own)
        return None, "sizes are symbols (a shape family): library matmul"
    if not out.dtype.is_floating_point or m == 0 or n == 0 or k == 0:
        return None, (f"{out.dtype} matmul: library matmul" if not out.dtype.is_floating_point
                      else "an empty operand: library matmul")
    small = SMALL_M_GPU if out.device.type == "cuda" else SMALL_M
    if m > small:
        return None, (f"M = {m} rows > {small}: a tiled library GEMM reuses each weight "
                      "element across rows; kept")
    weight = _strip_views(b)
    # stored weights read where they lie as pieces of one (extensions/quant_gemv/sibling_gemvs.py)
    stored = weight.op in ("placeholder", "get_attr") or bool(weight.meta.get("fusec_pieces"))
    if stored and not (m == 1 and out.device.type in STORED_GEMV_DEVICES
                       and bv.dtype in (torch.bfloat16, torch.float16)):
        return None, (f"M = {m}, but the weight {weight.name} is read as stored (nothing to "
                      "dequantize): the library GEMV streams it once already; kept")
    if not stored and ops.classify(weight.target) != ops.POINTWISE and not _stacked(weight):
        return None, (f"M = {m}, but the weight comes from {weight.target} (not a "
                      "dequantization a kernel can compute): library matmul")
    if _columns_limited(out.device) and m > SPLIT_COLUMNS_MAX_M and _split_columns(b):
        return None, (f"{SPLIT_DECLINED} (its columns in parts) at M = {m} > "
                      f"{SPLIT_COLUMNS_MAX_M}: dequantized once by one kernel, then the library "
                      "matmul, which measured faster on a GPU from M = 8 on "
                      "(SPLIT_COLUMNS_MAX_M)")
    plan = _layout_plan(x, b)
    if plan is None:
        return None, (f"M = {m}, but x {tuple(xv.shape)} cannot be viewed in the weight's "
                      "grouped shape: library matmul")
    plan["bias"] = bias
    if weight.meta.get("fusec_pieces"):
        return plan, (f"M = 1 and the weight is the stored {bv.dtype} matrices "
                      f"{', '.join(w.name for w in weight.args[0])}, each read where it lies: "
                      "one GEMV over all of them (extensions/quant_gemv/sibling_gemvs.py)")
    if stored:
        return plan, (f"M = 1 and the weight {weight.name} is a stored {bv.dtype} matrix on a "
                      "GPU: fusec's GEMV streams it faster than the library's (3.24 against "
                      "3.0 TB/s on an H200, K = N = 8192), and what follows becomes its epilogue")
    what = "packed nibbles unpacked, " if plan["parts"] and len(plan["parts"]) > 1 else ""
    if plan["refined"]:
        cols = plan.get("outer", (n,))
        what = (f"its reshapes undone by computing it as {tuple(plan['inner'])} x "
                f"{cols[0] if len(cols) == 1 else tuple(cols)} (extensions/quant_gemv/refine_views.py), ")
    return plan, (f"M = {m} <= {small} and the weight is computed ({what}dequantized from "
                  f"{_roots(weight)}): a GEMV reduction over K = {k} that reads the quantized "
                  "weight once, with the dequantization as its prologue and what follows as "
                  "its epilogue")


def _strip_views(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and ops.classify(n.target) == ops.VIEW:
        n = n.args[0]
    return n


def _stacked(n: fx.Node) -> bool:
    """cat([unsqueeze(a, -1), unsqueeze(b, -1), ...], -1): torch.stack(..., dim=-1)."""
    return _stack_parts(n) is not None


def _stack_parts(n: fx.Node):
    if n.op != "call_function" or n.target is not aten.cat.default:
        return None
    tensors, dim = n.args[0], (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0))
    rank = val(n).dim()
    if dim % rank != rank - 1 or len(tensors) < 2:
        return None
    parts = []
    for t in tensors:
        if not (isinstance(t, fx.Node) and t.op == "call_function" and
                t.target is aten.unsqueeze.default and t.args[1] % rank == rank - 1):
            return None
        parts.append(t.args[0])
    return parts


def _roots(n: fx.Node) -> str:
    """The graph inputs a weight is computed from: 'w', or 'P, sg, z'."""
    seen, stack, roots = set(), [n], []
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op in ("placeholder", "get_attr"):
            roots.append(a.name)
        stack += list(a.all_input_nodes)
    return ", ".join(sorted(roots)) or "constants"


def _layout_plan(x: fx.Node, b: fx.Node):
    """How the product lines up: {"mode": "nk", "inner": dims of K, "parts": weight values} or
    {"mode": "kn", "inner": dims of K, "weight": value}. "nk": b is W.t() for a weight W (N, K)
    (nn.Linear), possibly a view of W3 (N, *inner) or of a stack of parts (N, *inner[:-1]) along
    a last dim; the sum runs over the inner dims. "kn": b (K, N) itself (x @ W), or a view of
    W3 (*inner, *outer), with "outer" N's dims: (N,), or (N/8, 8) for a weight packed along N. A
    weight whose dequantization reshapes computed tensors on the way is first computed in the
    shape that refines all of them (extensions/quant_gemv/refine_views.py); "refined" says so."""
    bv = val(b)
    k, n = bv.shape
    if b.op == "call_function" and b.target in _TRANSPOSES and _is_transpose(b):
        w = b.args[0]
        inner, parts, refined = (k,), [w], False
        if w.op == "call_function" and w.target in _RESHAPES:
            src = w.args[0]
            sv = val(src)
            if sv is not None and sv.dim() >= 3 and sv.shape[0] == n and \
                    math.prod(sv.shape[1:]) == k and ops.classify(getattr(src, "target", None)) \
                    != ops.VIEW and src.op == "call_function":
                stacked = _stack_parts(src)
                inner, parts = tuple(sv.shape[1:]), ([src] if stacked is None else stacked)
        if any(refine_views.needs_refining(p) for p in parts):
            dims = refine_views.refined_dims(w, n_first=True)
            dims = dims and dims[0]
            if dims is not None and _views_as(x, [1, *dims]):
                parts, inner = [refine_views.refine_weight(b.graph, w, n_first=True)], tuple(dims)
                refined = True
        if not _views_as(x, [1, *inner]):
            return None
        return {"mode": "nk", "inner": inner, "parts": parts, "refined": refined}
    weight, inner = b, (k,)
    dims = refine_views.refined_dims(b, n_first=False) if refine_views.needs_refining(b) else None
    outer = (n,)
    if dims is not None and _views_as(x, [*dims[0], 1]):
        weight, inner, outer = refine_views.refine_weight(b.graph, b, n_first=False), *dims
    if not _views_as(x, [*inner, 1]):
        return None
    return {"mode": "kn", "weight": weight, "inner": inner, "outer": outer, "parts": None,
            "refined": weight is not b}


def _columns_limited(device: torch.device) -> bool:
    """Whether SPLIT_COLUMNS_MAX_M applies on `device`: one of SPLIT_COLUMNS_LIMITED, and not a
    GPU where the tensor-core kernel for words packed along N takes every row."""
    if device.type not in SPLIT_COLUMNS_LIMITED:
        return False
    from .triton_gemv_packed_mma import packed_mma_enabled
    from .triton_gemv_int4_mma import tensor_core_arch
    return not (device.type == "cuda" and packed_mma_enabled() and tensor_core_arch(None)[0])


def _split_columns(b: fx.Node) -> bool:
    """Whether the weight b (K, N) would be computed with N cut in parts (refine_views)."""
    if not refine_views.needs_refining(b):
        return False
    dims = refine_views.refined_dims(b, n_first=False)
    return dims is not None and len(dims[1]) > 1


def _views_as(x: fx.Node, dims: list[int]) -> bool:
    """Whether x (M, K) can be viewed as (M, *dims), which costs nothing."""
    xv = val(x)
    try:
        xv.view(xv.shape[0], *dims)
    except RuntimeError:
        return False
    return True


def _reshape_adding_rows(node: fx.Node):
    """The mm's only user, if it is a view back to (*lead, N) with prod(lead) == M."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target not in _RESHAPES:
        return None
    after, out = val(users[0]), val(node)
    if isinstance(after, torch.Tensor) and after.dim() >= 2 and after.shape[-1] == out.shape[1] and \
            math.prod(after.shape[:-1]) == out.shape[0]:
        return users[0]
    return None


def _is_transpose(b: fx.Node) -> bool:
    if b.target is aten.permute.default:
        return list(b.args[1]) == [1, 0]
    if b.target is aten.transpose.int:
        return sorted(d % 2 for d in b.args[1:3]) == [0, 1]
    return True  # aten.t


def _rewrite(graph: fx.Graph, node: fx.Node, plan: dict) -> None:
    out = val(node)
    dtype = out.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = node.args[1] if node.target is aten.addmm.default else node.args[0]
    m = val(x).shape[0]

    def add(target, args, kwargs=None, gemv=None, name=None):
        vals = [val(a) if isinstance(a, fx.Node) else
                ([val(t) for t in a] if isinstance(a, (list, tuple)) and a and
                 isinstance(a[0], fx.Node) else a) for a in args]
        new = new_node(graph, target, args, target(*vals, **(kwargs or {})), node,
                       f"{node.name}_{name}" if name else None, kwargs)
        if gemv is not None:  # the sum over K: what the core and this family read of it
            new.meta.update({"fusec_matmul": gemv, "fusec_name": GEMV_NAME,
                             "fusec_split_rule": packed_chunks.split_rule,
                             "fusec_spreads_columns": SPREADS_COLUMNS})
        return new

    def cast(v, name):
        return v if val(v).dtype == acc else add(aten._to_copy.default, (v,), {"dtype": acc},
                                                  name=name)

    # F.linear on a (B, T, K) input is view(mm(view(x, (B*T, K)), W.t()), (B, T, N)): compute in
    # the (B, T, N) space directly, so that the pointwise work after the view joins the epilogue
    after = _reshape_adding_rows(node)
    bias = plan["bias"]
    if bias is not None and val(bias).dim() == 2 and val(bias).shape[0] != 1:
        after = None  # a full (M, N) bias lines up with (M, N), not with (B, T, N)
    lead = list(val(after).shape[:-1]) if after is not None else [m]
    try:
        val(x).view(*lead, *([1, *plan["inner"]] if plan["mode"] == "nk" else [*plan["inner"], 1]))
    except RuntimeError:  # x's rows cannot be split that way: stay in (M, N), view after
        after, lead = None, [m]
    with graph.inserting_before(node):
        if plan["mode"] == "nk":
            inner, parts = plan["inner"], plan["parts"]
            x3 = add(aten.view.default, (x, [*lead, 1, *inner]), name="x")
            if len(parts) == 1:
                terms = [add(aten.mul.Tensor, (cast(x3, "xf"), cast(parts[0], "wf")), name="prod")]
            else:  # x3's last dim walks the stacked parts: one product per part
                terms = [add(aten.mul.Tensor, (cast(add(aten.select.int, (x3, -1, i), name=f"x{i}"),
                                                    f"xf{i}"), cast(p, f"wf{i}")), name=f"prod{i}")
                         for i, p in enumerate(parts)]
            total = terms[0]
            for t in terms[1:]:
                total = add(aten.add.Tensor, (total, t), name="prods")
            dims = list(range(len(lead) + 1, val(total).dim()))
        else:  # (..., *inner, 1) times b (*inner, N): inner is (K,) unless refined
            inner = plan["inner"]
            x3 = add(aten.view.default, (x, [*lead, *inner, *[1] * len(plan["outer"])]), name="x")
            total = add(aten.mul.Tensor, (cast(x3, "xf"), cast(plan["weight"], "wf")), name="prod")
            dims = list(range(len(lead), len(lead) + len(inner)))
        k = val(x).shape[1]
        n = out.shape[1]
        info = {"m": m, "n": n, "k": k, "dtype": dtype}
        result = add(aten.sum.dim_IntList, (total, dims), gemv=info, name="gemv")
        cols = list(plan.get("outer", (n,)))  # N computed in parts (a weight packed along N)
        if plan["bias"] is not None:
            # float32 + bfloat16 promotes to float32: the bias is added before the one rounding
            # (a cast node here would be a per-element value in the kernel, not a per-row one)
            bias = plan["bias"]
            if len(cols) > 1:
                bias = add(aten.view.default, (bias, [*val(bias).shape[:-1], *cols]), name="bias_cols")
            result = add(aten.add.Tensor, (result, bias), name="bias")
        if dtype != acc:
            result = add(aten._to_copy.default, (result,), {"dtype": dtype}, name="out")
        if len(cols) > 1:  # the columns as one dim again: a view of the stored result
            result = add(aten.view.default, (result, [*lead, n]), name="cols")
    if after is not None:
        after.replace_all_uses_with(result)
        graph.erase_node(after)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
