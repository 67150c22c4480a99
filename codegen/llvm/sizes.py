"""Sizes in LLVM IR: a size that is a symbol (fusec/symbolic.py) as instructions over the
kernel's size arguments, computed once at the top of the kernel.

A kernel compiled for a shape family takes, after its pointers, one `i64` per symbol
(`i64 %x_size0`, in the order fusec.symbolic.size_params gives). LLVM IR has no expressions, only
instructions, so a size such as `64*x_size0` cannot be written where a number was (`mul i64 %chunk,
64*x_size0` does not parse): it becomes an SSA value defined in the function's entry block, which
comes before every other block and so may be used anywhere in the function:

    entry:
      %size.3 = mul nsw i64 %x_size0, 64        ; 64*x_size0
      ...
    tile:
      %start = mul i64 %chunk, %size.3

`Sizes.operand(x)` gives the operand text for a size: its number when it is an int (a kernel
with no symbols renders exactly as before), else the SSA value, written the first time it is
asked for. Integer division and remainder round towards minus infinity (Python's `//` and `%`,
sympy's FloorDiv and Mod); LLVM's `sdiv`/`srem` round towards zero, so where an operand may be
negative a fix-up follows them. Sizes themselves are never negative, but an offset can be
(`x_size0 - 3`), so the fix-up is left out only where sympy proves both operands non-negative.

A float computed from sizes (a SymFloat, such as batch norm's `n / (n - 1)`) is computed the same
way in double (`Sizes.real`: `sitofp`, then `fdiv double`), as the C++ backend writes its expression.

Decisions that only change speed (how long a chunk is, whether threads pay off, which layout a
reduction takes) are made on `hinted(kernel)`: the kernel with every symbol replaced by the size
it was traced with, so that they add no guard (fusec.symbolic.hint).
"""
from __future__ import annotations

import dataclasses
import struct

import torch

from fusec.symbolic import hint, is_symbolic, named, size_params, text


def known(x):
    """`x` as an int when it is one (or a SymInt whose value is fixed), else None. Asking never
    adds a guard: use it where a number allows a shorter spelling, never to decide a result."""
    if isinstance(x, torch.SymInt):
        value = x.node.maybe_as_int()
        return value if isinstance(value, int) else None
    return x


def hinted(obj):
    """A copy of `obj` (a kernel IR, a tuple of sizes...) with every SymInt replaced by its
    hint, for heuristics only (see the module docstring); `obj` itself when it has no symbols."""
    if isinstance(obj, torch.SymInt):
        return hint(obj)
    if isinstance(obj, (tuple, list)):
        out = [hinted(v) for v in obj]
        return obj if all(a is b for a, b in zip(out, obj)) else type(obj)(out)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.init:
                value = getattr(obj, f.name)
                new = hinted(value)
                if new is not value:
                    changes[f.name] = new
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def size_arguments(kernel) -> list[str]:
    """The kernel's size parameters as LLVM IR (`i64 %x_size0`), after its pointers."""
    return [f"i64 %{name}" for name in size_params(kernel)]


class Sizes:
    """The size values of one LLVM function: the instructions that compute them from its size
    arguments (`lines`, for its entry block), each size computed once. `counter` is the
    function's SSA counter, so that these names never meet another's."""

    def __init__(self, counter):
        self.counter = counter
        self.lines: list[str] = []
        self._values: dict = {}  # sympy expression -> operand

    def operand(self, x) -> str:
        """The i64 operand of size `x` (an int, a SymInt, or its sympy expression): its number,
        or an SSA value."""
        value = known(x)
        if value is not None and not hasattr(value, "free_symbols"):
            return str(value)
        return self._expr(named(x) if isinstance(x, torch.SymInt) else x)

    def real(self, x) -> str:
        """The double operand of a float computed from sizes (a SymFloat: batch norm's factor
        `n / (n - 1)` for the unbiased variance it keeps): instructions over the size arguments,
        as the C++ backend writes the expression in double, so that one program serves every
        size of the family (a number here would be a guard `n / (n - 1) == 1.003...`)."""
        return self._real(named(x))

    def _real(self, expr) -> str:
        import sympy
        from torch.utils._sympy import functions as fn
        if expr.is_number:
            return "0x" + struct.pack(">d", float(expr)).hex().upper()
        key, args = ("double", expr), expr.args
        if key in self._values:
            return self._values[key]
        if expr.is_integer:  # an int of sizes (`64*x_size0`), converted
            value = self._emit(f"sitofp i64 {self._expr(expr)} to double", expr)
        elif isinstance(expr, (fn.IntTrueDiv, fn.FloatTrueDiv)):
            value = self._emit(f"fdiv double {self._real(args[0])}, {self._real(args[1])}", expr)
        elif isinstance(expr, fn.ToFloat):
            value = self._real(args[0])
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            op = "fadd" if isinstance(expr, sympy.Add) else "fmul"
            value = self._real(args[0])
            for term in args[1:]:
                value = self._emit(f"{op} double {value}, {self._real(term)}", expr)
        else:
            raise NotImplementedError(f"fusec: the LLVM backend cannot compute the float {expr} "
                                      f"({type(expr).__name__}) from its size arguments")
        self._values[key] = value
        return value

    def _expr(self, expr) -> str:
        import sympy
        if expr.is_Integer:
            return str(int(expr))
        if expr.is_Symbol:
            return f"%{expr.name}"
        if expr not in self._values:
            self._values[expr] = self._compute(expr, sympy)
        return self._values[expr]

    def _emit(self, rhs: str, comment) -> str:
        name = f"%size.{next(self.counter)}"
        self.lines.append(f"{name} = {rhs}  ; {comment}")
        return name

    def _compute(self, expr, sympy) -> str:
        from torch.utils._sympy import functions as fn
        args = expr.args
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            op = "add" if isinstance(expr, sympy.Add) else "mul"
            # numbers last (`mul nsw i64 %x_size0, 64`), the rest in sympy's order
            terms = sorted(args, key=lambda a: a.is_Number)
            acc = self._expr(terms[0])
            for term in terms[1:]:
                acc = self._emit(f"{op} nsw i64 {acc}, {self._expr(term)}", expr)
            return acc
        if isinstance(expr, (sympy.Pow, fn.PowByNatural)) and args[1].is_Integer \
                and int(args[1]) >= 1:
            base, acc = self._expr(args[0]), self._expr(args[0])
            for _ in range(int(args[1]) - 1):
                acc = self._emit(f"mul nsw i64 {acc}, {base}", expr)
            return acc
        if isinstance(expr, fn.FloorDiv):  # (CleanDiv too: a FloorDiv known to be exact)
            return self._floor(args[0], args[1], expr, "div")
        if isinstance(expr, (fn.PythonMod, fn.Mod, sympy.Mod)):
            return self._floor(args[0], args[1], expr, "rem")
        if isinstance(expr, fn.ModularIndexing):  # (x // div) % mod
            return self._floor(fn.FloorDiv(args[0], args[1]), args[2], expr, "rem")
        if isinstance(expr, fn.CeilDiv):  # -((-a) // b)
            down = self._floor(-args[0], args[1], expr, "div")
            return self._emit(f"sub nsw i64 0, {down}", expr)
        if isinstance(expr, (fn.Max, fn.Min, sympy.Max, sympy.Min)):
            which = "smax" if isinstance(expr, (fn.Max, sympy.Max)) else "smin"
            acc = self._expr(args[0])
            for a in args[1:]:
                acc = self._emit(f"call i64 @llvm.{which}.i64(i64 {acc}, i64 {self._expr(a)})",
                                 expr)
            return acc
        if isinstance(expr, fn.Identity):
            return self._expr(args[0])
        raise NotImplementedError(f"fusec: the LLVM backend cannot compute the size {expr} "
                                  f"({type(expr).__name__}) from its size arguments")

    def _floor(self, a, b, expr, what: str) -> str:
        """a // b or a % b rounded as Python rounds (towards minus infinity)."""
        x, y = self._expr(a), self._expr(b)
        q = self._emit(f"s{what} i64 {x}, {y}", expr)
        if a.is_nonnegative and b.is_positive:
            return q  # both non-negative: rounding towards zero is rounding down
        # sdiv/srem round towards zero; when the remainder's sign differs from the divisor's,
        # the quotient is one too large and the remainder one divisor too small
        r = q if what == "rem" else self._emit(f"srem i64 {x}, {y}", expr)
        if b.is_positive or b.is_negative:  # (the divisor's sign is known: a size, a number)
            fix = self._emit(f"icmp {'slt' if b.is_positive else 'sgt'} i64 {r}, 0", expr)
        else:
            r_neg = self._emit(f"icmp slt i64 {r}, 0", expr)
            y_neg = self._emit(f"icmp slt i64 {y}, 0", expr)
            differ = self._emit(f"xor i1 {r_neg}, {y_neg}", expr)
            nonzero = self._emit(f"icmp ne i64 {r}, 0", expr)
            fix = self._emit(f"and i1 {differ}, {nonzero}", expr)
        if what == "div":
            one = self._emit(f"zext i1 {fix} to i64", expr)
            return self._emit(f"sub nsw i64 {q}, {one}", expr)
        return self._emit(f"select i1 {fix}, i64 {self._emit(f'add nsw i64 {r}, {y}', expr)}, "
                          f"i64 {r}", expr)


def launch_functions(kernel, tiles, work) -> dict:
    """What the launcher asks the kernel at each launch when the answer depends on its sizes:
    how many tiles (or rows, or blocks) of work there are, `i64 @<name>.tiles_for(<the size
    arguments>)`, and whether threads pay off, `i1 @<name>.parallel_for(...)` (its work in bytes,
    `work`, against cpu_plan.PARALLEL_WORK). Returns the template's pieces of each
    (llvm_sizes.ll.j2), None for an answer that is a number: that one is a constant global,
    `@<name>.tiles` or `@<name>.parallel`, read once when the kernel is loaded."""
    import itertools
    from ..cpu_plan import PARALLEL_WORK

    def function(suffix, ty, value, comment):
        sizes = Sizes(itertools.count())
        if suffix == "parallel_for":
            value = sizes._emit(f"icmp sge i64 {sizes.operand(value)}, {PARALLEL_WORK}",
                                f"{text(value)} >= {PARALLEL_WORK}")
        else:
            value = sizes.operand(value)
        return dict(name=f"{kernel.name}.{suffix}", type=ty, params=size_arguments(kernel),
                    lines=sizes.lines, value=value, comment=comment)

    return dict(
        tiles_for=function("tiles_for", "i64", tiles, f"how much work there is: {text(tiles)} tiles")
        if is_symbolic(tiles) else None,
        parallel_for=function("parallel_for", "i1", work,
                              f"whether threads pay off: {text(work)} bytes of work, at least "
                              f"{PARALLEL_WORK}") if work is not None else None)
