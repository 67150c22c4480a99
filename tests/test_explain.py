"""fusec.explain: the captured graph with shapes and source lines, what each pass changed, the
fusion groups with bytes counted from the kernel IR, the extern calls and why, DOT pictures,
to_dict(); and the `fusec explain | kernels` commands on every example."""
import json
import re
import shutil
import subprocess

import pytest
import torch

import fusec
from fusec.cli import main as cli
from fusec.explain import distinct_elements, kernel_traffic

EXAMPLES = ["sin4", "add_mul", "maximum_neg_uint8", "strided", "softmax", "layernorm", "gelu_mlp",
            "gpt2_block"]


def with_fallbacks(x, w):
    y = torch.sin(x) * 2
    dead = torch.cos(x)  # noqa: F841  (dce removes it)
    z = y @ w
    return torch.cumsum(z, 0) + 1


def explain_fallbacks(backend="cpp", device="cpu"):
    x, w = torch.randn(8, 16, device=device), torch.randn(16, 4, device=device)
    return fusec.explain(with_fallbacks, x, w, backend=backend)


def test_fallbacks_are_named_with_reasons(target):
    backend, device = target
    e = explain_fallbacks(backend, device)
    text = str(e)
    assert "2 extern call(s)" in text.splitlines()[0]
    assert "extern (eager ATen) calls: aten.mm.default, aten.cumsum.default" in text
    fb = {f["op"]: f for f in e.to_dict()["fallbacks"]}
    assert set(fb) == {"aten.mm.default", "aten.cumsum.default"}
    assert "matrix product" in fb["aten.mm.default"]["reason"]
    assert "not in the op table" in fb["aten.cumsum.default"]["reason"]
    assert fb["aten.mm.default"]["line"].startswith("test_explain.py:")
    assert "z = y @ w" in fb["aten.mm.default"]["line"]
    assert fb["aten.mm.default"]["reads"] == ["mul", "w"]
    # and the program it explains still runs and matches eager
    x, w = torch.randn(8, 16, device=device), torch.randn(16, 4, device=device)
    cf = fusec.compile(with_fallbacks, backend=backend)
    torch.testing.assert_close(cf(x, w), with_fallbacks(x, w))


def test_captured_graph_is_readable():
    x = torch.randn(16, 8)
    e = fusec.explain(lambda x: torch.sin(x.t()) + 1, x, backend="cpp")
    listing = e.graph()
    lines = {line.split()[0]: line for line in listing.splitlines()[1:] if line.startswith("  ")}
    assert re.search(r"x\s+f32\[16, 8\]", lines["x"])
    # a non-contiguous value shows its strides; every op its kind and source line
    assert "f32[8, 16] stride=(1, 8)" in lines["permute"] and "view" in lines["permute"]
    assert "= sin(permute)" in lines["sin"] and "pointwise" in lines["sin"]
    assert "test_explain.py:" in lines["sin"] and "torch.sin(x.t()) + 1" in lines["sin"]
    assert listing.splitlines()[-1] == "outputs: add"
    rows = {r["name"]: r for r in e.to_dict()["graph"]}
    assert rows["sin"]["kind"] == "pointwise" and rows["sin"]["value"].startswith("f32[8, 16]")


def test_what_each_pass_changed():
    e = explain_fallbacks()
    passes = {p["after"]: p for p in e.to_dict()["passes"]}
    assert list(passes)[:22] == ["capture", "inline_sizes", "picks", "fold_constants",
                                "constant_gathers", "check_gathers", "check_divisors", "dce", "cse", "canonicalize", "simplify", "filled_slices", "computed_pieces", "reinplace",
                                "unfuse_bias", "sibling_gemvs", "small_matmul", "pad_matmul", "pooling",
                                "layout", "move_permutes", "split_reductions"]
    assert "ATen op(s)" in passes["capture"]["summary"]
    assert passes["dce"]["summary"] == "removed 1 node(s)"
    assert "cos" in passes["dce"]["details"][0]
    assert "formed 2 group(s)" in passes["fuse_pointwise"]["summary"]
    assert any(d.startswith("fused_sin_mul_0: sin, mul") for d in passes["fuse_pointwise"]["details"])
    assert "4 step(s): 2 kernel launch(es), 2 extern call(s)" in passes["schedule"]["summary"]
    text = str(e)
    assert "=== graph after dce === (removed 1 node(s))" in text
    assert "dce removed: cos" in text
    assert "fusion refused:" in text and "cumsum -> add" in text


def test_groups_table_counts_bytes_from_the_ir():
    x, b = torch.randn(64, 8), torch.randn(8)
    e = fusec.explain(lambda x, b: torch.relu(x * b) + b, x, b, backend="cpp")
    (g,) = e.groups()
    assert g["name"] == "fused_mul_relu_add_0"
    assert g["inputs"] == ["x f32[64, 8]", "b f32[8]"]
    assert g["outputs"] == ["add f32[64, 8]"]
    # b is broadcast over 64 rows: its 8 distinct elements are read, not 512
    assert g["read_bytes"] == 64 * 8 * 4 + 8 * 4
    assert g["write_bytes"] == 64 * 8 * 4
    loads = {l["param"]: l for l in g["loads"]}
    assert loads["b"]["broadcast"] and loads["b"]["elements"] == 8
    table = str(e).split("=== fusion groups ===")[1]
    assert "fused_mul_relu_add_0" in table and "2.08 KB" in table and "2.05 KB" in table


def test_bytes_for_views_and_small_dtypes():
    from fusec.demo import load_example
    ex = load_example("maximum_neg_uint8").example()
    (g,) = fusec.explain(ex.fn, *ex.inputs, backend="cpp").groups()
    assert g["read_bytes"] == 8 + 8390 * 8  # the (1, 8) row once, the (8390, 8) input once
    assert g["write_bytes"] == 8390 * 8
    ex = load_example("strided").example(n=64)
    (g,) = fusec.explain(ex.fn, *ex.inputs, backend="cpp").groups()
    assert g["read_bytes"] == 2 * 64 * 64 * 4  # x.t() whole, every other column of y
    assert g["write_bytes"] == 64 * 64 * 4


def test_distinct_elements():
    assert distinct_elements((4, 8), (8, 1)) == 32
    assert distinct_elements((4, 8), (0, 1)) == 8
    assert distinct_elements((4, 8), (0, 0)) == 1
    cf = fusec.compile(lambda x: x * 2, backend="cpp")
    cf(torch.randn(10))
    t = kernel_traffic(cf.kernels[0].ir)
    assert (t["read_bytes"], t["write_bytes"], t["flops"]) == (40, 40, 10)


def test_to_dict_is_plain_data():
    d = explain_fallbacks().to_dict()
    assert {"backend", "graph", "stages", "passes", "removed_by_dce", "refusals", "groups",
            "kernels", "externs", "fallbacks", "schedule", "dot"} <= set(d)
    assert d["removed_by_dce"] == ["cos"]
    assert [g["name"] for g in d["groups"]] == [k["name"] for k in d["kernels"]]
    json.loads(json.dumps(d))


def check_dot(text: str, name: str) -> dict:
    """Structural checks of our DOT output: header, balanced braces, every edge between
    declared nodes, every statement terminated."""
    assert text.startswith(f"digraph {name} {{") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    declared = set(re.findall(r"^\s*(n\d+) \[", text, re.M))
    edges = re.findall(r"^\s*(n\d+) -> (n\d+)", text, re.M)
    assert edges and all(a in declared and b in declared for a, b in edges)
    for line in text.splitlines()[1:-1]:
        s = line.strip()
        assert s.endswith((";", "{", "}")), line
    return {"nodes": declared, "edges": edges,
            "clusters": re.findall(r"subgraph (cluster_\d+)", text)}


def test_dot_before_and_after_fusion():
    e = explain_fallbacks()
    before = check_dot(e.dot("before"), "before_fusion")
    after = check_dot(e.dot("after"), "after_fusion")
    kernels = [k.name for k in e.compiled.kernels]
    assert len(before["clusters"]) == len(kernels)
    for k in kernels:
        assert f'label="{k}"' in e.dot("before") and k in e.dot("after")
    for text in (e.dot("before"), e.dot("after")):
        assert text.count("shape=octagon") == 2  # mm and cumsum are marked as extern calls
        assert "extern mm" in text and "extern cumsum" in text
    assert "(removed by dce)" in e.dot("before")
    with pytest.raises(ValueError):
        e.dot("during")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_dot_parses_with_graphviz():
    e = explain_fallbacks()
    for stage in ("before", "after"):
        out = subprocess.run(["dot", "-Tplain"], input=e.dot(stage), capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert e.svg(stage).startswith("<svg")


def test_svg_is_none_without_graphviz(monkeypatch):
    import fusec.graphviz as gv
    monkeypatch.setattr(gv.shutil, "which", lambda name: None)
    assert gv.render_svg("digraph { a -> b; }") is None


def test_explain_a_compiled_module():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x)) * 2

    m = fusec.compile(M(), backend="cpp")
    e = fusec.explain(m, torch.randn(4, 8))
    d = e.to_dict()
    assert d["backend"] == "cpp"
    assert [f["op"] for f in d["fallbacks"]] == ["aten.mm.default"]  # its bias: in the kernel
    # a module's lines come from its forward, not from torch.nn
    assert all("test_explain.py" in g["lines"][0] for g in d["groups"])


@pytest.mark.parametrize("name", EXAMPLES)
def test_cli_explain_and_kernels_on_every_example(name, capsys):
    from fusec.demo import load_example
    expect = load_example(name).example().expect_kernels
    assert cli(["explain", name, "--backend", "cpp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fusec explain (cpp backend)")
    n = out.count("\n=== kernel ")
    assert n == expect if expect is not None else n >= 1
    assert f"{n} kernel(s)" in out.splitlines()[0]
    assert cli(["kernels", name]) == 0
    out = capsys.readouterr().out
    assert out.count("# ===== fused_") == n and 'extern "C"' in out


def test_cli_explain_json_and_dot(tmp_path, capsys):
    assert cli(["explain", "strided", "--json", "--dot", str(tmp_path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in d["kernels"]] == ["fused_tanh_mul_add_0"]
    check_dot((tmp_path / "graph_before_fusion.dot").read_text(), "before_fusion")
    check_dot((tmp_path / "graph_after_fusion.dot").read_text(), "after_fusion")


def test_cli_example_without_entry_point(tmp_path, capsys):
    bad = tmp_path / "no_entry.py"
    bad.write_text("import torch\n\ndef f(x):\n    return x + 1\n")
    assert cli(["explain", str(bad)]) == 1  # (naming the function works: tests/test_cli.py)
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "defines neither example() nor Model" in message
