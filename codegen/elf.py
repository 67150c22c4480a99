"""Checking a kernel binary before the loader maps it: is it a whole ELF file for this machine?

The C++ backend's `.so` goes to `dlopen` (through ctypes), the LLVM backend's `.o` to MCJIT's
linker. Both trust the file they are given: `dlopen` maps each loadable segment straight from the
file, so a library cut short (a full disk, a killed compiler, a damaged cache) is mapped past its
end, and the first touch of a page that is not there is SIGBUS, which ends the process. A file
that is not ELF at all (a broken `g++` that exits 0 with garbage) is refused by `dlopen` with an
OSError, but an object handed to MCJIT can crash it.

So before either loader sees a binary, `problem(data, kind)` reads its ELF header and tables in
Python, where a bad offset is an exception, not a signal:

    magic b"\\x7fELF", 64-bit, this CPU's byte order, version 1
    e_machine: this CPU's (x86-64 = 62, AArch64 = 183)
    e_type: ET_DYN (3) for a shared library, ET_REL (1) for an object file
    the program header table inside the file, and every PT_LOAD segment's bytes inside it
    the section header table inside the file, every section's bytes (except NOBITS: .bss)
    inside it, and the section-name table's index a real section

It returns a sentence saying what is wrong, or None. It is cheap (a few struct reads over bytes
the cache has just read to check their hash) and it is not a proof: a file whose tables are all in
bounds can still hold nonsense. Flipping random bytes of a kernel's object file (and re-signing
it) still ended the process in about one case in ten where the bytes were code (SIGILL, SIGSEGV
at the first call) or a relocation whose type does not suit its place (an LLVM assertion). What
stands between such a file and the loader is the cache's integrity check: fusec loads only
binaries that this user's fusec built and signed, byte for byte (fusec/cache.py). This check
catches what gets past a compiler's exit status and a matching hash: truncation, garbage from a
broken compiler, a file written over by something that also rewrote its manifest.
"""
from __future__ import annotations

import platform
import struct
import sys

ET_REL, ET_DYN = 1, 3
PT_LOAD = 1
SHT_NOBITS = 8
MACHINES = {"x86_64": 62, "AMD64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21,
            "riscv64": 243, "s390x": 22}
KINDS = {"shared": ET_DYN, "relocatable": ET_REL}


def problem(data: bytes, kind: str) -> str | None:
    """What keeps `data` from being a whole ELF file of `kind` ("shared" or "relocatable") for
    this machine, in a few words; None if nothing does."""
    size = len(data)
    if size < 64:
        return f"{size} bytes: too short for an ELF header"
    if data[:4] != b"\x7fELF":
        return f"not an ELF file (it starts with {data[:8]!r})"
    if data[4] != 2 or sys.maxsize <= 2 ** 32:
        return f"ELF class {data[4]}: fusec builds and loads 64-bit kernels only"
    order = "<" if data[5] == 1 else ">" if data[5] == 2 else None
    if order is None or (order == "<") != (sys.byteorder == "little"):
        return f"ELF data encoding {data[5]} does not match this CPU's byte order"
    if data[6] != 1:
        return f"ELF version {data[6]}, not 1"
    e_type, e_machine = struct.unpack_from(order + "HH", data, 16)
    if e_type != KINDS[kind]:
        return f"ELF type {e_type}, not {KINDS[kind]} ({kind})"
    machine = MACHINES.get(platform.machine())
    if machine is not None and e_machine != machine:
        return f"ELF machine {e_machine}, not this CPU's ({machine}, {platform.machine()})"
    phoff, shoff = struct.unpack_from(order + "QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(order + "HHHHH", data, 0x36)
    if kind == "shared" and phnum == 0:
        return "a shared library without program headers"
    if phnum:
        if phentsize < 56:
            return f"program header entries of {phentsize} bytes (at least 56)"
        if phoff + phnum * phentsize > size:
            return f"its program headers end at byte {phoff + phnum * phentsize}, past its " \
                   f"{size} bytes (cut short?)"
        for i in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(order + "IIQQQQ", data,
                                                                     phoff + i * phentsize)
            if p_type == PT_LOAD and p_offset + p_filesz > size:
                return f"loadable segment {i} ends at byte {p_offset + p_filesz}, past its " \
                       f"{size} bytes (cut short?)"
    if kind == "relocatable" and shnum == 0:
        return "an object file without sections"
    if shnum:
        if shentsize < 64:
            return f"section header entries of {shentsize} bytes (at least 64)"
        if shoff + shnum * shentsize > size:
            return f"its section headers end at byte {shoff + shnum * shentsize}, past its " \
                   f"{size} bytes (cut short?)"
        if shstrndx >= shnum:
            return f"section-name table {shstrndx} of {shnum} sections"
        sections = [struct.unpack_from(order + "IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        for i, (_, sh_type, _, _, sh_offset, sh_size, sh_link, _, align, _) in enumerate(sections):
            if sh_type != SHT_NOBITS and sh_offset + sh_size > size:
                return f"section {i} ends at byte {sh_offset + sh_size}, past its {size} bytes"
            if sh_link >= shnum:
                return f"section {i} links to section {sh_link} of {shnum}"
            if align & (align - 1):
                return f"section {i} is aligned to {align} bytes, not a power of two"
        if kind == "relocatable":
            return _links(data, order, sections, e_machine)
    return None


SHT_SYMTAB, SHT_STRTAB, SHT_RELA, SHN_LORESERVE = 2, 3, 4, 0xFF00


def _links(data: bytes, order: str, sections: list, machine: int) -> str | None:
    """An object file's symbols and relocations, which MCJIT's linker follows without checking:
    every symbol's name inside its string table and its section a real one; every relocation's
    symbol a real symbol, its place inside the section it patches, and (on x86-64) its type one
    that exists. What is not checked: whether a relocation's type suits its place, or the code."""
    for i, (_, sh_type, _, _, offset, size, link, info, _, entsize) in enumerate(sections):
        if sh_type == SHT_SYMTAB:
            if entsize != 24 or size % 24 or sections[link][1] != SHT_STRTAB:
                return f"symbol table {i} is malformed (entries of {entsize} bytes)"
            names = sections[link][5]
            for at in range(offset, offset + size, 24):
                name, _, _, shndx = struct.unpack_from(order + "IBBH", data, at)
                if name >= max(names, 1) or (len(sections) <= shndx < SHN_LORESERVE):
                    return f"a symbol of table {i} points outside its names or sections"
        elif sh_type == SHT_RELA:
            symtab = sections[link]
            if entsize != 24 or size % 24 or symtab[1] != SHT_SYMTAB or info >= len(sections):
                return f"relocation section {i} is malformed"
            n_symbols, patched = symtab[5] // 24, sections[info][5]
            for at in range(offset, offset + size, 24):
                place, what = struct.unpack_from(order + "QQ", data, at)
                if what >> 32 >= n_symbols or place >= patched:
                    return f"a relocation of section {i} points outside its section or symbols"
                if machine == 62 and what & 0xFFFFFFFF > 43:  # (x86-64's types end at 43)
                    return f"a relocation of section {i} has no x86-64 type ({what & 0xFFFFFFFF})"
    return None


def undefined_symbols(obj: bytes) -> list[str]:
    """The names an ELF64 object calls but does not define (libm's sinf, libmvec's vector sines,
    memset, or a compiler-runtime routine such as __truncsfbf2). Reads the symbol table, which
    is all a linker needs to know here; other object formats return []."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:  # ELF, 64-bit, little-endian
        return []
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
            name_at, info, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", obj, at)
            if shndx == 0 and info >> 4 in (1, 2):  # undefined, global or weak binding
                end = obj.index(b"\0", strtab + name_at)
                names.append(obj[strtab + name_at:end].decode(errors="replace"))  # (damaged: refused)
    return names
