"""Symbolic sizes in the Triton backend (issue 51; codegen/triton/text.py, Note: Triton kernels for
a shape family): a kernel compiled once for a shape family takes its sizes as plain integer
arguments after its pointers, computes its grid from them at each launch, and is right at every
size of the family.

Each case compiles a one-kernel program with some dims traced as symbols (tests/dynamic_harness.py)
at one example size, then launches that same module on inputs of other sizes: 2 and 3, primes,
sizes below and far above the traced one (a block size chosen from the traced size must still be
right: masks switch off what lies past the end, and a row longer than the traced one is looped
over), and one that takes many programs. Every result is compared with eager (float64-referenced
for floats, exact for ints), and the shape family must really be every size: no guard pins a
symbol to one number. Under TRITON_INTERPRET=1 (conftest.py) the kernels run on the CPU.

The launcher's side (fusec/runtime/fast_start/triton_launch.py: one bound kernel per kind of the
sizes, as Triton specializes them) is checked with a stand-in module, as tests/test_triton_launch.py
does: on a CPU Triton returns no compiled kernel to bind.
"""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import TRITON_DEVICE
from dynamic_harness import bind_sizes, check_outputs, compile_one, guards_pinning, run_one_kernel
from dynamic_harness import randn as _any_randn
from fusec.check import compare
from fusec.ir import family
from fusec.runtime.fast_start.triton_launch import TritonLauncher, size_kinds
from fusec.symbolic import size_params, size_symbols

# (the interpreter computes masked-off lanes too: 0 / 0 there warns, and is never stored)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

SIZES = [2, 3, 7, 13, 127, 1031]




def _randn(*shape, dtype=torch.float32, seed=0):
    return _any_randn(*shape, dtype=dtype, seed=seed, device=TRITON_DEVICE)


# (id, fn, inputs(n) -> list of tensors, dynamic {input: dims}, example n, sizes launched)
CASES = [
    ("flat", lambda x: torch.sin(x) * 2, lambda n: [_randn(n)], {0: {0}}, 37, SIZES + [20000]),
    ("broadcast_row", lambda x, y: x * y + 1, lambda n: [_randn(n, 33), _randn(33, seed=1)],
     {0: {0}}, 64, SIZES),
    ("inner_dynamic", lambda x, y: torch.relu(x - y), lambda n: [_randn(7, n), _randn(7, 1, seed=1)],
     {0: {1}}, 100, SIZES),
    ("transposed", lambda x, y: x.t() * 2 + y, lambda n: [_randn(n, 40), _randn(40, n, seed=1)],
     {0: {0}, 1: {1}}, 50, SIZES),
    ("transposed_batch", lambda x, y: x.transpose(1, 2) * y,
     lambda n: [_randn(3, n, 24), _randn(3, 24, n, seed=1)], {0: {1}, 1: {2}}, 40, SIZES),
    ("transposed_read", lambda x: x.t() + 1, lambda n: [_randn(n, 5).t().contiguous().t()],
     {0: {0}}, 30, SIZES),
    ("step_slice", lambda x: x[::2] * 2, lambda n: [_randn(n, 6)], {0: {0}}, 21, SIZES),
    ("slice_inner", lambda x: x[:, 1:] + 1, lambda n: [_randn(3, n)], {0: {1}}, 37, SIZES),
    ("cat_dynamic", lambda x, y: torch.cat([x, y], 0) * 2, lambda n: [_randn(n, 4), _randn(5, 4)],
     {0: {0}}, 37, SIZES),
    ("cat_beside_dynamic", lambda x, y: torch.cat([x, y], 1).relu() * 2,
     lambda n: [_randn(n, 5), _randn(n, 3, seed=1)], {0: {0}, 1: {0}}, 12, SIZES),
    ("half", lambda x: torch.sigmoid(x * 2 + 1) * x, lambda n: [_randn(n, 30, dtype=torch.float16)],
     {0: {0}}, 40, SIZES),
    ("bfloat16", lambda x, y: torch.exp(x) * y, lambda n: [_randn(n, 3, dtype=torch.bfloat16),
                                                           _randn(3, dtype=torch.bfloat16, seed=1)],
     {0: {0}}, 9, SIZES),
    ("int32", lambda x: x * 3 - 7, lambda n: [_randn(n, 10, dtype=torch.int32)], {0: {0}}, 11,
     SIZES),
    ("sum_rows", lambda x: x.sum(-1), lambda n: [_randn(n, 64)], {0: {0}}, 37, SIZES),
    ("softmax_rows", lambda x: torch.softmax(x, -1), lambda n: [_randn(n, 64)], {0: {0}}, 20, SIZES),
    ("softmax_k", lambda x: torch.softmax(x, -1), lambda n: [_randn(6, n)], {0: {1}}, 100,
     SIZES + [9000]),
    ("sum_k", lambda x: x.sum(-1), lambda n: [_randn(4, n)], {0: {1}}, 50, SIZES + [20000]),
    ("sum_k_half", lambda x: x.sum(-1), lambda n: [_randn(3, n, dtype=torch.float16)], {0: {1}},
     50, SIZES),
    ("sum_k_bfloat16", lambda x: x.sum(-1), lambda n: [_randn(3, n, dtype=torch.bfloat16)],
     {0: {1}}, 50, SIZES),
    ("sum_k_int64", lambda x: x.sum(-1), lambda n: [_randn(5, n, dtype=torch.int64)], {0: {1}},
     20, SIZES),
    ("mean_var_rows", lambda x: (x.mean(-1), x.var(-1)), lambda n: [_randn(n, 48)], {0: {0}}, 30,
     SIZES),
    ("layer_norm_rows", lambda x, w, b: F.layer_norm(x, (96,), w, b),
     lambda n: [_randn(n, 96), _randn(96, seed=1), _randn(96, seed=2)], {0: {0}}, 17, SIZES),
    ("mean_k", lambda x: x.mean(-1), lambda n: [_randn(8, n)], {0: {1}}, 37, SIZES),
    ("var_k", lambda x: x.var(-1), lambda n: [_randn(5, n)], {0: {1}}, 30, SIZES),
    ("layer_norm_k", lambda x: F.layer_norm(x, (x.shape[-1],)), lambda n: [_randn(6, n)],
     {0: {1}}, 40, SIZES),
    ("times_its_size", lambda x: x * x.shape[0] - 1, lambda n: [_randn(n, 4)], {0: {0}}, 37, SIZES),
    ("size_as_float", lambda x: x * (1.0 / x.shape[0]) + x.shape[0] / 2, lambda n: [_randn(n, 4)],
     {0: {0}}, 37, SIZES),
    ("argmax_k", lambda x: x.argmax(-1), lambda n: [_randn(9, n)], {0: {1}}, 40, SIZES),
    ("sum_over_rows", lambda x: (x * 2).sum(0), lambda n: [_randn(n, 70)], {0: {0}}, 300, SIZES),
    ("columns_last_dynamic", lambda x: x.sum(0), lambda n: [_randn(40, n)], {0: {1}}, 100, SIZES),
    ("channel_softmax", lambda x: torch.softmax(x, 1), lambda n: [_randn(n, 12, 4, 4)], {0: {0}}, 3,
     SIZES[:-1] + [200]),
    ("strided_k_dynamic", lambda x: torch.softmax(x, 0), lambda n: [_randn(40, n, 3)], {0: {1}}, 5,
     SIZES),
    ("strided_dynamic_k", lambda x: torch.softmax(x, 1), lambda n: [_randn(3, n, 2, 3)], {0: {1}},
     50, SIZES),
    ("amax_rows_k", lambda x: x.amax(-1), lambda n: [_randn(n, n)], {0: {0, 1}}, 20,
     [2, 3, 13, 127]),
]




def _signature(source: str, name: str) -> list[str]:
    """The parameter names of function `name` in a module's source."""
    found = re.search(rf"^def {name}\((.*)\):$", source, re.M)
    assert found, f"no def {name} in\n{source}"
    return [p.split(":")[0].split("=")[0].strip() for p in found.group(1).split(",")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_build_for_every_size(case):
    name, fn, make, dynamic, example, sizes = case
    captured, compiled, kernel = once = compile_one(fn, make(example), dynamic, "triton")
    names = size_params(kernel.ir)
    assert names, "the kernel takes no size argument: it was compiled for one size"
    source = kernel.source
    pointers = [p.name for p in kernel.ir.params]
    # the sizes follow the pointers: in the module's launch and in the @triton.jit kernel
    assert _signature(source, "launch") == pointers + names, source
    jit = _signature(source, kernel.ir.name)
    assert jit[len(pointers):len(pointers) + len(names)] == names, source
    assert not {"n_elements", "n_rows"} & set(jit), source  # (computed inside, from the sizes)
    module, lib = kernel.launcher.module, kernel.launcher.lib
    for n in sizes:
        inputs = make(n)
        outs, expected, again = run_one_kernel(fn, None, dynamic, "triton", inputs,
                                               compiled_once=once)
        # the same module, launched at this size
        assert again[2] is kernel and kernel.launcher.module is module and kernel.launcher.lib == lib
        check_outputs(f"{name} at n={n}", fn, inputs, outs, expected, source)
    assert not guards_pinning(captured), guards_pinning(captured)


def test_row_longer_than_its_block_is_looped():
    """A reduced dim that is a symbol loops over the row, in chunks of its traced size's power of
    two: a row of 100 is walked 128 at a time, and one of 5000 is still summed whole."""
    fn = lambda x: x.sum(-1)  # noqa: E731
    once = compile_one(fn, [_randn(4, 100)], {0: {1}}, "triton")
    source = once[2].source
    assert "for k_start in range(0, n_k, RBLOCK):" in source and "RBLOCK=128" in source, source
    assert "n_k: tl.constexpr" not in source  # n_k is a size now, computed from the argument
    x = _randn(4, 5000)
    outs, expected, _ = run_one_kernel(fn, None, {0: {1}}, "triton", [x], compiled_once=once)
    assert compare(outs[0], expected[0], fn(x.double())) is None


def test_only_guard_added_is_the_32_bit_bound():
    """Rendering adds no guard but the upper bound under which positions fit 32 bits (past it, a
    kernel with 64-bit positions is compiled: a correctness decision, never taken from a hint)."""
    fn = lambda x, w: x * w + 1  # noqa: E731
    captured, _, _ = compile_one(fn, [_randn(37, 64), _randn(64, seed=1)], {0: {0}}, "triton")
    from fusec.symbolic import guards_with_places
    ours = [g for g, where in guards_with_places(captured.shape_env) if "triton/" in where]
    assert ours and all(g.endswith("< 2147483647") for g in ours), ours


def test_static_kernel_is_unchanged():
    """Without symbols the module is the one it always was: the count and the grid as numbers,
    pointers only, and a bind with its grid fixed."""
    fn = lambda x: torch.sin(x) * 2  # noqa: E731
    _, _, kernel = compile_one(fn, [_randn(37)], {}, "triton")
    assert size_params(kernel.ir) == []
    source = kernel.source
    assert _signature(source, "launch") == [p.name for p in kernel.ir.params]
    assert "n_elements, BLOCK_SIZE: tl.constexpr):" in source
    assert "grid = (triton.cdiv(37, 128),)" in source and "def compile_ahead(*dtypes):" in source
    assert "    run = compiled[(triton.cdiv(37, 128), 1, 1)]" in source


def _nvidia_tools() -> bool:
    try:
        import triton
        return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
    except ImportError:
        return False


@pytest.mark.skipif(not _nvidia_tools(), reason="this Triton has no NVIDIA tools (ptxas)")
@pytest.mark.parametrize("name", ["transposed_batch", "softmax_k", "layer_norm_k"])
def test_kernel_with_sizes_compiles_for_sm_90(name):
    """Triton's compiler (not its interpreter) takes the kernels: sizes as integer arguments, the
    counts and tile counts computed from them, a looped row of a dynamic length (codegen/triton/
    target.py compiles for the sizes the program was traced at)."""
    from fusec.codegen.triton import target
    _, fn, make, dynamic, example, _ = next(c for c in CASES if c[0] == name)
    _, _, kernel = compile_one(fn, make(example), dynamic, "triton")
    sass = target.assembly(kernel.ir, kernel.ir.name, "sm_90")
    assert "0 bytes spilled" in sass.splitlines()[0], sass.splitlines()[0]


# ---- the launcher: one bound kernel per kind of sizes -------------------------------------------

class FakeModule:
    """`launch` is the JIT path (returns a 'compiled kernel' for the sizes' kinds); `bind` the
    fast one, which records the kinds it was bound for."""

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(("jit", args[-1]))
        return Compiled(size_kinds(args[-1:]))

    def bind(self, compiled):  # (the launcher binds its Direct wrapper of the compiled kernel)
        return lambda *args: self.calls.append(("fast", args[-1], compiled.compiled.kinds))


class Compiled:
    def __init__(self, kinds):
        self.kinds = kinds

    def run(self):  # a compiled kernel has .run
        pass


def test_launcher_binds_per_kind_of_sizes():
    m = FakeModule()
    launcher = TritonLauncher(m, None, "k", 2, 1)
    x, y = torch.zeros(64), torch.zeros(64)
    for n in (37, 5, 32, 48, 1, 7, 1):
        launcher(x, y, n)
    # 37 and 5 are neither 1 nor multiples of 16; 32 and 48 are multiples; 1 is a constant
    assert m.calls == [("jit", 37), ("fast", 5, ((False, True),)), ("jit", 32),
                       ("fast", 48, ((True, True),)), ("jit", 1), ("fast", 7, ((False, True),)),
                       ("fast", 1, (1,))]


def test_launcher_with_sizes_checks_alignment():
    m = FakeModule()
    launcher = TritonLauncher(m, None, "k", 2, 1)
    base = torch.zeros(65)
    launcher(base[:64], base[:64], 37)
    launcher(base[1:], base[:64], 5)  # 4 bytes in: the kernel was specialized for aligned
    launcher(base[:64], base[:64], 5)
    assert [c[0] for c in m.calls] == ["jit", "jit", "fast"]


class _Recorder:
    """Stands in for a compiled kernel (`compiled[grid](*args)`) or for the @triton.jit one
    (`kernel[grid](*args, **kwargs)`): keeps the grid and the arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((tuple(grid), args, kwargs))


@pytest.mark.parametrize("name", ["broadcast_row", "transposed_batch", "softmax_k", "sum_rows"])
def test_bind_launches_what_launch_does(name, monkeypatch):
    """The fast path (`bind`, run on a GPU only) computes the grid from the sizes at each call and
    passes the compiled kernel the arguments the JIT's launch passes, constexprs included."""
    _, fn, make, dynamic, example, _ = next(c for c in CASES if c[0] == name)
    captured, _, kernel = compile_one(fn, make(example), dynamic, "triton")
    module = kernel.launcher.module
    jit, compiled = _Recorder(), _Recorder()
    monkeypatch.setattr(module, family(kernel.ir.name), jit)  # (the module is the canonical one)
    fast = module.bind(compiled)
    for n in (5, 64, 300):
        inputs = make(n)
        outs = [torch.empty_like(e) for e in
                (lambda r: r if isinstance(r, (tuple, list)) else [r])(fn(*inputs))]
        sizes = bind_sizes(captured, inputs)
        args = [*inputs, *outs, *[sizes[s] for s in size_symbols(kernel.ir)]]
        module.launch(*args)
        fast(*args)
        (grid, jit_args, kwargs), (fast_grid, fast_args, _) = jit.calls[-1], compiled.calls[-1]
        constexprs = [v for k, v in kwargs.items()
                      if k not in ("num_warps", "enable_fp_fusion", "launch_pdl")]
        assert fast_grid == (*grid, 1, 1)[:3] and list(fast_args) == [*jit_args, *constexprs]


def test_size_kinds_follow_triton():
    assert size_kinds([1, 2, 16, 17, 2 ** 31, 2 ** 35]) == (
        1, (False, True), (True, True), (False, True), (True, False), (True, False))
