"""On-disk cache of generated sources and built kernels, keyed by content hash.

Layout (one directory per user, mode 0700):

    ~/.cache/fusec/                   or $FUSEC_CACHE_DIR
      cpp/<name>-<hash>.cpp           the rendered source
      cpp/<name>-<hash>.so            the shared library built from it
      cpp/<name>-<hash>.json          {"sha256": <hash of the .so>} written last
      triton/<name>-<hash>.py         a generated Triton module
      triton/<name>-<hash>.pyc        its compiled Python code, stamped with the module's hash
      programs/<fingerprint>.pkl      a whole compiled program (fusec/runtime/saved.py)

The key hashes everything that decides the artifact: the source text, the compiler and its flags.
Files are written to a temporary name and renamed into place, so a reader never sees half a file,
and a built library is loaded only if its sha256 matches the manifest; anything else (a truncated
or edited file) counts as a miss and is rebuilt. `STATS` counts hits, misses and rebuilds so tests
and `FUSEC_LOG=cache` can show that a second process compiles nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

from fusec import events
from fusec.errors import FusecError

STATS: Counter = Counter()


def root() -> Path:
    """$FUSEC_CACHE_DIR, else $XDG_CACHE_HOME/fusec, else ~/.cache/fusec (not created here)."""
    base = os.environ.get("FUSEC_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "fusec"


def cache_dir(kind: str) -> Path:
    root_dir = root()
    path = root_dir / kind
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (root_dir, path):
        st = p.stat()
        if st.st_uid != os.getuid():
            # someone else could replace the libraries we load from here
            raise FusecError(f"fusec: the cache directory {p} belongs to another user; point "
                             "FUSEC_CACHE_DIR at a directory of your own")
        if st.st_mode & 0o077:
            os.chmod(p, 0o700)
    return path


def content_hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def atomic_write(path: Path, data: bytes | str) -> None:
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, mode) as f:
        f.write(data)
    os.replace(tmp, path)


def write_manifest(artifact: Path) -> None:
    atomic_write(artifact.with_suffix(".json"), json.dumps({"sha256": file_sha256(artifact)}))


def verified(artifact: Path) -> bool:
    """True if `artifact` exists and matches the hash recorded when it was built."""
    manifest = artifact.with_suffix(".json")
    if not artifact.exists() or not manifest.exists():
        return False
    try:
        data = json.loads(manifest.read_text())
        expected = data.get("sha256") if isinstance(data, dict) else None
    except (ValueError, OSError, UnicodeDecodeError):
        expected = None
    if expected != file_sha256(artifact):
        STATS["corrupt"] += 1
        log(f"corrupt cache entry {artifact.name}: rebuilding")
        return False
    return True


def build_once(artifact: Path, source: str, source_suffix: str,
               make: Callable[[Path], None]) -> Path:
    """The one routine the C++ and LLVM backends build through. `artifact` (`<name>-<hash>.so`)
    is returned as it is when the cache holds it intact (a hit). Otherwise (a miss) the source
    is written next to it (`source_suffix`: ".cpp", ".ll"), `make(tmp)` writes the binary to a
    temporary file, which is renamed into place, and the manifest is written last (a compile).
    `make` raises CompileError when the compiler refuses; nothing is renamed then."""
    if verified(artifact):
        STATS["hits"] += 1
        log(f"hit {artifact.name}")
        return artifact
    STATS["misses"] += 1
    atomic_write(artifact.with_suffix(source_suffix), source)
    tmp = artifact.with_name(f"{artifact.stem}.{os.getpid()}{artifact.suffix}.tmp")
    make(tmp)
    os.replace(tmp, artifact)
    write_manifest(artifact)
    STATS["compiles"] += 1
    log(f"compiled {artifact.name}")
    return artifact


def log(message: str) -> None:
    """Publish a cache event (`FUSEC_LOG=cache` prints it: fusec/inspect/log.py)."""
    events.publish("cache", message)
