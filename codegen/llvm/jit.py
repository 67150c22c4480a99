"""Driving llvmlite: LLVM IR text in, optimized IR, assembly or object code out, and the object
files cached on disk. LLVM itself runs in a guarded compiler process (llvm/compiler.py), so an
LLVM assertion cannot take the user's program down; what stays here is the cache and the
llvmlite objects the loader in llvm/__init__.py needs (the binding, a target machine).
"""
from __future__ import annotations

import functools
from pathlib import Path


from fusec import cache
from fusec.errors import CompileError

from .. import elf, tools
from . import compiler as llvm_build
from .compiler import Target, host
from .ir import has_symbol

# ---- compiling -----------------------------------------------------------------------------------
# codegen/llvm/compiler.py drives llvmlite: targets, and the compiler process that runs LLVM's
# optimizer and code generator outside the user's process (an LLVM assertion there cannot take
# the user's program down). What stays here: the cache, and loading the machine code.

def llvm_binding():
    """llvmlite.binding, initialized once (all targets; libmvec loaded into the process)."""
    return llvm_build.binding()


def target_machine():
    """A new target machine for this CPU: all its features, O3 (an execution engine takes
    ownership of the one it is given)."""
    return llvm_build.target_machine(host())


@functools.lru_cache(maxsize=None)
def triple_and_layout() -> tuple[str, str]:
    """Read once: llvmlite hands out these strings from memory it may later reuse."""
    return host().triple, llvm_build.data_layout(host())


def available() -> bool:
    try:
        llvm_binding()
        return True
    except Exception:  # llvmlite missing or broken
        return False


def host_id(target: Target | None = None) -> str:
    """What the object code depends on besides the IR: LLVM's version and the target."""
    return f"{llvm_binding().llvm_version_info} {target or host()!r}"


def _compile(source: str, what: str, name: str, target: Target | None = None):
    """LLVM's optimizer (and code generator) in the guarded compiler process, which has
    FUSEC_BUILD_TIMEOUT seconds to answer (codegen/tools.py) before it is killed."""
    try:
        return llvm_build.guarded(source, target or host(), what, name, tools.timeout())
    except llvm_build.BuildError as exc:
        raise CompileError(f"fusec: LLVM could not compile kernel {name}: {exc}") from None


def optimized_ir(source: str, name: str = "kernel") -> str:
    """The kernel after LLVM's optimizer: what the vectorizer made of the loops."""
    return _compile(source, "optimized", name)


def assembly(source: str, name: str = "kernel", target: Target | None = None) -> str:
    """The machine code of the kernel (for this CPU, or `target`), as assembly."""
    return _compile(source, "assembly", name, target)


def object_code(source: str, name: str = "kernel", target: Target | None = None) -> bytes:
    """The kernel as an object file's bytes (for this CPU, or `target`)."""
    return _compile(source, "object", name, target)


def build(source: str, name: str) -> Path:
    """Compile `source` to an object file (or reuse the cached one). Returns its path."""
    key = cache.content_hash(source, host_id(), "O3 loop+slp vectorize, no unroll",
                             "lsr" if llvm_build.LSR else "no lsr")
    obj = cache.cache_dir("llvm") / f"{name}-{key}.o"
    return cache.build_once(obj, source, ".ll",
                            lambda tmp: tmp.write_bytes(object_code(source, name)))


def check_symbols(data: bytes, name: str) -> None:
    """Refuse to load machine code that calls a function this process lacks: MCJIT would link
    the call to address 0, and the kernel would crash the process on its first run. (This is
    how a `bfloat` conversion used to fail on older systems: a call to libgcc's __truncsfbf2.)"""
    missing = [s for s in elf.undefined_symbols(data) if not has_symbol(s)]
    if missing:
        raise CompileError(f"fusec: kernel {name}'s machine code calls {', '.join(missing)}, "
                           f"which this process does not have")
