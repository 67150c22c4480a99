"""The cache only ever loads what this user built (fusec/cache.py's note), writes atomically,
falls back to a private directory when it cannot be used, stays under its size cap, and fusec's
environment variables are read strictly (fusec/env.py).

We run the suite as root, so "another user" is a file or folder `os.chown`ed to another uid
(OTHER) by the test that plants it. A planted file carries a payload that would write a marker
file if it ever ran (a shared library's constructor, a pickle's `__reduce__`, a Triton module's
top level); every test checks that the marker was never written and that the program still gives
eager's answer.
"""
import errno
import hashlib
import importlib
import importlib.util
import json
import marshal
import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import fusec
from fusec import cache
from fusec.errors import CompileError, FusecError

OTHER = 12345  # the uid of "another user"


def f(x):
    return torch.sin(x) * 2 + 1


X = torch.linspace(-3, 3, 257)


def run(backend: str, fn=f, x=X):
    """Compile `fn` afresh, call it, compare with eager; returns the compiled function."""
    cf = fusec.compile(fn, backend=backend)
    torch.testing.assert_close(cf(x), fn(x))
    return cf


def entry(root: Path, kind: str, suffix: str) -> Path:
    (path,) = (root / kind).glob("*" + suffix)
    return path


def plant(path: Path, data: bytes, owner: int = OTHER, mode: int = 0o644) -> None:
    """Write `data` at `path` as another user would: owned by `owner`, with `mode`."""
    path.write_bytes(data)
    os.chown(path, owner, owner)
    os.chmod(path, mode)


def forged_manifest(path: Path, owner: int = OTHER, **extra) -> None:
    """The manifest another user can write for a file: its sha256 is right, its HMAC is not."""
    record = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), **extra}
    plant(path.with_suffix(".json"), json.dumps(record).encode(), owner)


def evil_library(marker: Path, out: Path) -> bytes:
    """A shared library whose constructor writes `marker` when it is loaded."""
    src = out.with_suffix(".c")
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void boom(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True, timeout=120)
    return out.read_bytes()


def forget_triton_modules() -> None:
    """A Triton module is imported once per process (sys.modules): forget the ones imported so
    far, as a new process would not have them, so the planted file is what the import would see."""
    for name in [n for n in sys.modules if n.startswith("fusec_kernels.")]:
        del sys.modules[name]


class Bomb:
    """Unpickling this opens (creates) the marker file: code run by `pickle.loads`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ---- planted files ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, suffix", [("cpp", ".so"), ("llvm", ".o")])
@pytest.mark.parametrize("owner", ["other user", "ours, unsigned manifest"])
def test_planted_binary_is_refused_and_rebuilt(tmp_path, monkeypatch, backend, suffix, owner):
    """The exact file a kernel will load, planted with a manifest that matches it: refused."""
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "scratch"))
    run(backend)  # to learn the file name the kernel is cached under
    name = entry(tmp_path / "scratch", backend, suffix).name

    marker = tmp_path / "marker"
    victim = tmp_path / "victim"
    (victim / backend).mkdir(parents=True)
    os.chmod(victim, 0o777)  # world-writable before first use: anyone could plant
    os.chmod(victim / backend, 0o777)
    planted = victim / backend / name
    data = evil_library(marker, tmp_path / "evil.so")
    uid = OTHER if owner == "other user" else os.getuid()
    plant(planted, data, uid)
    forged_manifest(planted, uid)

    monkeypatch.setenv("FUSEC_CACHE_DIR", str(victim))
    before = dict(cache.STATS)
    run(backend)
    assert not marker.exists(), "the planted library's constructor ran"
    assert cache.STATS["untrusted"] == before.get("untrusted", 0) + 1
    assert cache.STATS["compiles"] == before.get("compiles", 0) + 1
    assert planted.stat().st_uid == os.getuid() and planted.read_bytes() != data  # built over it
    assert oct(planted.parent.stat().st_mode & 0o777) == "0o700"


def test_planted_triton_module_and_code_are_not_imported(tmp_path, monkeypatch):
    """The triton backend writes each kernel as a Python module (and its compiled code, `.pyc`)
    and imports it: another user's module or code under the right name is never run."""
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "scratch"))
    run("triton")
    module = entry(tmp_path / "scratch", "triton", ".py")
    source = module.read_bytes()

    marker = tmp_path / "marker"
    victim = tmp_path / "victim" / "triton"
    victim.mkdir(parents=True)
    evil = f"open({str(marker)!r}, 'w').write('ran')\n"
    plant(victim / module.name, evil.encode())  # another user's module under the kernel's name
    code = marshal.dumps(compile(evil, "evil", "exec"))  # and code stamped as the real module's
    stamp = importlib.util.MAGIC_NUMBER + hashlib.sha256(source).digest()[:16]
    plant(victim / (module.stem + ".pyc"), stamp + hashlib.sha256(code).digest()[:16] + code)

    monkeypatch.setenv("FUSEC_CACHE_DIR", str(victim.parent))
    forget_triton_modules()
    run("triton")
    assert not marker.exists(), "the planted module ran"
    assert (victim / module.name).read_bytes() == source
    assert (victim / module.name).stat().st_uid == os.getuid()


@pytest.mark.parametrize("how", ["other user, sha256 manifest", "ours, no manifest",
                                 "ours, unsigned manifest", "ours, wrong signature"])
def test_planted_program_pickle_is_never_unpickled(tmp_path, monkeypatch, how):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "1")
    run("cpp")
    (program,) = (tmp_path / "cache" / "programs").glob("*.pkl")

    marker = tmp_path / "marker"
    uid = OTHER if how.startswith("other") else os.getuid()
    plant(program, pickle.dumps(Bomb(marker)), uid)
    program.with_suffix(".json").unlink()
    if how == "ours, wrong signature":
        forged_manifest(program, uid, hmac="0" * 64)
    elif how != "ours, no manifest":
        forged_manifest(program, uid)

    before = cache.STATS["programs loaded"]
    run("cpp")  # same call, same fingerprint: the saved program would be loaded
    assert not marker.exists(), "the planted pickle was unpickled"
    assert cache.STATS["programs loaded"] == before
    run("cpp")  # saved again, signed: now it loads
    assert cache.STATS["programs loaded"] == before + 1


@pytest.mark.parametrize("backend, suffix", [("cpp", ".so"), ("llvm", ".o"), ("triton", ".py")])
def test_shown_program_loads_only_this_users_kernels(fresh, backend, suffix):
    """`cf.source()` loads its kernels with `load_launcher(path)`: the path is checked too."""
    from fusec.runtime import load_launcher
    cf = run(backend)
    path = entry(fresh, backend, suffix)
    k = cf.kernels[0]
    assert load_launcher(str(path), k.built.ir.name, len(k.ir.params)) is not None
    os.chown(path, OTHER, OTHER)
    with pytest.raises(FusecError, match="not loading.*another user"):
        load_launcher(str(path), k.built.ir.name, len(k.ir.params))


def test_manifest_signed_with_another_key_is_refused(fresh):
    """A cache copied from another user (their key, their signatures) is rebuilt, not trusted."""
    run("cpp")
    lib = entry(fresh, "cpp", ".so")
    assert cache.verified(lib)
    (fresh / cache.KEY).unlink()  # another key from now on: every signature is foreign
    assert not cache.verified(lib)
    run("cpp")  # (a new compile object: built again, signed with the new key)
    assert cache.verified(lib)


def test_foreign_key_file_is_replaced(fresh):
    cache.cache_dir("cpp")
    key = fresh / cache.KEY
    plant(key, b"k" * 32, OTHER, 0o600)  # a key another user made: they know it
    assert cache.key() != b"k" * 32
    assert key.stat().st_uid == os.getuid() and key.stat().st_mode & 0o777 == 0o600


# ---- the path to the cache ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
def test_world_writable_parent_without_sticky_bit_is_refused(tmp_path, monkeypatch, backend):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    wanted = shared / "cache"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(wanted))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    with pytest.warns(cache.CacheWarning, match=r"writable by other users.*FUSEC_CACHE_DIR"):
        run(backend)
    assert cache.root() != wanted and not wanted.exists()  # nothing made under it
    assert cache.root().stat().st_mode & 0o777 == 0o700


def test_world_writable_parent_with_sticky_bit_is_accepted(tmp_path, monkeypatch):
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: others may write, but not rename our folder
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(shared / "cache"))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        run("cpp")
    assert cache.root() == shared / "cache"
    assert entry(shared / "cache", "cpp", ".so").exists()


@pytest.mark.parametrize("setup, reason", [
    ("parent owned by another user", "belongs to another user"),
    ("symbolic link owned by another user", "symbolic link owned by user"),
    ("cache folder owned by another user", "belongs to another user"),
    ("kind folder owned by another user", "belongs to another user"),
    ("kind folder is another user's symbolic link", "symbolic link owned by user"),
])
def test_foreign_folders_on_the_path_are_refused(tmp_path, monkeypatch, setup, reason):
    parent = tmp_path / "parent"
    parent.mkdir()
    wanted = parent / "cache"
    if setup == "parent owned by another user":
        os.chown(parent, OTHER, OTHER)
    elif setup == "symbolic link owned by another user":
        (tmp_path / "link").symlink_to(parent)
        os.lchown(tmp_path / "link", OTHER, OTHER)
        wanted = tmp_path / "link" / "cache"
    elif setup == "cache folder owned by another user":
        wanted.mkdir(mode=0o700)
        os.chown(wanted, OTHER, OTHER)
    elif setup == "kind folder owned by another user":
        (wanted / "cpp").mkdir(parents=True, mode=0o700)
        os.chown(wanted / "cpp", OTHER, OTHER)
    else:  # planted while the cache was open, pointing at a folder of ours
        wanted.mkdir(mode=0o700)
        (tmp_path / "ours").mkdir(mode=0o700)
        (wanted / "cpp").symlink_to(tmp_path / "ours")
        os.lchown(wanted / "cpp", OTHER, OTHER)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(wanted))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    with pytest.warns(cache.CacheWarning, match=reason):
        run("cpp")
    assert cache.root() != wanted


def _unusable(tmp_path: Path, kind: str) -> Path:
    if kind == "file instead of folder":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile"
    if kind == "parent is a file":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile" / "cache"
    if kind == "name too long":
        return tmp_path / ("n" * 300) / "cache"
    return Path("/sys/fusec-cache-test")  # cannot be made, even by root (sysfs)


@pytest.mark.parametrize("kind, reason", [
    ("file instead of folder", "is a file, not a folder"),
    ("parent is a file", "is a file, not a folder"),
    ("name too long", "too long"),
    ("cannot be created", "not permitted|permission denied|read-only"),
])
def test_unusable_cache_warns_and_falls_back(tmp_path, monkeypatch, kind, reason):
    wanted = _unusable(tmp_path, kind)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(wanted))
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "1")
    with pytest.warns(cache.CacheWarning, match=reason) as caught:
        run("cpp")
    assert len([w for w in caught if issubclass(w.category, cache.CacheWarning)]) == 1
    message = next(str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning))
    assert "FUSEC_CACHE_DIR" in message and str(wanted) in message
    assert cache.root() != wanted and list((cache.root() / "cpp").glob("*.so"))


@pytest.mark.parametrize("backend", ["cpp", "llvm", "triton"])
@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "disk is full"),
                                          (errno.EROFS, "read-only file system")])
def test_unwritable_cache_mid_use_falls_back(fresh, monkeypatch, backend, code, reason):
    """The disk fills up (or is remounted read-only) after the cache was checked: each write
    there fails with ENOSPC or EROFS (simulated, for files under the cache only; root ignores
    permission bits); one warning, the kernel is built in the private cache, no temporary file
    is left behind."""
    cache.cache_dir(backend)  # checked and in use
    real_write = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(fresh)):
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.warns(cache.CacheWarning, match=f"{reason}.*FUSEC_CACHE_DIR"):
        run(backend)
    assert cache.root() != fresh
    assert not [p for p in fresh.rglob("*") if p.is_file() and p.name != cache.KEY]


def test_compiler_out_of_space_falls_back(fresh, monkeypatch, tmp_path):
    """g++ itself finds the disk full while writing the library (a g++ wrapper that says so for
    outputs under the cache): the build moves to the private cache, with one warning."""
    from fusec.codegen import cpp
    wrapper = tmp_path / "g++"
    wrapper.write_text(f"""#!/bin/sh
for a in "$@"; do case "$a" in {fresh}/*.tmp)
  echo "/usr/bin/ld: final link failed: No space left on device" >&2; exit 1;; esac; done
exec g++ "$@"
""")
    wrapper.chmod(0o755)
    monkeypatch.setattr(cpp, "find_compiler", lambda: str(wrapper))
    with pytest.warns(cache.CacheWarning, match="disk is full.*FUSEC_CACHE_DIR"):
        run("cpp")
    assert cache.root() != fresh and list((cache.root() / "cpp").glob("*.so"))
    assert not list(fresh.rglob("*.tmp"))


def test_tilde_and_relative_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FUSEC_CACHE_DIR", "~/fc")
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "0")
    monkeypatch.chdir(tmp_path)
    assert cache.configured() == tmp_path / "home" / "fc"
    run("cpp")
    assert entry(tmp_path / "home" / "fc", "cpp", ".so").exists()
    assert not (tmp_path / "~").exists()
    monkeypatch.setenv("FUSEC_CACHE_DIR", "rel/fc")
    assert cache.configured() == tmp_path / "rel" / "fc"


# ---- strict environment variables ---------------------------------------------------------------

@pytest.mark.parametrize("value, want", [("0", False), ("false", False), ("OFF", False),
                                         ("no", False), ("1", True), ("True", True),
                                         ("on", True), (" yes ", True), ("", True)])
def test_flag_spellings(monkeypatch, value, want):
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", value)
    from fusec.runtime.fast_start import saved
    assert saved.enabled() is want


@pytest.mark.parametrize("name, value, read", [
    ("FUSEC_SAVED_PROGRAMS", "maybe", lambda: __import__("fusec.runtime.fast_start.saved").runtime.fast_start.saved.enabled()),
    ("FUSEC_PDL", "2", lambda: __import__("fusec.runtime.fast_start.pdl").runtime.fast_start.pdl.pdl_enabled()),
    ("FUSEC_PROGRESS", "loud", lambda: __import__("fusec.progress").progress.enabled()),
    ("FUSEC_COMPILE_JOBS", "many", lambda: __import__("fusec.runtime.build").runtime.build.jobs()),
    ("FUSEC_COMPILE_JOBS", "-2", lambda: __import__("fusec.runtime.build").runtime.build.jobs()),
    ("FUSEC_CACHE_MAX_MB", "1e3", cache.max_bytes),
    ("FUSEC_CACHE_MAX_MB", "0", cache.max_bytes),
    ("FUSEC_LAYOUT", "sideways", lambda: fusec.compile(torch.nn.Conv2d(2, 2, 3), backend="cpp")(
        torch.randn(1, 2, 5, 5))),
    ("FUSEC_INT4_MMA", "nope", lambda: importlib.import_module(
        "fusec.extensions.quant_gemv.triton_gemv_int4_mma").mma_enabled()),
])
def test_bad_value_is_an_error_naming_the_variable(monkeypatch, name, value, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(FusecError, match=name) as err:
        read()
    assert repr(value) in str(err.value)


def test_bad_value_reaches_the_user_as_a_clear_error(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", "maybe")
    with pytest.raises(FusecError, match=r"FUSEC_SAVED_PROGRAMS='maybe' is not a switch.*off"):
        fusec.compile(f, backend="cpp")(X)


@pytest.mark.parametrize("value", ["false", "off", "no"])
def test_saved_programs_off_spellings(fresh, monkeypatch, value):
    monkeypatch.setenv("FUSEC_SAVED_PROGRAMS", value)
    run("cpp")
    assert not list((fresh / "programs").glob("*.pkl"))


# ---- writes -------------------------------------------------------------------------------------

def test_threads_write_one_file_at_once(fresh):
    path = cache.cache_dir("programs") / "same.json"
    errors = []

    def write(i):
        try:
            for j in range(20):
                assert cache.atomic_write(path, f"{i} {j} " * 100) == path
        except Exception as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(path.read_text().split(" ")) - {""}) == 2  # one whole write, not a mix
    assert not list(path.parent.glob("*.tmp"))


def test_threads_build_one_kernel_at_once(fresh):
    """Two threads (here four) building the same C++ kernel: one compiles, the others find it;
    no FileNotFoundError from a shared temporary name, no temporary file left."""
    from fusec.codegen import cpp
    cf = run("cpp")
    source = cf.kernels[0].canonical
    for p in (fresh / "cpp").iterdir():
        p.unlink()
    before = cache.STATS["compiles"]
    results, errors = [], []

    def build():
        try:
            results.append(cpp.build(source, "fused_sin_mul_add"))
        except Exception as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results)) == 1 and cache.verified(results[0])
    assert cache.STATS["compiles"] == before + 1
    assert sorted(p.suffix for p in (fresh / "cpp").iterdir()) == [".cpp", ".json", ".so"]


def test_failed_build_leaves_no_temporary_file(fresh):
    artifact = cache.cache_dir("llvm") / "k-0.o"

    def make(tmp):
        tmp.write_bytes(b"half an object")
        raise CompileError("the compiler refused")
    with pytest.raises(CompileError):
        cache.build_once(artifact, "source", ".ll", make)
    assert sorted(p.name for p in artifact.parent.iterdir()) == ["k-0.ll"]


# ---- the size cap -------------------------------------------------------------------------------

def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != cache.KEY)


def _old_entry(i: int, age_s: float, size: int = 64 << 10) -> Path:
    """A built entry (source, binary, manifest) last used `age_s` seconds ago."""
    artifact = cache.cache_dir("llvm") / f"k{i}-{i:020d}.o"
    cache.build_once(artifact, "source", ".ll", lambda tmp: tmp.write_bytes(os.urandom(size)))
    then = time.time() - age_s
    for p in artifact.parent.glob(artifact.stem + ".*"):
        os.utime(p, (then, then))
    return artifact


def test_size_cap_evicts_least_recently_used(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CACHE_MAX_MB", "1")
    entries = [_old_entry(i, age_s=3600 - 60 * i) for i in range(40)]  # 2.5 MiB, oldest first
    assert _size(fresh) <= (1 << 20) + (1 << 20) // 8 + (64 << 10)  # checked as it grows
    cache.evict()
    assert _size(fresh) <= 1 << 20
    kept = [cache.verified(e) for e in entries]
    assert kept[-1] and not kept[0]  # the newest kept, the oldest gone
    assert kept == sorted(kept), "evicted out of order"
    for e in entries:  # whole entries: no manifest or source left without its binary
        assert e.exists() == e.with_suffix(".json").exists() == e.with_suffix(".ll").exists()


def test_size_cap_keeps_what_was_just_used(fresh, monkeypatch):
    old = [_old_entry(i, age_s=3600) for i in range(30)]  # 1.9 MiB under the default cap
    monkeypatch.setenv("FUSEC_CACHE_MAX_MB", "1")
    before = cache.STATS["hits"]
    cache.build_once(old[0], "source", ".ll", lambda tmp: None)  # a hit touches it: used now
    assert cache.STATS["hits"] == before + 1
    run("cpp")  # a real kernel compiled into the full cache
    cache.evict()
    assert _size(fresh) <= 1 << 20
    assert cache.verified(old[0]) and entry(fresh, "cpp", ".so").exists()
    assert sum(cache.verified(e) for e in old) < 30
