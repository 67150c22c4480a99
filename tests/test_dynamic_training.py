"""Training shape families (issue 51): training calls whose batch size or sequence length changes
share one compile, as inference calls do (fusec/capture/training_family.py, fusec/api.py `_train`).

Each test trains a small model through `fusec.compile` next to an eager copy, with an optimizer
step between calls, and checks: the loss and every gradient are eager's at every step; the
training compiles stay few (the first size static, then one family); the recompile reason names
the dims that became symbols, or the guard a call broke; and the forward and backward programs of
the family compile once each (a part that compiled again would mean the family was one size).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fusec
from train_check import train_alongside


def mlp(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, width))


def inner(cf):
    return getattr(cf, "_compiled", cf)


def square_loss(m, batch):
    return m(batch[0]).square().mean()


def family_parts_compiled_once(cf) -> None:
    """The family's forward and backward programs compiled one program each."""
    family = inner(cf).train_families[-1]
    parts = family.compiled[1]
    assert len(parts) == 2 and [p.compiles for p in parts] == [1, 1], \
        [p.recompiles for p in parts]
    assert all(p.families for p in parts)  # (each a shape family of its own)


# -- an MLP: batch sizes 3, 5, 8, 13, 2 -----------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_batch_sizes_share_one_training_compile(backend):
    model = mlp()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend=backend)
    batches = [(torch.randn(n, 16),) for n in (3, 5, 8, 13, 2)]
    train_alongside(cf, model, ref, batches, square_loss)
    assert inner(cf).compiles == 2, inner(cf).recompiles
    (reason,) = inner(cf).recompiles
    assert reason.startswith("training:") and "symbols for dim 0 of input" in reason, reason
    family_parts_compiled_once(cf)


# -- batch norm: running statistics written after the family's program ----------------------------
@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_batch_norm_family_updates_its_buffers_as_eager(backend):
    """A shape family's forward keeps the buffer writes in its graph too (AOT Autograd's
    keep_inference_input_mutations, capture/buffer_updates.py): after batches of 3, 5, 7 and 4,
    running_mean, running_var and num_batches_tracked equal eager's, and the forward is one
    kernel (no kernel of its own for the counter's += 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend=backend)
    batches = [(torch.randn(n, 3, 10, 10),) for n in (3, 5, 7, 4)]
    train_alongside(cf, model, ref, batches, square_loss)
    for (name, got), want in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert inner(cf).compiles == 2, inner(cf).recompiles
    forward = inner(cf).train_families[-1].compiled[1][0]
    assert len(forward.last.kernels) == 1, [k.name for k in forward.last.kernels]
    # one training fast path serves the family (its guards check the sizes), none per size
    assert [k[0] for k in inner(cf)._train_fast_paths].count("family") == 1, \
        list(inner(cf)._train_fast_paths)
    family_parts_compiled_once(cf)  # (the backward's scalar_tensor(s0) is not folded: passes/
    # fold_constants.py; the forward's n / (n - 1) is a float of the sizes on LLVM too)


def test_a_size_of_one_breaks_the_family_guard():
    """As in torch, a symbol's range starts at 2: a batch of 1 compiles its own pair, and the
    reason names the guard it broke."""
    model = mlp()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend="cpp")
    batches = [(torch.randn(n, 16),) for n in (3, 5, 1, 7)]
    train_alongside(cf, model, ref, batches, square_loss)
    assert inner(cf).compiles == 3, inner(cf).recompiles
    assert "its guard 2 <= input" in inner(cf).recompiles[-1], inner(cf).recompiles
    assert "size()[0] failed" in inner(cf).recompiles[-1]


def test_dynamic_false_compiles_every_size():
    model = mlp()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend="cpp", dynamic=False)
    train_alongside(cf, model, ref, [(torch.randn(n, 16),) for n in (3, 5, 6)], square_loss)
    assert inner(cf).compiles == 3 and not inner(cf).train_families


def test_mark_dynamic_makes_the_first_training_compile_a_family():
    model = mlp()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend="cpp")
    batches = []
    for n in (4, 9, 6):
        x = torch.randn(n, 16)
        torch._dynamo.mark_dynamic(x, 0)
        batches.append((x,))
    train_alongside(cf, model, ref, batches, square_loss)
    assert inner(cf).compiles == 1 and len(inner(cf).train_families) == 1


def test_two_inputs_of_one_batch():
    """A target of the batch's size: the forward and backward graphs read sizes of both inputs,
    related (capture/training_family.py, Note: sizes the graphs relate); each compiles once."""
    model = mlp()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend="cpp")

    def mse(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])
    batches = [(torch.randn(n, 16), torch.randn(n, 16)) for n in (3, 6, 11, 4)]
    train_alongside(cf, model, ref, batches, mse)
    assert inner(cf).compiles == 2, inner(cf).recompiles
    family_parts_compiled_once(cf)


# -- a tiny Llama: batch and sequence length change --------------------------------------------
def tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' notes on the small config's token ids)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64, max_position_embeddings=64)).train()


def test_llama_batch_and_sequence_length():
    """On LLVM (the same path as C++ up to the kernels' code, which the MLP's tests run on both:
    a C++ compile of this pair took ~50 s of a CI run, LLVM's ~10 s)."""
    model = tiny_llama()
    ref = copy.deepcopy(model)
    cf = fusec.compile(model, backend="llvm")

    def lm_loss(m, batch):
        return m(input_ids=batch[0], labels=batch[0]).loss
    shapes = [(3, 5), (5, 7), (2, 11), (4, 3)]  # (both dims change at the second call)
    batches = [(torch.randint(0, 64, s, generator=torch.Generator().manual_seed(i)),)
               for i, s in enumerate(shapes)]
    train_alongside(cf, model, ref, batches, lm_loss)
    assert inner(cf).compiles == 2, inner(cf).recompiles
    reason = inner(cf).recompiles[0]
    assert "dim 0 of input_ids, dim 1 of input_ids" in reason, reason
    family_parts_compiled_once(cf)
    # per-call work (docs/dynamic.md, "What a family's step costs"): the forward's position ids
    # and the backward's views of its pool buffers are made once per size, with the pool
    forward, backward = inner(cf).train_families[-1].compiled[1]
    assert "arange, made once for this size" in forward.last.program.run.source
    assert "a view of" in backward.last.program.run.source


# -- through torch.compile ----------------------------------------------------------------------
def test_torch_compile_training_family_parts_compile_once():
    """Dynamo's second graph has symbolic sizes; its forward and backward, each compiled as a
    family, compile once for every later size (the target's sizes relate to the input's)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    model = mlp()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="fusec", options={"backend": "cpp"})

    def mse(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])
    batches = [(torch.randn(n, 16), torch.randn(n, 16)) for n in (3, 6, 11, 4)]
    train_alongside(compiled, model, ref, batches, mse)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    regions = fusec.regions(compiled)
    family = regions.regions[-1].parts
    assert [p.compiles for p in family] == [1, 1], [p.recompiles for p in family]


# -- Triton (under its interpreter on a machine without a GPU): a function with one weight ---------
def test_triton_a_function_with_a_weight():
    from conftest import TRITON_DEVICE

    def f(x, w):
        return torch.tanh(x @ w) * 2
    cf = fusec.compile(f, backend="triton")
    w = torch.randn(8, 4, requires_grad=True, device=TRITON_DEVICE)
    for n in (3, 5, 7):
        x = torch.randn(n, 8, device=TRITON_DEVICE)
        cf(x, w).sum().backward()
        got, w.grad = w.grad, None
        f(x, w).sum().backward()
        torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-5)
        w.grad = None
    assert cf.compiles == 2 and [p.compiles for p in cf.train_parts] == [1, 1], cf.recompiles
    assert "symbols for dim 0 of x" in cf.recompiles[0], cf.recompiles


# -- per-call work of a family's step (docs/dynamic.md, "What a family's step costs") -----------
def test_the_familys_first_size_takes_the_training_fast_path():
    model = mlp()
    cf = fusec.compile(model, backend="cpp")
    for n in (3, 5, 5):  # 3: static; 5: the family's first size; 5 again
        cf(torch.randn(n, 16)).square().mean().backward()
    assert inner(cf)._train_fast is not None


def test_a_familys_backward_takes_a_fast_path():
    """A mean over the batch: the family's backward gets the batch size as an int among its
    tensors (fusec/fastpath.py, Note: calls of tensors and ints). Its gradients are eager's at
    every size, through the fast path too; a size of 1 breaks the family's guard and says so."""
    def f(x, w):
        return torch.tanh(x @ w).mean(0)
    cf = fusec.compile(f, backend="cpp")
    w = torch.randn(8, 4, requires_grad=True)
    for n in (3, 5, 7, 7, 4, 1):
        x = torch.randn(n, 8)
        cf(x, w).sum().backward()
        got, w.grad = w.grad, None
        f(x, w).sum().backward()
        torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
        w.grad = None
        if n == 4:
            family_backward = cf.train_parts[1]
    assert cf.compiles == 3 and "2 <= x.size()[0]" in cf.recompiles[-1], cf.recompiles
    assert family_backward.derived, "the backward takes no size: nothing here to check"
    assert family_backward._fast is not fusec.fastpath.no_fast_path
    assert family_backward.compiles == 1


# -- a float of the sizes: n / (n - 1), as batch norm's running variance takes -------------------
def unbiased(x, w):
    y = torch.tanh(x @ w)
    n = y.shape[0]
    return y.square().mean(0) * (n / (n - 1))  # (a SymFloat of the family: one program for all n)


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_a_float_of_the_sizes_is_an_argument_not_a_guard(backend):
    """A SymFloat the program computes from a size (`n / (n - 1)`) is computed per call from the
    kernel's size arguments (C++: its expression; LLVM: instructions in double, codegen/llvm/
    sizes.py `real`; Triton: a scalar argument): the forward and backward compile once each,
    where a number in the kernel would have been a guard `n / (n - 1) == 1.25`."""
    from conftest import TRITON_DEVICE
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    cf = fusec.compile(unbiased, backend=backend)
    w = torch.randn(8, 4, requires_grad=True, device=device)
    for n in (3, 5, 7, 4):
        x = torch.randn(n, 8, device=device)
        cf(x, w).sum().backward()
        got, w.grad = w.grad, None
        unbiased(x, w).sum().backward()
        torch.testing.assert_close(got, w.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
        w.grad = None
    assert cf.compiles == 2 and [p.compiles for p in cf.train_parts] == [1, 1], \
        [p.recompiles for p in cf.train_parts]
