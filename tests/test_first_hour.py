"""A user's first hour with fusec (issue 52): each thing a newcomer tripped on, as they typed it.

    check=True on a non-tensor output crashed (`'float' object has no attribute 'shape'`), and on
    train-mode dropout failed with a mismatch that did not say the cause was random numbers;
    `fusec run /tmp/nosuch.py` ended in `ModuleNotFoundError: 'fusec.examples./tmp/nosuch'`;
    the CLI took only files defining example(); `fusec kernels sin4 | head -1` ended in a
    BrokenPipeError traceback; `print(cf.breaks)` showed `<... GraphBroken object at 0x...>`;
    `cf.kernels` was silently `[]` before the first call; `import fusec` took 2.6-4 s and
    `fusec --help` 3.8 s (now neither imports torch: fusec/__init__.py's "lazy face").

Deeper tests of the same code: tests/test_check.py (every backend, the comparison rules) and
tests/test_cli.py (KernelBench files, --dot without Graphviz, progress bars).
"""
import collections
import math
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
from torch import nn

import fusec
from fusec import check
from fusec.cli import main as cli
from fusec.load import parse_inputs

Pair = collections.namedtuple("Pair", "value weight")


# ---- check=True on any output ---------------------------------------------------------------------
def test_check_with_a_number_among_the_outputs():
    x = torch.randn(4)
    y, half = fusec.compile(lambda x: (x.sin() * 2, 0.5), check=True)(x)
    torch.testing.assert_close(y, x.sin() * 2)
    assert half == 0.5


@pytest.mark.parametrize("program, plain", [
    (lambda x: (x.sin(), None), [None]),
    (lambda x: (x.sin(), x.shape[0]), [4]),
    (lambda x: {"y": x.cos(), "scale": 2.5, "tag": "cos", "more": [x + 1, 3]}, [2.5, "cos", 3]),
    (lambda x: Pair(x.exp(), 1.0), [1.0]),
])
def test_check_with_none_int_dict_namedtuple(program, plain):
    """Numbers, strings and None are compared by value and the structure comes back as eager's."""
    x = torch.randn(4)
    got = fusec.compile(program, check=True)(x)
    want = program(x)
    assert type(got) is type(want)
    got_leaves, want_leaves = torch.utils._pytree.tree_flatten(got), \
        torch.utils._pytree.tree_flatten(want)
    assert got_leaves[1] == want_leaves[1]  # the same structure
    assert [v for v in got_leaves[0] if not isinstance(v, torch.Tensor)] == plain
    for g, w in zip(got_leaves[0], want_leaves[0]):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)


def test_check_still_catches_a_wrong_number():
    """A plain value is judged, not waved through: a different number is a MismatchError."""
    cf = fusec.compile(lambda x: (x.sin(), 0.5), check=True)
    x = torch.randn(4)
    cf(x)
    with pytest.raises(fusec.MismatchError, match="output 1 .*0.25 where eager returns 0.5"):
        check.check_outputs(cf, cf.last, (x,), {}, [x.sin(), 0.25])
    assert math.isclose(check.TOLERANCE[torch.float32][0], 1.3e-6)


def test_check_compares_the_structure_too():
    """Eager returning another structure (here: other dict keys) is a MismatchError that says so."""
    cf = fusec.compile(lambda x: {"y": x.sin(), "n": 1}, check=True)
    x = torch.randn(4)
    out = cf(x)
    other = types.SimpleNamespace(fn=lambda x: {"y": x.sin(), "count": 1})
    said = r"output is shaped \{'y': \*, 'n': \*\}, eager's is \{'y': \*, 'count': \*\}"
    with pytest.raises(fusec.MismatchError, match=said):
        check.check_outputs(other, cf.last, (x,), {}, [out["y"], 1])


def test_check_on_train_mode_dropout():
    """The issue's repro: fusec runs dropout's random draw as the ATen call eager makes, so under
    the same generator state the masks agree: the output is compared (no warning, no mismatch)
    and is eager's own result from that seed."""
    x = torch.randn(100)
    drop = nn.Dropout(0.5).train()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusec.FusecWarning)
        y = fusec.compile(drop, check=True)(x)
    torch.manual_seed(0)
    torch.testing.assert_close(y, drop(x))
    assert 20 < int((y == 0).sum()) < 80  # it did drop


def test_an_uncomparable_random_output_names_the_users_line(monkeypatch):
    """Where random numbers cannot agree (made so here: eager's draw is shifted), the output is
    not judged, and the warning names the op and the user's line that drew it, not a bare
    'mismatch'; the other output is still compared."""
    def noisy(x):
        noise = torch.rand_like(x)  # the line the warning names
        return noise + x, x * 2

    cf = fusec.compile(noisy, check=True)
    real_set = check._set_rng_state
    calls = []

    def shifted(state):
        calls.append(1)
        real_set(state)
        if len(calls) == 1:
            torch.rand(1)
    monkeypatch.setattr(check, "_set_rng_state", shifted)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cf(torch.randn(8))
    said = [str(w.message) for w in said if issubclass(w.category, fusec.FusecWarning)]
    assert len(said) == 1, said
    assert "did not compare output 0" in said[0] and "random numbers" in said[0]
    assert "aten.rand_like.default at test_first_hour.py:" in said[0]
    assert "noise = torch.rand_like(x)" in said[0]


# ---- the CLI on any model -------------------------------------------------------------------------
MODEL_FILE = """
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.full((width,), 2.0))

    def forward(self, x):
        return torch.tanh(x) * self.scale

def get_init_inputs():
    return [32]

def get_inputs():
    return [torch.randn(4, 32)]

def gelu_sum(x):
    return torch.nn.functional.gelu(x).sum(-1)

def example_inputs():
    return (torch.randn(4, 32),)
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    return path


def run(capsys, *argv):
    assert cli([*argv, "--backend", "cpp"]) == 0
    return capsys.readouterr().out


def test_the_cli_on_a_users_file(model_file, capsys):
    """A KernelBench-style Model (built from get_init_inputs(), fed get_inputs()), a function of
    the file with the file's example_inputs(), and --inputs."""
    assert "mul" in run(capsys, "kernels", str(model_file))
    assert "gelu" in run(capsys, "explain", f"{model_file}:gelu_sum")
    out = run(capsys, "kernels", f"{model_file}:gelu_sum", "--inputs", "randn(3, 5)")
    assert "(3, 5)" in out or "3, 5" in out


@pytest.mark.parametrize("argv, said", [
    (["run", "/tmp/nosuch.py"], "fusec: no such file: /tmp/nosuch.py"),
    (["run", "{model}:nope"], "has no 'nope'"),
    (["run", "{plain}:NeedsArgs"], "NeedsArgs() needs width: define get_init_inputs()"),
    (["run", "{plain}:f"], 'has no inputs: give them with --inputs "randn(8, 64)"'),
    (["run", "{plain}:f", "--inputs", "__import__('os')"],
     "__import__() is not one of torch's tensor factories"),
])
def test_clean_one_line_errors(argv, said, model_file, capsys):
    plain = model_file.parent / "plain.py"
    plain.write_text("import torch\n\ndef f(x):\n    return x * 2\n\n"
                     "class NeedsArgs(torch.nn.Module):\n    def __init__(self, width):\n"
                     "        super().__init__()\n")
    argv = [a.format(model=model_file, plain=plain) for a in argv]
    assert cli(argv + ["--backend", "cpp"]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and "ModuleNotFoundError" not in err
    assert len(err.strip().splitlines()) == 1


def test_inputs_are_parsed_not_run():
    """--inputs allows torch's factories, dtypes, literals and a few tensor methods, nothing else."""
    a, b, c, n = parse_inputs("randn(8, 64), randint(0, 10, (8,)), "
                              "torch.ones(2, 3, dtype=bfloat16).t(), 2**3")
    assert a.shape == (8, 64) and b.dtype == torch.int64 and c.shape == (3, 2) and n == 8
    assert c.dtype == torch.bfloat16
    for bad in ("().__class__.__bases__", "open('/etc/passwd')", "torch.load('x')",
                "randn(2).numpy()", "randn(2).__class__", "9**9**9"):
        with pytest.raises(fusec.FusecError, match="is not a list of tensors"):
            parse_inputs(bad)


def test_a_closed_pipe_is_quiet():
    """`fusec kernels sin4 | head -1`, as typed in a shell."""
    done = subprocess.run(f"{sys.executable} -m fusec kernels sin4 --backend cpp | head -1",
                          shell=True, capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("# ===== fused_")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


# ---- readable objects -----------------------------------------------------------------------------
def branchy(x):
    y = x.sin()
    if y.sum() > 0:
        return y * 2
    return y - 1


def test_print_breaks_lists_regions_and_breaks():
    cf = fusec.compile(branchy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cf(torch.ones(8))
    text, short = str(cf.breaks), repr(cf.breaks)
    assert "object at 0x" not in text and "object at 0x" not in short
    assert "2 compiled region(s) with 1 graph break(s)" in text
    assert "if y.sum() > 0:" in text  # the user's line
    assert short.startswith("<fusec graph breaks of branchy: 2 region(s), 1 break(s)")
    assert "print(cf.breaks)" in repr(cf)


def test_kernels_before_the_first_call_say_why_they_are_empty():
    """Kept a list (tests and loops read `cf.kernels == []`), but printed it says why."""
    cf = fusec.compile(lambda x: x.sin())
    assert cf.kernels == [] and not cf.kernels
    assert "nothing compiled yet" in repr(cf.kernels) and "first call" in repr(cf.kernels)
    cf(torch.randn(4))
    assert repr(cf.kernels).startswith("[Kernel('fused_sin")


def test_public_objects_print_readably():
    x = torch.randn(4, 8)
    module = fusec.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    assert "not called yet" in repr(module)
    module(x)
    assert "1 kernel(s) in the last program: fused_" in repr(module) and "tanh" in repr(module)
    cf = fusec.compile(lambda x: x.sin() * 2)
    cf(x)
    explained = fusec.explain(lambda x: x.sin() * 2, x)
    assert repr(cf.last.program).startswith("<fusec Program: 1 step(s) (1 kernel(s))")
    for thing in (cf, cf.kernels[0], cf.last, cf.last.program, explained, module):
        assert "object at 0x" not in repr(thing), repr(thing)


# ---- import fusec costs nothing it does not need (fusec/__init__.py: "a lazy face") -----------------
# What is asserted is the mechanism (which modules a fresh process holds), not a time: the time
# depends on the machine's load (`python -X importtime -c "import fusec"` measures it).
def child(code: str, **env) -> str:
    """Run `code` in a fresh Python (its own import state) and return what it printed."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEC_LOG")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**base, "FUSEC_SAVED_PROGRAMS": "0", **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_fusec_and_fusec_help_import_no_torch():
    child("""
        import sys
        import fusec
        heavy = ["torch", "triton", "rich", "jinja2", "sympy", "llvmlite", "networkx", "numpy"]
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        assert fusec.FusecError.__module__ == "fusec.errors"   # the errors are there at once
        from fusec.cli import main
        try:
            main(["--help"])
        except SystemExit as done:
            assert done.code == 0
        assert "torch" not in sys.modules
    """)


def test_every_public_name_resolves_and_old_names_are_the_new_modules():
    """Each name of fusec.__all__ is the object of its home; each old module name (from before
    fusec/ had rooms) is the very module of its new home, and fusec.explain / fusec.profile stay
    the functions even after their old module names are imported."""
    child("""
        import sys
        import fusec
        homes = {"fusec.api": ["compile", "regions", "Kernel", "CompiledFunction",
                               "CompiledModule"],
                 "fusec.capture.regions": ["Regions"], "fusec.inspect.explain": ["explain"],
                 "fusec.inspect.profile": ["profile"]}
        lazy = {name for names in homes.values() for name in names}
        assert lazy | {n for n in fusec.__all__ if n.endswith(("Error", "Warning"))} \\
            == set(fusec.__all__)
        assert set(fusec.__all__) <= set(dir(fusec))
        for home, names in homes.items():
            for name in names:
                assert getattr(fusec, name) is getattr(__import__(home, fromlist=[name]), name)
        import fusec.frontend, fusec.log, fusec.training, fusec.build, fusec.report_html
        from fusec.explain import kernel_traffic
        from fusec.profile import ProfileReport
        for old, new in [("frontend", "capture.frontend"), ("decompositions", "capture.decompositions"),
                         ("outputs", "capture.outputs"), ("rnn", "capture.rnn"),
                         ("training", "capture.training"), ("graphviz", "inspect.graphviz"),
                         ("log", "inspect.log"), ("plots", "inspect.plots"),
                         ("build", "runtime.build"), ("explain", "inspect.explain"),
                         ("profile", "inspect.profile"), ("report_html", "inspect.report_html"),
                         ("report_text", "inspect.report_text")]:
            module = __import__(f"fusec.{old}", fromlist=["_"])
            assert module is sys.modules[f"fusec.{new}"] is sys.modules[f"fusec.{old}"], old
            if old not in ("explain", "profile"):
                assert getattr(fusec, old) is module
        assert callable(fusec.explain) and fusec.explain.__module__ == "fusec.inspect.explain"
        assert callable(fusec.profile) and fusec.profile.__module__ == "fusec.inspect.profile"
        assert fusec.log.compile_times is sys.modules["fusec.inspect.log"].compile_times
        assert fusec.cache.__name__ == "fusec.cache"  # a submodule, as an attribute, imports it
        try:
            fusec.no_such_thing
        except AttributeError as err:
            assert "no_such_thing" in str(err)
        else:
            raise AssertionError("fusec.no_such_thing resolved")
    """)


def test_the_registries_are_filled_by_whatever_import_brings_them():
    """The extensions' plugins and the FUSEC_LOG printer are registered as soon as an import
    brings the registries (fusec.passes, fusec.codegen.families) or the events: importing
    fusec.passes alone is enough, no fusec.compile needed."""
    said = child("""
        import sys
        from fusec import passes
        from fusec.codegen import families
        print(sorted(p.name for p in passes.pipeline() if isinstance(p, passes.ExtensionPass)))
        print([f.name for f in families.REGISTRY])
        from fusec import events                    # (what publishes the compile events)
        print("fusec.inspect.log" in sys.modules)
    """).splitlines()
    assert {"sibling_gemvs", "small_matmul"} <= set(eval(said[0]))
    assert eval(said[1]) and said[2] == "True"


def test_triton_imported_after_fusec_still_interprets_without_a_gpu():
    """`import fusec` no longer imports torch, so fusec/device.py (which switches Triton's
    interpreter on without a GPU) runs just before triton is first imported, here by torch's
    Dynamo (`torch.compile`), not by fusec. Then both fusec's Triton backend on CPU tensors and
    `torch.compile(backend="fusec")` work, as they did when `import fusec` imported everything."""
    said = child("""
        import os, sys
        import fusec
        import torch
        import torch._dynamo                     # imports triton
        assert "triton" in sys.modules and "fusec.device" in sys.modules
        assert not fusec.TRITON_IMPORTED_BEFORE_FUSEC
        print(torch.cuda.is_available(), os.environ.get("TRITON_INTERPRET"))
        x = torch.randn(64)
        if not torch.cuda.is_available():
            f = fusec.compile(lambda x: x.sin() * 2, backend="triton")
            torch.testing.assert_close(f(x), x.sin() * 2)
        g = torch.compile(lambda x: x.cos() + 1, backend="fusec")
        torch.testing.assert_close(g(x), x.cos() + 1)
        print("ok")
    """).split()
    assert said[-1] == "ok"
    assert said[1] == ("None" if said[0] == "True" else "1")


# ---- torch.compile's regions under the user's names ------------------------------------------------
def test_torch_compile_regions_have_the_users_names():
    """`explain` of `torch.compile(nn.Sequential(...), backend="fusec")` titled its region
    "inner" (torch's wrapper around the module, which Dynamo traces) and named the inputs
    `args_0, args_1, args_2`: now the module's forward, its parameters as fusec names its own
    (`p_0_weight`) and the forward's argument (`input`, which torch.fx would rename: `input_`)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    opt = torch.compile(model, backend="fusec")
    with torch.no_grad():
        opt(torch.ones(2, 8))
    text = str(fusec.explain(opt))
    assert "region 1: Sequential.forward: 2 torch op(s)" in text and "region 1: inner" not in text
    assert "linear(input_, p_0_weight, p_0_bias)" in text  # Dynamo's graph, as listed
    assert first_inputs(text) == ["p_0_weight", "p_0_bias", "input_"]  # the ATen graph's
    assert "args_0" not in text


def test_graph_break_regions_name_a_functions_inputs():
    """fusec.compile of a function with a graph break runs Dynamo's regions too: their forward
    programs take the function's own argument names."""
    def scaled(x, scale):
        y = x.sin() * scale
        if y.sum() > 0:
            return y.cos()
        return y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = str(fusec.explain(scaled, torch.ones(8), torch.ones(8), backend="cpp"))
    assert "region 1: scaled" in text
    assert first_inputs(text) == ["x", "scale"]


def first_inputs(explained: str) -> list[str]:
    """The input names of the first captured ATen graph in `explain`'s text."""
    block = explained.split("=== captured ATen graph ===\ninputs:\n", 1)[1].split("ops:", 1)[0]
    return [line.split()[0] for line in block.splitlines() if line.strip()]
