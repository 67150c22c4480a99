"""On-disk cache of generated sources and built kernels, keyed by content hash.

Why this file is long: what the cache trusts (the path, each file, each signature) and how it
writes (unique temporary names, the private fallback, the size cap) are one contract, read
together: every write has to leave what the reads check, so they stay in one file.

Layout (one directory per user, mode 0700):

    ~/.cache/fusec/                   or $FUSEC_CACHE_DIR (`~` expanded), or $XDG_CACHE_HOME/fusec
      key                             this user's secret key (32 random bytes, mode 0600)
      cpp/<name>-<hash>.cpp           the rendered source
      cpp/<name>-<hash>.so            the shared library built from it
      cpp/<name>-<hash>.json          {"sha256": <hash of the .so>, "hmac": <its signature>},
                                      written last
      llvm/<name>-<hash>.ll|.o|.json  the same for the LLVM backend
      triton/<name>-<hash>.py         a generated Triton module
      triton/<name>-<hash>.pyc        its compiled Python code, stamped with the module's hash
      programs/<fingerprint>.pkl      a whole compiled program (runtime/fast_start/saved.py), and its
      programs/<fingerprint>.json     signed manifest

The key hashes everything that decides the artifact: the source text, the compiler and its flags.
Files are written to a unique temporary name and renamed into place, so a reader never sees half
a file. `STATS` counts hits, misses, rebuilds and refusals so tests and `FUSEC_LOG=cache` can show
that a second process compiles nothing.

Note: the cache only ever loads what this user built. Loading a kernel runs its code as you (a
shared library's constructors run at dlopen; unpickling a program can call anything), so a file
that another user could have written is never loaded:

* The directory. Before first use in a process, every folder on the way from `/` to the cache (the
  real path, symbolic links resolved) must belong to root or to you, and none may be writable by
  group or others unless it has the sticky bit (as /tmp has): otherwise another user could rename
  the cache away and put theirs in its place. A symbolic link on the way must not belong to
  another user either. The cache's own folders belong to you, with mode 0700. A path that fails
  this, or cannot be used at all (read-only, a file where a folder should be, a name too long, a
  full disk), gives one warning that names the path, the reason and FUSEC_CACHE_DIR, and the
  process builds into a private directory of its own (`tempfile.mkdtemp`, mode 0700) instead.
* Each file. A file is read only if it is a regular file that you own and that group and others
  cannot write (`read_bytes`); otherwise it is refused and counts as a miss, and the entry is
  built again over it.
* Each binary and saved program has a manifest with its sha256 and an HMAC-SHA256 of that hash,
  signed with the key: a file whose manifest does not match, or is not signed with this key (one
  another user forged along with the file), is a miss. A saved program's bytes are checked
  before they are unpickled.

The cache is capped at FUSEC_CACHE_MAX_MB megabytes (default 1024): after enough writes, the least
recently used entries (by modification time; a hit touches its entry) are deleted, a whole entry
at a time (source, binary, manifest).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import hmac
import json
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable

from fusec import env, events
from fusec.errors import CompileError, FusecError

STATS: Counter = Counter()

MAX_MB = 1024  # FUSEC_CACHE_MAX_MB's default
KEY = "key"  # the secret key's file name, in the cache's root
RECENT_S = 10.0  # an entry used this recently is never evicted (a build may not have loaded it yet)
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died mid-write


class CacheWarning(UserWarning):
    """The cache directory cannot be used; fusec builds into a private directory instead."""


class Untrusted(PermissionError):
    """A file in the cache that another user could have written: not loaded, a miss."""


# configured cache directory -> the directory used for it in this process (itself once trusted,
# else the private fallback)
_ROOTS: dict[Path, Path] = {}
_FALLBACK: Path | None = None
_KEYS: dict[Path, tuple] = {}  # cache root -> ((inode, mtime) of its key file, the key)
_LOCK = threading.RLock()
_BUILDING: dict[Path, threading.Lock] = {}  # artifact -> the lock a thread builds it under
_EVICTING = threading.Lock()
_written: int | None = None  # bytes written since the cache's size was last checked (None: not yet)


# ---- where the cache is, and whether it can be trusted ------------------------------------------

def configured() -> Path:
    """$FUSEC_CACHE_DIR, else $XDG_CACHE_HOME/fusec, else ~/.cache/fusec, absolute (not created)."""
    base = env.path("FUSEC_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(xdg)) / "fusec"


def root() -> Path:
    """The cache directory this process uses: the configured one, once checked (see the note
    above), else a private directory made for this process."""
    wanted = configured()
    used = _ROOTS.get(wanted)
    if used is None:
        with _LOCK:
            used = _ROOTS.get(wanted)
            if used is None:
                used = _ROOTS[wanted] = _choose(wanted)
    return used


def cache_dir(kind: str) -> Path:
    """The folder for one kind of file ("cpp", "llvm", "triton", "programs"), made if needed,
    owned by this user, mode 0700."""
    for _ in range(3):
        base = root()
        path = base / kind
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            problem = _own_dir(base) or _own_dir(path)
        except OSError as err:
            problem = describe(err)
        if problem is None:
            return path
        _give_up(base, problem)
    raise FusecError(f"fusec: no usable cache directory for {kind}")  # (not reached)


def _choose(wanted: Path) -> Path:
    try:
        problem = untrusted_path(wanted)  # before making anything in a folder we cannot trust
        if problem is None:
            wanted.mkdir(parents=True, exist_ok=True, mode=0o700)
            problem = untrusted_path(wanted) or _own_dir(wanted)
    except OSError as err:
        problem = describe(err)
    if problem is not None:
        return _fallback(wanted, problem)
    return wanted  # (a cache that cannot be written is found at the first write: `_relocated`)


def untrusted_path(path: Path) -> str | None:
    """Why `path` (a cache directory, made or not) is not safe to load code from, or None.
    Checks every folder from `/` down, on the real path: each must belong to root or to this
    user and be writable by nobody else unless it has the sticky bit; a symbolic link on the way
    must not belong to another user. (The cache folder itself is checked by `_own_dir`.)"""
    me = os.getuid()
    step = Path(path.anchor)
    for part in path.parts[1:]:
        step = step / part
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            return f"{step} is a symbolic link owned by user {st.st_uid}"
    real = Path(os.path.realpath(path))
    folders = [Path(real.anchor)] + [Path(real.anchor, *real.parts[1:i + 1])
                                     for i in range(1, len(real.parts))]
    for folder in folders:
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            break
        if not stat.S_ISDIR(st.st_mode):
            return f"{folder} is a file, not a folder"
        if folder == real:
            break  # the cache folder itself: `_own_dir`
        if st.st_uid not in (0, me):
            return f"{folder} belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{folder} is writable by other users (mode {oct(stat.S_IMODE(st.st_mode))}) "
                    "without the sticky bit")
    return None


def _own_dir(path: Path) -> str | None:
    """None if `path` is a folder of this user's, made private (0700) if it was not."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != os.getuid():
            return f"{path} is a symbolic link owned by user {st.st_uid}"
        st = os.stat(path)  # (a link of ours: the folder it points to must be ours too)
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # our own folder, left open: anything in it is checked file by file
    return None


def describe(err: OSError) -> str:
    """What an OSError means for a cache directory, in words."""
    where = f"{err.filename}: " if err.filename else ""
    reasons = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
               errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "the operation is not permitted",
               errno.ENOTDIR: "a part of the path is a file, not a folder",
               errno.EEXIST: "it is a file, not a folder",
               errno.ENAMETOOLONG: "a name in the path is too long"}
    return where + reasons.get(err.errno, err.strerror or str(err))


def _cache_fault(err: OSError) -> bool:
    """An error that says the cache cannot be written (rather than a bug)."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                         errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ENOENT)


def _fallback(wanted: Path, problem: str) -> Path:
    """This process's private cache directory, made once; warns (once per configured path)."""
    global _FALLBACK
    with _LOCK:
        if _FALLBACK is None:
            try:
                made = Path(tempfile.mkdtemp(prefix=f"fusec-{os.getuid()}-"))
            except OSError as err:
                raise FusecError(f"fusec: the cache directory {wanted} cannot be used ({problem}) "
                                 f"and no private temporary directory could be made ({describe(err)}); "
                                 "set FUSEC_CACHE_DIR to a directory of your own") from None
            doubt = untrusted_path(made)
            if doubt is not None:
                shutil.rmtree(made, ignore_errors=True)
                raise FusecError(f"fusec: the cache directory {wanted} cannot be used ({problem}), "
                                 f"nor a temporary one ({doubt}); set FUSEC_CACHE_DIR to a "
                                 "directory of your own")
            atexit.register(shutil.rmtree, made, ignore_errors=True)
            _FALLBACK = made
    STATS["fallbacks"] += 1
    message = (f"fusec: not using the cache directory {wanted}: {problem}. Set FUSEC_CACHE_DIR to "
               f"a directory of your own; this process builds its kernels in {_FALLBACK}, "
               "which is deleted when it exits.")
    log(message)
    warnings.warn(message, CacheWarning, stacklevel=4)
    return _FALLBACK


def _give_up(base: Path, problem: str) -> Path:
    """Stop using `base` for this process (it failed mid-use: a full disk, say)."""
    with _LOCK:
        if base == _FALLBACK:
            raise FusecError(f"fusec: cannot write the kernel cache: {problem} (in this process's "
                             f"private cache {base}, used because FUSEC_CACHE_DIR's could not be)")
        wanted = configured()
        if _ROOTS.get(wanted) == base:
            _ROOTS[wanted] = _fallback(wanted, problem)
        return root()


def _relocated(path: Path, err: OSError) -> Path:
    """`path` in the private fallback, after `err` stopped the cache it was in."""
    base = root()
    if path.parent.parent != base:
        raise err  # not a cache file (a test's own folder): the caller's error
    _give_up(base, describe(err))
    return cache_dir(path.parent.name) / path.name


# ---- reading: only files this user wrote --------------------------------------------------------

def read_bytes(path: Path, private: bool = False, touch: bool = False) -> bytes:
    """The bytes of `path`, a regular file of this user's that nobody else can write (with
    `private`, nor read). Raises Untrusted (a PermissionError) for anything else, and the usual
    OSError when it is missing. `touch`: mark it used now, for eviction."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Untrusted(errno.EPERM, "a symbolic link", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        problem = file_problem(st, private)
        if problem:
            raise Untrusted(errno.EPERM, problem, str(path))
        chunks = []
        while True:
            chunk = os.read(fd, max(st.st_size, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
        if touch:
            os.utime(fd)
        return b"".join(chunks)
    finally:
        os.close(fd)


def file_problem(st: os.stat_result, private: bool = False) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.getuid():
        return f"owned by another user (uid {st.st_uid})"
    if st.st_mode & (0o077 if private else 0o022):
        return f"{'readable or writable' if private else 'writable'} by other users " \
               f"(mode {oct(stat.S_IMODE(st.st_mode))})"
    return None


def read_verified(artifact: Path, touch: bool = True) -> bytes | None:
    """The bytes of `artifact` if they match its manifest and the manifest is signed with this
    user's key; None otherwise (missing: a miss; anything else also counts as `corrupt` or
    `untrusted`, and is logged)."""
    manifest = artifact.with_suffix(".json")
    try:
        data = read_bytes(artifact, touch=touch)
        text = read_bytes(manifest)
    except Untrusted as err:
        STATS["untrusted"] += 1
        log(f"refused {err.filename}: {err.strerror}; building it again")
        return None
    except OSError:
        return None
    try:
        record = json.loads(text)
        expected, mac = (record.get("sha256"), record.get("hmac")) if isinstance(record, dict) \
            else (None, None)
    except (ValueError, UnicodeDecodeError):
        expected, mac = None, None
    digest = hashlib.sha256(data).hexdigest()
    if expected != digest:
        STATS["corrupt"] += 1
        log(f"corrupt cache entry {artifact.name}: rebuilding")
        return None
    try:
        good = isinstance(mac, str) and hmac.compare_digest(mac, _sign(artifact, digest))
    except (OSError, FusecError):
        good = False  # no key to check it with: a miss
    if not good:
        STATS["untrusted"] += 1
        log(f"refused {artifact.name}: its manifest is not signed with this user's key; "
            "building it again")
        return None
    return data


def verified(artifact: Path) -> bool:
    """True if `artifact` is this user's, intact, and signed (see `read_verified`)."""
    return read_verified(artifact) is not None


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


# ---- the key ------------------------------------------------------------------------------------

def _sign(artifact: Path, digest: str) -> str:
    """The HMAC of an artifact's name and hash, with the key of the cache it is in."""
    base = artifact.parent.parent  # <root>/<kind>/<name>
    if base != root() and not os.path.lexists(base / KEY):
        base = root()  # (a file outside any cache: this process's key)
    return hmac.new(key(base), f"fusec 1\0{artifact.name}\0{digest}".encode(),
                    hashlib.sha256).hexdigest()


def key(base: Path | None = None) -> bytes:
    """This user's secret key, kept in the cache's root (mode 0600), made on first use. A key
    file that is not this user's alone is replaced (and everything it signed is built again).
    `base`: another cache's root, whose key is read but never made or replaced."""
    ours = root()
    base = ours if base is None else base
    path = base / KEY
    try:
        st = os.stat(path)
        known = _KEYS.get(base)
        if known is not None and known[0] == (st.st_ino, st.st_mtime_ns):
            return known[1]  # (the same file as last time: not replaced, nor the cache emptied)
    except OSError:
        pass
    with _LOCK:
        for _ in range(5):
            try:
                found = read_bytes(path, private=True)
                if len(found) == 32:
                    st = os.stat(path)
                    _KEYS[base] = ((st.st_ino, st.st_mtime_ns), found)
                    return found
                problem = f"{len(found)} bytes, not 32"
            except FileNotFoundError:
                problem = None
            except Untrusted as err:
                problem = err.strerror
            if base != ours:
                raise FusecError(f"fusec: no key of this user's in {base} ({problem or 'none'})")
            if problem is not None:
                log(f"replacing the key {path}: {problem}")
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            fd, tmp = tempfile.mkstemp(dir=base, prefix=".key.", suffix=".tmp")  # O_EXCL, 0600
            try:
                os.write(fd, secrets.token_bytes(32))
                os.close(fd)
                fd = -1
                os.link(tmp, path)  # atomic, and only if no other process made one first
            except FileExistsError:
                pass  # another process's key: read it
            finally:
                if fd >= 0:
                    os.close(fd)
                os.unlink(tmp)
    raise FusecError(f"fusec: cannot make a key in {base}")


# ---- writing ------------------------------------------------------------------------------------

def _write(path: Path, data: bytes | str) -> None:
    """Write `data` to a unique temporary file next to `path` (mode 0600; mkstemp's name is random
    and made with O_EXCL, so threads and processes never share one), then rename it into place.
    The temporary file is removed whatever happens."""
    view = memoryview(data.encode() if isinstance(data, str) else data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        tmp = None
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            _unlink(tmp)
    _wrote(len(data))


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` atomically. Returns where it went: `path`, or the same name in this
    process's private cache when the cache could not be written (a full disk, read-only)."""
    try:
        _write(path, data)
        return path
    except OSError as err:
        if not _cache_fault(err):
            raise
        path = _relocated(path, err)
    _write(path, data)
    return path


def write_manifest(artifact: Path, data: bytes | None = None) -> None:
    """Write `artifact`'s signed manifest (of `data`, its bytes, if the caller has them)."""
    digest = hashlib.sha256(artifact.read_bytes() if data is None else data).hexdigest()
    _write(artifact.with_suffix(".json"),
           json.dumps({"sha256": digest, "hmac": _sign(artifact, digest)}))


def store(path: Path, data: bytes) -> Path:
    """Write `data` and its signed manifest (for `read_verified`). Returns where they went."""
    for attempt in range(2):
        try:
            _write(path, data)
            write_manifest(path, data)
            return path
        except OSError as err:
            if attempt or not _cache_fault(err):
                raise
            path = _relocated(path, err)
    return path


def build_once(artifact: Path, source: str, source_suffix: str,
               make: Callable[[Path], None], counted_as: str = "") -> Path:
    """The one routine the C++ and LLVM backends build through. `artifact` (`<name>-<hash>.so`)
    is returned as it is when the cache holds it intact and signed (a hit). Otherwise (a miss)
    the source is written next to it (`source_suffix`: ".cpp", ".ll"), `make(tmp)` writes the
    binary to a unique temporary file, which is renamed into place, and the manifest is written
    last (a compile). `make` raises CompileError when the compiler refuses; nothing is renamed
    then, and no temporary file is left. Returns the binary's path: in this process's private
    cache if the cache could not be written. Threads of one process build an artifact once, and
    so do processes (`_other_processes_wait`: the ranks of a distributed job compile the same
    kernels at the same moment). `counted_as` prefixes its `STATS` names ("prelude ": not a
    kernel's hit, miss or compile)."""
    with _LOCK:
        lock = _BUILDING.setdefault(artifact, threading.Lock())
    with lock:
        seen = _identity(artifact)
        if verified(artifact):
            STATS[counted_as + "hits"] += 1
            log(f"hit {artifact.name}")
            return artifact
        try:
            with _other_processes_wait(artifact):
                # another process built it while this one waited (a new file: looked at again)
                if _identity(artifact) not in (seen, None) and verified(artifact):
                    STATS[counted_as + "hits"] += 1
                    log(f"hit {artifact.name} (built by another process)")
                    return artifact
                STATS[counted_as + "misses"] += 1
                return _build(artifact, source, source_suffix, make, counted_as)
        except OSError as err:
            if not _cache_fault(err):
                raise
            fault = err
        except CompileError as err:  # the compiler could not write its output: a full disk
            if os.strerror(errno.ENOSPC) not in str(err):
                raise
            fault = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(artifact.parent))
    moved = _relocated(artifact, fault)
    try:
        return _build(moved, source, source_suffix, make, counted_as)
    except OSError as err:
        raise CompileError(f"fusec: cannot build {artifact.name}: {describe(err)}") from None


def _identity(path: Path) -> tuple | None:
    """(device, inode) of a file, None if there is none: a build renames a new file into place,
    so a changed identity means another process built it (reading a file touches its time)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def _other_processes_wait(artifact: Path):
    """Hold an exclusive `flock` on `<artifact>.lock` while building it: another process that
    wants the same artifact waits, then finds it built. The lock file is removed afterwards; a
    process that opened it just before loses nothing but the wait (it may build the artifact
    again, renamed into place atomically as always). Where no lock can be taken (no fcntl, a
    cache that cannot be written) the build goes on without one."""
    try:
        import fcntl
        fd = os.open(artifact.with_name(artifact.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(artifact.with_name(artifact.name + ".lock"))
        os.close(fd)  # (closing releases the lock)


def _build(artifact: Path, source: str, source_suffix: str, make: Callable[[Path], None],
           counted_as: str = "") -> Path:
    _write(artifact.with_suffix(source_suffix), source)
    fd, tmp = tempfile.mkstemp(dir=artifact.parent, prefix=artifact.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        make(Path(tmp))
        os.chmod(tmp, 0o700)  # this user's alone, whatever umask the compiler wrote it under
        data = read_bytes(Path(tmp))
        os.replace(tmp, artifact)
    finally:
        _unlink(tmp)
    _wrote(len(data))
    write_manifest(artifact, data)
    STATS[counted_as + "compiles"] += 1
    log(f"compiled {artifact.name}")
    return artifact


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- the size cap -------------------------------------------------------------------------------

def max_bytes() -> int:
    return env.integer("FUSEC_CACHE_MAX_MB", MAX_MB, minimum=1) << 20


def _wrote(n: int) -> None:
    """Count bytes written; at a process's first write, and past an eighth of the cap since the
    last look, check the size. (A process that only loads never scans the cache: warm starts
    stay quick; one that compiles pays a few milliseconds for it.)"""
    global _written
    first = _written is None
    _written = (_written or 0) + n
    if first or _written >= max_bytes() // 8:
        _written = 0
        _evict_if_over(root())


def _evict_if_over(base: Path) -> None:
    try:
        evict(base)
    except (OSError, FusecError) as err:  # never a reason to fail a build
        log(f"could not check the cache's size ({err})")


def evict(base: Path | None = None, limit: int | None = None) -> int:
    """If the cache holds more than `limit` bytes (FUSEC_CACHE_MAX_MB), delete the least
    recently used entries (all files of one name: source, binary, manifest) until it holds
    at most 90% of it. An entry used in the last RECENT_S seconds stays (a build in progress may
    not have loaded it yet), and so does the key. Returns the number of entries deleted."""
    base = root() if base is None else base
    limit = max_bytes() if limit is None else limit
    if not _EVICTING.acquire(blocking=False):
        return 0  # another thread is at it
    try:
        now = time.time()
        entries: dict[tuple[str, str], list] = {}  # (folder, stem) -> [bytes, last use, paths]
        total = 0
        for folder, f in _cached_files(base):
            try:
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            total += st.st_size
            if f.name.endswith(".tmp"):  # a write in progress, or one that died
                if now - st.st_mtime > STALE_TMP_S:
                    _unlink(f.path)
                    total -= st.st_size
                continue
            entry = entries.setdefault((folder, f.name.split(".", 1)[0]), [0, 0.0, []])
            entry[0] += st.st_size
            entry[1] = max(entry[1], st.st_mtime)
            entry[2].append(f.path)
        if total <= limit:
            return 0
        evicted, target = 0, limit * 9 // 10
        for (folder, _), (size, used, paths) in sorted(entries.items(), key=lambda e: e[1][1]):
            if total <= target or now - used < RECENT_S:
                break
            for path in paths:
                _unlink(path)
            if os.path.dirname(folder) != str(base):
                _rmdir_if_empty(folder)  # a nested entry's own folder
            total -= size
            evicted += 1
        STATS["evicted"] += evicted
        log(f"evicted {evicted} least recently used entries: the cache holds {total >> 10} KiB "
            f"of FUSEC_CACHE_MAX_MB={limit >> 20}")
        return evicted
    finally:
        _EVICTING.release()


def _cached_files(base: Path):
    """(folder, file) for each file in the cache's folders (`<base>/<kind>/`) and in the folders
    one level below them (`<base>/cpp-prelude/<hash>/`: an artifact that must keep its own file
    name, like a precompiled header, gets a folder of its own)."""
    for kind in os.scandir(base):
        if not kind.is_dir(follow_symlinks=False):
            continue
        for f in os.scandir(kind.path):
            if f.is_dir(follow_symlinks=False):
                yield from ((f.path, g) for g in os.scandir(f.path)
                            if not g.is_dir(follow_symlinks=False))
            else:
                yield kind.path, f


def _rmdir_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:  # not empty (a build came back to it), or already gone
        pass


def log(message: str) -> None:
    """Publish a cache event (`FUSEC_LOG=cache` prints it: fusec/inspect/log.py)."""
    events.publish("cache", message)
