"""Symbolic sizes in the C++ backend (issue 51; codegen/cpp/text.py, Note: sizes as arguments in
C++): a kernel compiled once for a shape family takes its sizes as `int64_t` arguments after its
pointers and is right at every size of the family.

Each case compiles a one-kernel program with some dims traced as symbols (tests/dynamic_harness.py)
at one example size, then launches that same build on inputs of many other sizes: primes, 2 and 3,
sizes below and far above the traced one (a tile, a block or a chunk chosen from the traced size
must still be right), and one large enough that the kernel runs on several threads (the OpenMP
`if` is a comparison of the call's work, in the kernel). Every result is compared with eager
(float64-referenced for floats, exact for ints), and the shape family must really be every size:
no guard pins a symbol to one number.
"""
import pytest
import torch
import torch.nn.functional as F

import fusec
from dynamic_harness import check_outputs, compile_one, guards_pinning, run_one_kernel
from dynamic_harness import randn as _randn
from fusec import events
from fusec.check import compare
from fusec.codegen.cpu_plan import PARALLEL_WORK, work_bytes
from fusec.symbolic import hint, size_params

SIZES = [2, 3, 7, 13, 127, 1031]




# (id, fn, inputs(n) -> list of tensors, dynamic {input: dims}, example n, sizes launched)
CASES = [
    ("flat", lambda x: torch.sin(x) * 2, lambda n: [_randn(n, 5)], {0: {0}}, 37,
     SIZES + [30000]),
    ("broadcast_row", lambda x, y: x * y + 1, lambda n: [_randn(n, 33), _randn(33, seed=1)],
     {0: {0}}, 64, SIZES + [20000]),
    ("inner_dynamic", lambda x, y: torch.relu(x - y), lambda n: [_randn(7, n), _randn(7, 1, seed=1)],
     {0: {1}}, 100, SIZES + [100000]),
    ("transposed", lambda x, y: x.t() * 2 + y, lambda n: [_randn(n, 40), _randn(40, n, seed=1)],
     {0: {0}, 1: {1}}, 50, SIZES + [20000]),
    ("transposed_rows", lambda x, y: x.t() * 2 + y, lambda n: [_randn(40, n), _randn(n, 40, seed=1)],
     {0: {1}, 1: {0}}, 50, SIZES + [20000]),
    ("step_slice", lambda x: x[::2] * 2, lambda n: [_randn(n, 6)], {0: {0}}, 21, SIZES + [40001]),
    ("cat_beside_dynamic", lambda x, y: torch.cat([x, y], 1).relu() * 2,
     lambda n: [_randn(n, 5), _randn(n, 3, seed=1)], {0: {0}, 1: {0}}, 12, SIZES + [30000]),
    ("short_rows", lambda x, y: x + y, lambda n: [_randn(n, 8, dtype=torch.uint8),
                                                  _randn(8, dtype=torch.uint8, seed=1)],
     {0: {0}}, 5000, SIZES + [200000]),
    ("half", lambda x: torch.sigmoid(x * 2 + 1) * x, lambda n: [_randn(n, 30, dtype=torch.float16)],
     {0: {0}}, 40, SIZES + [30000]),
    ("bfloat16", lambda x, y: torch.exp(x) * y, lambda n: [_randn(n, 3, dtype=torch.bfloat16),
                                                           _randn(3, dtype=torch.bfloat16, seed=1)],
     {0: {0}}, 9, SIZES + [100000]),
    ("int32", lambda x: x * 3 - 7, lambda n: [_randn(n, 10, dtype=torch.int32)], {0: {0}}, 11,
     SIZES + [60000]),
    ("softmax_rows", lambda x: torch.softmax(x, -1), lambda n: [_randn(n, 64)], {0: {0}}, 20,
     SIZES + [8000]),
    ("softmax_k", lambda x: torch.softmax(x, -1), lambda n: [_randn(6, n)], {0: {1}}, 100,
     SIZES + [70000]),
    ("sum_k", lambda x: x.sum(-1), lambda n: [_randn(4, n)], {0: {1}}, 50, SIZES + [300000]),
    ("sum_k_half", lambda x: x.sum(-1), lambda n: [_randn(3, n, dtype=torch.float16)], {0: {1}},
     50, SIZES + [50000]),
    ("sum_k_int64", lambda x: x.sum(-1), lambda n: [_randn(5, n, dtype=torch.int64)], {0: {1}},
     20, SIZES + [40000]),
    ("mean_var", lambda x: (x.mean(-1), x.var(-1)), lambda n: [_randn(n, 48)], {0: {0}}, 30,
     SIZES + [20000]),
    ("var_k", lambda x: x.var(-1), lambda n: [_randn(5, n)], {0: {1}}, 30, SIZES + [50000]),
    ("mean_k", lambda x: x.mean(-1), lambda n: [_randn(6, n)], {0: {1}}, 30, SIZES + [50000]),
    ("scaled_by_size", lambda x: x * (2.0 / x.shape[1]) + x.shape[1], lambda n: [_randn(4, n)],
     {0: {1}}, 30, SIZES + [50000]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (96,), w, b),
     lambda n: [_randn(n, 96), _randn(96, seed=1), _randn(96, seed=2)], {0: {0}}, 17,
     SIZES + [10000]),
    ("argmax_k", lambda x: x.argmax(-1), lambda n: [_randn(9, n)], {0: {1}}, 40, SIZES + [50000]),
    ("sum_over_rows", lambda x: (x * 2).sum(0), lambda n: [_randn(n, 70)], {0: {0}}, 300,
     SIZES + [40000]),
    ("columns_last_dynamic", lambda x: x.sum(0), lambda n: [_randn(40, n)], {0: {1}}, 100,
     SIZES + [50000]),
    ("channel_softmax", lambda x: torch.softmax(x, 1), lambda n: [_randn(n, 12, 4, 4)], {0: {0}}, 3,
     SIZES + [3000]),
    ("channel_row_copy", lambda x: torch.softmax(x.transpose(2, 3), 1),
     lambda n: [_randn(n, 40, 8, 8)], {0: {0}}, 5, SIZES + [300]),
    ("strided_k_dynamic", lambda x: torch.softmax(x, 0), lambda n: [_randn(40, n, 3)], {0: {1}}, 5,
     SIZES + [5000]),
    ("strided_dynamic_k", lambda x: torch.softmax(x.transpose(2, 3), 1),
     lambda n: [_randn(2, n, 8, 8)], {0: {1}}, 50, SIZES + [5000]),
    ("channel_amax", lambda x: x.amax(1), lambda n: [_randn(2, n, 5, 6)], {0: {1}}, 10,
     SIZES + [9000]),
    ("amax_rows_k", lambda x: x.amax(-1), lambda n: [_randn(n, n)], {0: {0, 1}}, 20,
     [2, 3, 13, 127, 1031]),
]




@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_build_for_every_size(case):
    name, fn, make, dynamic, example, sizes = case
    captured, compiled, kernel = once = compile_one(fn, make(example), dynamic, "cpp")
    names = size_params(kernel.ir)
    assert names, "the kernel takes no size argument: it was compiled for one size"
    for arg in names:
        assert f"int64_t {arg}" in kernel.source, kernel.source
    assert "constexpr int64_t ROWS" not in kernel.source  # sizes come from the arguments
    lib = kernel.launcher.lib
    for n in sizes:
        inputs = make(n)
        outs, expected, again = run_one_kernel(fn, None, dynamic, "cpp", inputs, compiled_once=once)
        assert again[2] is kernel and kernel.launcher.lib == lib  # the same build, launched
        check_outputs(f"{name} at n={n}", fn, inputs, outs, expected, kernel.source)
    assert not guards_pinning(captured), guards_pinning(captured)


def test_threads_chosen_per_call():
    """The number of threads is chosen from the work of each call, not from the traced size:
    the kernel's heading says so and its OpenMP `if` compares the size arguments' work."""
    fn = lambda x: torch.exp(x) + 1  # noqa: E731
    captured, compiled, kernel = compile_one(fn, [_randn(10, 4)], {0: {0}}, "cpp")
    assert "threads: chosen per call" in kernel.source, kernel.source
    work = work_bytes(kernel.ir)
    assert hint(work) < PARALLEL_WORK  # one thread at the traced size...
    assert f">= {PARALLEL_WORK})" in kernel.source  # ...and the kernel decides at each call
    big = 2 * PARALLEL_WORK // (hint(work) // 10) + 1  # rows enough for several threads
    x = _randn(big, 4)
    outs, expected, _ = run_one_kernel(fn, None, {0: {0}}, "cpp", [x],
                                       compiled_once=(captured, compiled, kernel))
    assert compare(outs[0], expected[0], fn(x.double())) is None


def test_static_kernel_takes_no_sizes():
    """Without symbols the kernel is the one it always was: constexpr sizes, pointers only."""
    fn = lambda x: torch.sin(x) * 2  # noqa: E731
    _, _, kernel = compile_one(fn, [_randn(37, 5)], {}, "cpp")
    assert size_params(kernel.ir) == []
    assert "constexpr int64_t INNER = 185;" in kernel.source
    assert "int64_t s" not in kernel.source.split("{")[0]


class _Compiles:
    def __init__(self):
        self.programs = []

    def compiled(self, compiled_graph, label):
        self.programs.append(compiled_graph)


def test_batch_sizes_through_fusec_compile():
    """Through `fusec.compile` (dynamic=None): the second batch size makes dim 0 a symbol, and
    that program serves every later batch size; its C++ kernels take the size as an argument
    (the program passes it after the pointers: CppLauncher.pointer_entry)."""
    w = _randn(24, 32, seed=3)

    def block(x, w=w):
        h = torch.relu(x @ w.t() * 2 + 1)
        return torch.softmax(h, -1), h.sum(0)

    cf = fusec.compile(block, backend="cpp")
    count = events.watch(_Compiles())
    try:
        for n in [5, 9, 2, 3, 7, 13, 127, 1031, 40, 6000, 11]:
            x = _randn(n, 32, seed=n)
            got, want, ref = cf(x), block(x), block(x.double(), w.double())
            for g, e, r in zip(got, want, ref):
                assert compare(g, e, r) is None, n
    finally:
        events.unwatch(count)
    assert len(count.programs) <= 2, len(count.programs)
    last = count.programs[-1]
    sized = [k for k in last.kernels if size_params(k.ir)]
    assert sized, [k.source for k in last.kernels]
    for k in sized:
        assert all(f"int64_t {a}" in k.source for a in size_params(k.ir))


def test_gathers_of_every_size():
    """An embedding whose table and index count are both symbols (`dynamic=True`): the gathered
    row is kept inside a table of s rows (`fusec_row(i, s)`), one program for every size."""
    fn = lambda i, w: F.embedding(i, w) * 2  # noqa: E731
    cf = fusec.compile(fn, backend="cpp", dynamic=True)
    count = events.watch(_Compiles())
    try:
        for n, rows in [(20, 30), (2, 3), (7, 13), (1031, 127), (5000, 2)]:
            i = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(n))
            w = _randn(rows, 16, seed=rows)
            assert torch.equal(cf(i, w), fn(i, w)), (n, rows)
    finally:
        events.unwatch(count)
    assert len(count.programs) == 1, len(count.programs)
    gathers = [k for k in count.programs[0].kernels if "fusec_row(" in k.source]
    assert gathers and all(size_params(k.ir) for k in gathers)
