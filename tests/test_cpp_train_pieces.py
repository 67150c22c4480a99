"""A cat along the inner dim on the C++ backend: its conditional reads in a loop of their own
(Note: cat pieces in their own loop, codegen/cpp/pieces.py).

Rotary embeddings (llama's training step) cat along the last dim twice: the angles
`cat([t, t]).cos()` / `.sin()` and `rotate_half(x) = cat([-x2, x1])`. gcc 12 leaves the first
scalar in one loop (a masked read next to a vector math call: "control flow in loop"). Checked
here: eager's answers on both CPU backends (odd lengths, a non-contiguous input, NaN and
infinities, empty tensors, float64, three pieces, a row longer than pieces.MAX_CHUNK, a padding),
which pieces.inner_pieces takes, and, once codegen/cpp/__init__.py's render_pointwise calls
pieces_first (/work/notes/ask_cpptrain.md), the emitted code: the pieces' own loop, and gcc's
report that every simd loop is vectorized on x86-64-v3 and x86-64-v4 (masked loads).
"""
import inspect

import pytest
import torch
import torch.nn.functional as F

import fusec
from conftest import assert_matches, values_with_specials
from fusec.codegen import cpp
from fusec.codegen.cpp import pieces
from gcc_vector_report import LEVELS, NEEDS_CPP, X86, compile_report, simd_loops

BACKENDS = ["cpp", "llvm"]
HOOKED = "cat_pieces" in inspect.getsource(cpp.render_pointwise)
NEEDS_HOOK = pytest.mark.skipif(not HOOKED, reason="render_pointwise does not call "
                                "pieces.pieces_first yet (/work/notes/ask_cpptrain.md)")


def angles(t):
    e = torch.cat([t, t], dim=-1)
    return e.cos(), e.sin()


def rotate(x, c, s):
    h = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * s


CASES = {
    "angles": (angles, lambda: (values_with_specials(33, 9, special=True),)),
    "rotate_strided": (rotate, lambda: (torch.randn(2, 33, 4, 18).transpose(1, 2),
                                        torch.randn(33, 18), torch.randn(33, 18))),
    "three_pieces": (lambda a, b, c: torch.cat([a.exp(), b, c.sin()], dim=-1) * 2,
                     lambda: (values_with_specials(7, 5, special=True), torch.randn(7, 1),
                              torch.randn(7, 11))),
    "float64": (angles, lambda: (torch.randn(5, 13, dtype=torch.float64),)),
    "empty_rows": (lambda a, b: torch.cat([a, b], -1).sin(),
                   lambda: (torch.randn(0, 5), torch.randn(0, 3))),
    "long_row": (lambda a, b: torch.cat([a, b], -1).cos(),
                 lambda: (torch.randn(3, 2500), torch.randn(3, 1700))),
    "pad": (lambda a: F.pad(a, (2, 3)).sin() + 1, lambda: (values_with_specials(6, 7, special=True),)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_pieces_match_eager(name, backend):
    fn, inputs = CASES[name]
    assert_matches(fn, *inputs(), backend=backend)


def _kernels(fn, *inputs):
    return fusec.explain(fn, *inputs, backend="cpp").compiled.kernels


def test_inner_pieces_found_and_refused():
    """A cat along the last dim is taken; a cat along an outer dim (its condition is the same
    for a whole row) is left as it is."""
    (inner,) = [k.ir for k in _kernels(angles, torch.randn(4, 9)) if "cat" in k.name]
    found = pieces.inner_pieces(inner)
    assert len(found) == 2 and all(l.valid[0] == len(inner.shape) - 1 for l in found)
    outer = [k.ir for k in _kernels(lambda a, b: torch.cat([a, b], 0).sin(),
                                    torch.randn(3, 8), torch.randn(5, 8)) if "cat" in k.name]
    assert outer and all(pieces.inner_pieces(k) == [] for k in outer)


def test_pieces_first_moves_the_definitions():
    """The pieces' lines leave the main loop's body for their own loop, in order; the body reads
    each value back from its array; a long chunk is cut to MAX_CHUNK."""
    (kernel,) = [k.ir for k in _kernels(angles, torch.randn(4, 9)) if "cat" in k.name]
    found = pieces.inner_pieces(kernel)
    defs = [f"const float {l.var.name} = (cond) ? x_ptr[i] : float(0);" for l in found]
    body = [*defs, "out_ptr[i] = v;"]
    setup = []
    new_body, chunk = pieces.pieces_first(found, body, setup, 8192)
    assert chunk == pieces.MAX_CHUNK
    assert [f"    {d}" for d in defs] == [line for line in setup if "(cond)" in line]
    assert new_body[-1] == "out_ptr[i] = v;"
    assert all(f"{l.var.name}_piece[i - start]" in line for l, line in zip(found, new_body))
    assert pieces.pieces_first(found, ["out_ptr[i] = v;"], [], 64) == (["out_ptr[i] = v;"], 64)


@NEEDS_HOOK
def test_rendered_pieces_loop():
    (source,) = [k.source for k in _kernels(angles, torch.randn(4, 9)) if "cat" in k.name]
    assert "cat pieces in their own loop" in source and "_piece[i - start]" in source, source


@X86
@NEEDS_CPP
@NEEDS_HOOK
@pytest.mark.parametrize("target", [level for level in LEVELS if level != "x86-64"])
def test_pieces_loops_vectorized_for(target, tmp_path):
    """gcc's own report: both simd loops of cos/sin of a cat (the pieces', the main one) are
    vectorized with the target's widest vectors on x86-64-v3 and x86-64-v4. (Baseline x86-64
    has no masked loads: gcc leaves the pieces' loop scalar there, as it left the one loop.)"""
    (kernel,) = [k.ir for k in _kernels(angles, torch.randn(64, 32)) if "cat" in k.name]
    report = compile_report(cpp.render(kernel), target, tmp_path)
    loops = simd_loops(report.lines)
    scalar = [report.said(loop) for loop in loops if not report.vectorized(loop)]
    assert len(loops) == 2 and not scalar, scalar
