"""Every example runs, matches eager, and fuses as much as its docstring promises."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusec
from conftest import CPU_BACKENDS, assert_matches
from fusec.demo import load_example
from fusec.record import record_of

ROOT = Path(__file__).resolve().parent.parent


def steps_of(cf):
    last = cf._compiled.last if hasattr(cf, "_compiled") else cf.last
    return record_of(last.gm).schedule


@pytest.mark.parametrize("name", ["sin4", "add_mul", "maximum_neg_uint8", "strided"])
def test_seed_examples_are_one_kernel(target, name):
    backend, device = target
    kwargs = {"size": 4096} if name in ("sin4", "add_mul") else ({"n": 64} if name == "strided" else {})
    ex = load_example(name).example(device=device, **kwargs)
    assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1)


@pytest.mark.parametrize("name", ["softmax", "layernorm"])
def test_softmax_and_layernorm_are_one_kernel(target, name):
    backend, device = target
    ex = load_example(name).example(rows=33, cols=100, device=device)
    assert_matches(ex.fn, *ex.inputs, backend=backend, kernels=1)


def test_gelu_mlp_is_three_kernels_around_two_matmuls(target):
    backend, device = target
    ex = load_example("gelu_mlp").example(batch=8, dim=32, device=device)
    with torch.no_grad():
        cf = assert_matches(ex.fn, *ex.inputs, backend=backend)
    steps = steps_of(cf)
    assert sum(s.kind == "kernel" for s in steps) <= 3
    # the linear layers' biases join the kernels after them (passes/unfuse_bias.py)
    assert [s.name for s in steps if s.kind == "extern"] == ["aten.mm.default"] * 2
    assert [k.name for k in cf.kernels][1:] == ["fused_add_gelu_1", "fused_add_add_2"]


@pytest.mark.parametrize("variant", ["explicit", "sdpa"])
def test_gpt2_block_matches_eager(target, variant):
    backend, device = target
    ex = load_example("gpt2_block").example(batch=2, seq=16, n_embd=32, n_head=2, device=device,
                                            variant=variant)
    with torch.no_grad():
        assert_matches(ex.fn, *ex.inputs, backend=backend)


def test_gpt2_block_has_at_most_one_kernel_between_externs():
    ex = load_example("gpt2_block").example(batch=2, seq=16, n_embd=32, n_head=2)
    with torch.no_grad():
        cf = fusec.compile(ex.fn, backend="cpp")
        cf(*ex.inputs)
    run = 0
    for step in steps_of(cf):
        run = run + 1 if step.kind == "kernel" else 0
        assert run <= 1, [f"{s.kind} {s.name}" for s in steps_of(cf)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_xor_training_matches_eager_every_1000_epochs(backend):
    xor = importlib.import_module("fusec.examples.xor_train")
    history, prediction = xor.train(epochs=3000, backend=backend)
    for epoch, fused, eager in history:
        assert abs(fused - eager) <= 1e-5, (epoch, fused, eager)
    assert prediction == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gpt2_train_step_gradients_match_eager(backend):
    gpt = importlib.import_module("fusec.examples.gpt2_train_step")
    results, grad_err, weight_err = gpt.step(backend=backend, seq=16)
    assert abs(results[0] - results[1]) < 1e-5
    assert grad_err < 1e-5
    assert weight_err < 1e-4  # AdamW's first step divides by |grad|: tiny grads amplify rounding


def test_examples_run_as_scripts():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "maximum_neg_uint8.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "1 kernel(s)" in out.stdout and "max |fused - eager| = 0" in out.stdout
