"""Saved programs (fusec/runtime/fast_start/saved.py) and the fingerprint that keys them
(fusec/runtime/fast_start/fingerprint.py): a second compile of the same call loads the program instead of
capturing it, gives eager's results, and anything that changes what the call does (an attribute,
an argument's value, the output's structure, aliasing, a closure's tensor, a setting of fusec)
gives another key, or none, and a compile of its own.

Each test uses its own cache directory. A "second process" is a second `fusec.compile` of the
same model here (a fresh CompiledFunction keeps nothing in memory), and once a real subprocess.
"""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fusec
from fusec import cache
from fusec.runtime.fast_start import saved
from fusec.runtime.fast_start.fingerprint import environment, fingerprint, trace_text

from conftest import TRITON_DEVICE


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSEC_SAVED_PROGRAMS", raising=False)


class Block(torch.nn.Module):
    """A small layer with a parameter, a buffer, a reduction and a Python-level setting."""

    def __init__(self, n=24, scale=2.0):
        super().__init__()
        self.fc = torch.nn.Linear(n, n)
        self.norm = torch.nn.LayerNorm(n)
        self.register_buffer("shift", torch.linspace(-1, 1, n))
        self.scale = scale

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(x)) * self.scale + self.shift
        return self.norm(h + x).softmax(-1)


def loaded() -> int:
    return cache.STATS["programs loaded"]


def run_twice(model, *args, backend="cpp"):
    """Compile `model` twice (as two processes would); returns both outputs and whether the
    second compile loaded the saved program."""
    with torch.no_grad():
        first = fusec.compile(model, backend=backend)(*args)
        before = loaded()
        second_cf = fusec.compile(model, backend=backend)
        second = second_cf(*args)
    return first, second, loaded() - before, second_cf


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_second_compile_loads_the_program_and_matches_eager(backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model = Block().to(device).eval()
    x = torch.randn(3, 5, 24, device=device)
    first, second, n, cf = run_twice(model, x, backend=backend)
    with torch.no_grad():
        want = model(x)
    assert n == 1, "the second compile should have loaded the saved program"
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    # the kernels are the loaded ones, with their sources; the graphs are made when read
    assert cf.kernels and all(k.source for k in cf.kernels)
    assert "===== graph =====" in cf.source() and "kernel" in cf.schedule
    # a new input of the same signature, through the fast path
    y = torch.randn(3, 5, 24, device=device)
    with torch.no_grad():
        torch.testing.assert_close(cf(y), model(y), rtol=1e-5, atol=1e-5)


def test_changing_what_the_call_does_changes_the_key():
    model, x = Block().eval(), torch.randn(4, 24)
    key = fingerprint(model, (x,), {}, "cpp")
    assert key is not None and key == fingerprint(model, (x,), {}, "cpp")
    model.scale = 3.0  # a Python attribute: the trace multiplies by another number
    assert fingerprint(model, (x,), {}, "cpp") != key
    model.scale = 2.0
    assert fingerprint(model, (x,), {}, "cpp") == key
    assert fingerprint(model, (x,), {}, "llvm") != key  # the backend
    assert fingerprint(model, (torch.randn(5, 24),), {}, "cpp") != key  # a shape
    assert fingerprint(model, (torch.randn(24, 4).t(),), {}, "cpp") != key  # strides
    assert fingerprint(model, (x.double(),), {}, "cpp") != key  # a dtype
    model.train()
    assert fingerprint(model, (x,), {}, "cpp") != key
    model.eval()
    with torch.no_grad():
        model.fc.weight.mul_(2)  # parameter *values* are inputs: the same program
    assert fingerprint(model, (x,), {}, "cpp") == key


def test_a_changed_attribute_compiles_its_own_program():
    model, x = Block().eval(), torch.randn(4, 24)
    with torch.no_grad():
        fusec.compile(model, backend="cpp")(x)
        model.scale = -1.5
        before = loaded()
        got = fusec.compile(model, backend="cpp")(x)
        assert loaded() == before
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


def test_arguments_and_outputs_are_part_of_the_key():
    def f(x, y, mode: str = "sum", as_dict: bool = False):
        z = x * 2 + y
        out = z.sum(0) if mode == "sum" else z.amax(0)
        return {"out": out} if as_dict else (out,)

    x, y = torch.randn(6, 7), torch.randn(6, 7)
    key = fingerprint(f, (x, y), {}, "cpp")
    assert fingerprint(f, (x, y), {"mode": "max"}, "cpp") != key
    # the same torch calls, another output structure
    assert fingerprint(f, (x, y), {"as_dict": True}, "cpp") != key
    assert fingerprint(f, (x, x), {}, "cpp") != key  # one tensor passed twice
    for kwargs in ({}, {"mode": "max"}, {"as_dict": True}):
        cf = fusec.compile(f, backend="cpp")
        got, want = cf(x, y, **kwargs), f(x, y, **kwargs)
        assert type(got) is type(want)
        torch.testing.assert_close(got, want)
    cf = fusec.compile(f, backend="cpp")
    before = loaded()
    torch.testing.assert_close(cf(x, y, as_dict=True), f(x, y, as_dict=True))
    assert loaded() == before + 1


def test_a_tensor_the_program_reaches_by_itself_has_no_fingerprint():
    mask = torch.randn(8)

    def f(x):
        return (x + mask).relu()

    x = torch.randn(3, 8)
    assert fingerprint(f, (x,), {}, "cpp") is None
    torch.testing.assert_close(fusec.compile(f, backend="cpp")(x), f(x))
    mask.copy_(torch.randn(8))  # a new process would see other values: nothing was saved
    torch.testing.assert_close(fusec.compile(f, backend="cpp")(x), f(x))
    assert not list((cache.root() / "programs").glob("*.pkl"))


def test_calls_that_need_data_have_no_fingerprint():
    def f(x):
        return x * 2 if x.sum() > 0 else x - 1

    x = torch.randn(5)
    assert fingerprint(f, (x,), {}, "cpp") is None
    for _ in range(2):
        with pytest.warns(UserWarning):
            torch.testing.assert_close(fusec.compile(f, backend="cpp")(x), f(x))


def test_fusec_settings_are_part_of_the_key(monkeypatch):
    fuse_reductions = importlib.import_module("fusec.passes.fuse_reductions")
    env = environment("cpp")
    monkeypatch.setattr(fuse_reductions, "FEW_ROWS_DEVICES", ("nowhere",))
    assert environment("cpp") != env
    monkeypatch.undo()
    assert environment("cpp") == env
    torch.set_float32_matmul_precision("high")
    try:
        assert environment("cpp") != env
    finally:
        torch.set_float32_matmul_precision("highest")
    monkeypatch.setenv("FUSEC_LAYOUT", "0")
    assert environment("cpp") != env
    monkeypatch.undo()
    # how many builds run at once and whether bars are drawn change no program
    monkeypatch.setenv("FUSEC_COMPILE_JOBS", "1")
    monkeypatch.setenv("FUSEC_PROGRESS", "1")
    assert environment("cpp") == env
    monkeypatch.undo()
    driver = importlib.import_module("fusec.driver")  # a name imported from another fusec module
    monkeypatch.setattr(driver, "plan_memory", lambda *a, **k: None)
    assert environment("cpp") != env


def test_the_trace_names_tensors_by_where_they_come_from():
    model, x = Block().eval(), torch.randn(4, 24)
    text = trace_text(model, (x,), {}, "cpp")
    assert "p0: (24, 24)" in text  # fc.weight, the first parameter
    assert "torch.nn.functional.linear(tuple(in" in text
    assert text.splitlines()[-1].startswith("out: (t")


def test_a_damaged_or_foreign_saved_program_is_a_miss():
    model, x = Block().eval(), torch.randn(2, 24)
    with torch.no_grad():
        fusec.compile(model, backend="cpp")(x)
    (path,) = (cache.root() / "programs").glob("*.pkl")
    path.write_bytes(path.read_bytes()[:-10])  # truncated: its manifest no longer matches
    before = loaded()
    with torch.no_grad():
        torch.testing.assert_close(fusec.compile(model, backend="cpp")(x), model(x))
    assert loaded() == before
    cache.atomic_write(path, b"not a pickle")
    cache.write_manifest(path)  # intact, but unreadable: compiled again, not an error
    with torch.no_grad():
        torch.testing.assert_close(fusec.compile(model, backend="cpp")(x), model(x))
    assert loaded() == before


def test_saving_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    model, x = Block().eval(), torch.randn(2, 24)
    _, second, n, _ = run_twice(model, x)
    assert n == 0 and not (cache.root() / "programs").exists()
    assert not saved.enabled()


def test_explain_and_check_compile_as_usual():
    model, x = Block().eval(), torch.randn(2, 24)
    with torch.no_grad():
        fusec.compile(model, backend="cpp")(x)
        before = loaded()
        fusec.compile(model, backend="cpp", check=True)(x)
        report = str(fusec.explain(model, x, backend="cpp"))
    assert loaded() == before and "fused" in report


def test_a_new_process_loads_what_the_first_saved(tmp_path):
    script = textwrap.dedent("""
        import torch, fusec
        from fusec import cache
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)).eval()
        x = torch.randn(4, 16)
        with torch.no_grad():
            got = fusec.compile(model, backend="cpp")(x)
            torch.testing.assert_close(got, model(x))
        print("loaded", cache.STATS["programs loaded"], "compiles", cache.STATS["compiles"])
    """)
    env = {**os.environ, "FUSEC_CACHE_DIR": str(tmp_path / "shared")}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert "loaded 0" in runs[0].stdout
    assert "loaded 1 compiles 0" in runs[1].stdout


def test_tritons_own_key_is_remembered_between_processes(monkeypatch):
    """codegen/triton/keys.py: the first process hashes Triton's installation and saves the key;
    a later one reads it back and hands Triton the same value."""
    triton_cache = pytest.importorskip("triton.runtime.cache")
    from fusec.codegen.triton import keys as triton_keys
    original = triton_cache.triton_key
    monkeypatch.setattr(triton_cache, "triton_key", original)  # restored after the test
    assert not triton_keys.remember(compute=False)  # an empty cache: nothing remembered
    assert not triton_keys.remember(compute=True)  # computed and saved
    assert (cache.root() / "triton-key").is_dir()
    assert triton_keys.remember(compute=False)
    assert getattr(triton_cache.triton_key, "remembered_by_fusec", False)
    assert triton_cache.triton_key() == original()


class Holder:
    """An object pytree does not know, returned with tensors inside (capture/outputs.py)."""

    def __init__(self, tensors, note):
        self.tensors, self.note = tensors, note


def test_outputs_of_any_structure_are_saved_and_come_back():
    def f(x):
        return {"held": Holder([x.sin(), x * 3], "kept"), "n": 7}

    x = torch.randn(4, 5)
    first, second, n, _ = run_twice(f, x)
    assert n == 1
    for got in (first, second):
        assert type(got["held"]) is Holder and got["held"].note == "kept" and got["n"] == 7
        torch.testing.assert_close(got["held"].tensors[1], x * 3)


def test_a_transformers_decoder_with_its_cache_is_saved_and_loaded():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (1, 8))
    first, second, n, _ = run_twice(model, ids)
    with torch.no_grad():
        want = model(ids)
    assert n == 1 and type(second.past_key_values) is type(want.past_key_values)
    torch.testing.assert_close(second.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second.past_key_values.layers[1].keys,
                               want.past_key_values.layers[1].keys, rtol=1e-4, atol=1e-4)
