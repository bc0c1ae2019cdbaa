"""The hicache_storage family: the third tier of the hierarchical KV cache.

A backend stores KV pages (one tensor ``[num_layers, 2, page_size, kv_heads, head_dim]`` per
page) under string keys. Keys are a hash chain over token ids (:func:`page_hashes`): SHA-256 over
the previous page's digest and this page's ids, seeded by the cache namespace (``cache_salt``),
so equal prefixes map to equal keys across processes and restarts and a key names a whole prefix,
not just one page.

Built-ins: ``file`` (a directory of page files) and ``sqlite`` (one embedded database file).
Both are selected with ``--hicache-storage-backend`` and configured with
``--hicache-storage-backend-extra-config`` (JSON).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch

from loom import env
from loom.mem_cache.base import HiCacheStorage

__all__ = ["HiCacheStorage"]

logger = logging.getLogger(__name__)

# uint8: fp8 KV caches travel as raw bytes (KVPool.copy_buffers)
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)}


def page_hashes(
    tokens: list[int], page_size: int, extra_key: str | None = None, prev: str | None = None
) -> list[str]:
    """Hex digests of each full page of ``tokens``: ``sha256(prev_digest || ids as int64 LE)``.
    The chain starts from ``prev`` (the digest of the page before ``tokens``) or, at the start
    of a sequence, from the digest of ``extra_key`` (empty when None)."""
    digest = (
        bytes.fromhex(prev)
        if prev is not None
        else hashlib.sha256((extra_key or "").encode()).digest()
    )
    out = []
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256(digest)
        h.update(struct.pack(f"<{page_size}q", *tokens[i : i + page_size]))
        digest = h.digest()
        out.append(digest.hex())
    return out


def encode_page(page: torch.Tensor) -> bytes:
    """A self-describing page: a JSON header (dtype, shape, SHA-256 of the data) and the data."""
    data = page.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "dtype": str(page.dtype),
            "shape": list(page.shape),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    ).encode()
    return struct.pack("<I", len(header)) + header + data


def decode_page(blob: bytes) -> torch.Tensor | None:
    """The page in ``blob``, or None when it is truncated, malformed or fails its checksum."""
    try:
        (n,) = struct.unpack_from("<I", blob)
        header = json.loads(blob[4 : 4 + n])
        data = blob[4 + n :]
        if hashlib.sha256(data).hexdigest() != header["sha256"]:
            return None
        dtype = _DTYPES[header["dtype"]]
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        return t.reshape(header["shape"])
    except Exception:  # noqa: BLE001 - any malformed page is a miss
        return None


def default_storage_dir() -> Path:
    return env.storage_root() / "hicache"


class FileStorage(HiCacheStorage):
    """One file per page under ``{path}/{namespace}/{key[:2]}/{key}.kv``.

    Extra config: ``path`` (default ``~/.cache/loom/hicache`` or ``$LOOM_CACHE_DIR/hicache``),
    ``max_bytes`` (optional size cap; the least recently used files are deleted past it).
    Writes go to a temporary file in the same directory and are renamed into place (atomic on
    POSIX); every page carries a SHA-256 of its data, checked on read (a corrupt file is deleted
    and reported missing). A directory that vanishes is recreated on the next write; one that
    cannot be written is logged once and the store degrades to misses.
    """

    def __init__(
        self, namespace: str, path: str | None = None, max_bytes: int | None = None, **extra
    ) -> None:
        super().__init__(namespace, path=path, max_bytes=max_bytes, **extra)
        self.root = Path(path) if path else default_storage_dir()
        self.dir = self.root / namespace
        self.max_bytes = max_bytes
        self._warned: set[str] = set()
        self._bytes: int | None = None

    def _warn(self, what: str, err: Exception) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("hicache file storage at %s: %s failed (%s)", self.dir, what, err)

    def _file(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.kv"

    def attach(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._warn("create", e)

    def exists(self, keys):
        return [self._file(k).is_file() for k in keys]

    def read(self, keys):
        out = []
        for k in keys:
            f = self._file(k)
            try:
                blob = f.read_bytes()
            except OSError:
                out.append(None)
                continue
            page = decode_page(blob)
            if page is None:
                logger.warning("hicache file storage: %s is corrupt; deleting it", f)
                try:
                    f.unlink()
                except OSError:
                    pass
            else:
                try:
                    os.utime(f)  # recency for the size cap's LRU
                except OSError:
                    pass
            out.append(page)
        return out

    def write(self, keys, pages):
        out = []
        for k, page in zip(keys, pages, strict=True):
            f = self._file(k)
            try:
                f.parent.mkdir(parents=True, exist_ok=True)
                blob = encode_page(page)
                fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=".tmp-")
                try:
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(blob)
                    os.replace(tmp, f)
                except BaseException:
                    with_suppress_unlink(tmp)
                    raise
                if self._bytes is not None:
                    self._bytes += len(blob)
                out.append(True)
            except OSError as e:
                self._warn("write", e)
                out.append(False)
        if self.max_bytes is not None:
            self._enforce_cap()
        return out

    def _enforce_cap(self) -> None:
        try:
            files = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.dir.glob("*/*.kv")]
        except OSError as e:
            self._warn("size scan", e)
            return
        total = sum(s for _, s, _ in files)
        self._bytes = total
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            try:
                p.unlink()
                total -= size
            except OSError:
                pass
        self._bytes = total


def with_suppress_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class SQLiteStorage(HiCacheStorage):
    """Pages in one SQLite database (``{"path": FILE}``; default ``hicache.sqlite`` in the
    default storage folder), table ``pages(namespace, key, data, last_access)``. Each write is a
    transaction (atomic), pages carry the same checksummed encoding as ``file``, and several
    processes can share the file (SQLite's locking, WAL mode)."""

    def __init__(self, namespace: str, path: str | None = None, **extra) -> None:
        super().__init__(namespace, path=path, **extra)
        self.path = Path(path) if path else default_storage_dir() / "hicache.sqlite"
        self._local = threading.local()
        self._warned = False

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=10)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS pages (namespace TEXT, key TEXT, data BLOB, "
                "last_access REAL, PRIMARY KEY (namespace, key))"
            )
            self._local.db = db
        return db

    def _fail(self, err: Exception) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("hicache sqlite storage at %s failed (%s)", self.path, err)

    def attach(self) -> None:
        try:
            self._db()
        except (sqlite3.Error, OSError) as e:
            self._fail(e)

    def detach(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    def exists(self, keys):
        try:
            rows = self._db().execute(
                f"SELECT key FROM pages WHERE namespace = ? AND key IN ({','.join('?' * len(keys))})",
                [self.namespace, *keys],
            )
            have = {r[0] for r in rows}
        except (sqlite3.Error, OSError) as e:
            self._fail(e)
            return [False] * len(keys)
        return [k in have for k in keys]

    def read(self, keys):
        out = []
        for k in keys:
            try:
                row = (
                    self._db()
                    .execute(
                        "SELECT data FROM pages WHERE namespace = ? AND key = ?",
                        (self.namespace, k),
                    )
                    .fetchone()
                )
            except (sqlite3.Error, OSError) as e:
                self._fail(e)
                row = None
            page = decode_page(row[0]) if row else None
            if row and page is None:
                logger.warning("hicache sqlite storage: page %s is corrupt; deleting it", k)
                try:
                    with self._db() as db:
                        db.execute(
                            "DELETE FROM pages WHERE namespace = ? AND key = ?", (self.namespace, k)
                        )
                except sqlite3.Error:
                    pass
            out.append(page)
        return out

    def write(self, keys, pages):
        try:
            rows = [
                (self.namespace, k, encode_page(p), time.time())
                for k, p in zip(keys, pages, strict=True)
            ]
            with self._db() as db:
                db.executemany("INSERT OR REPLACE INTO pages VALUES (?, ?, ?, ?)", rows)
        except (sqlite3.Error, OSError) as e:
            self._fail(e)
            return [False] * len(keys)
        return [True] * len(keys)
