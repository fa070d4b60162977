"""The disk tier under the host tier: one checksummed slab file per confirmed anchor, so a
restarted worker comes back warm.

Layout: `DIR/<fingerprint[:16]>-tp<rank>of<size>/<key hex>-<depth>.slab`, each a
safetensors file (tensors `kv`, `state`, `tokens`, whichever the slab has) whose metadata is
the header: format version, the model's fingerprint (`model_fingerprint`: config, weight
files, dtype and cache layout), TP rank and size, key, depth, start, parent, kind, dtype and
shapes, and a BLAKE2b checksum of the payload. Files land under a temporary name, are
fsynced, then renamed (and the directory fsynced), so a crash mid-write leaves only a
temporary file, which a later start deletes (once it is an hour old: a recent one may be
another worker's write in progress): no file is ever read as whole that was not.

Nothing wrong is restored: `index` (at start) reads headers only and quarantines a file
whose header is unreadable, truncated, of another format version, model, TP layout, or
whose name disagrees with its key and depth; `load` reads the whole file and checks the
header again, the tensors against the header's dtype and shapes, and the checksum. A file
that fails is moved to `DIR/quarantine/` and counted (`skips`), never returned; the caller
then simply prefills more.

Shared: workers of one model may share the directory (shared storage). A worker indexes what
is there at start; a miss in its index then costs one stat of the exact file name for that
key and depth (`has`), and a file another worker wrote since is indexed on the spot (header
checked as at start, counted as an import) and loaded with every check as any file is.

Bounded: LRU within `budget_bytes` (file sizes); a write or load touches the anchor, then its
ancestors, so leaves go before the links they hang from; pinned anchors and their ancestors
are never evicted. A disk that is full, read-only or otherwise failing turns the tier off with one log
line; serving goes on from memory.

Moved: `import_file` takes in a file another worker of the model wrote, sent over the
contract (`POST /anchor/import`, from `POST /anchor/export` of the other worker), so a
replica without shared storage joins warm. The received bytes get every check `load` makes
before they are renamed into place; a file that fails is refused, never kept.

Thread model: `put` only enqueues (the worker's loop never writes a file); one writer thread
writes, fsyncs and evicts. `load`, `index` and the listing run on the caller's thread; the
index is shared with the writer under one lock.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger("anchorcache.worker")

FORMAT = "anchorcache-slab"
FORMAT_VERSION = 1
SUFFIX = ".slab"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
STALE_TMP_S = 3600.0  # a temporary file older than this at start is a crashed write's
DEFAULT_FREE_SHARE = 0.1  # the default budget: this share of the disk's free bytes at start


def model_fingerprint(model_path: str | os.PathLike[str], *parts: object) -> str:
    """The identity of a model's config and weights, plus whatever shapes its slabs (`parts`:
    dtype, cache layout): BLAKE2b over `config.json` and each weight file's name and size.
    Reading every weight byte would cost minutes on a large model; a changed checkpoint
    changes a size or name in practice, and the config and layout are hashed in full."""
    h = hashlib.blake2b(digest_size=16, person=b"anchorcache.fp")
    root = Path(model_path)
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(root).encode())
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
                h.update(f"{f.name}:{f.stat().st_size};".encode())
    for part in parts:
        h.update(f"|{part}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class SlabRecord:
    """What a slab file holds: the store's `Slab` without its slot."""

    key: bytes
    depth: int
    start: int
    parent: bytes | None
    kind: str
    kv: torch.Tensor | None
    state: torch.Tensor | None
    nbytes: int
    tokens: torch.Tensor | None = None  # int64 ids `[start, depth)`


@dataclass(frozen=True)
class DiskEntry:
    key: bytes
    depth: int
    start: int
    parent: bytes | None
    kind: str
    nbytes: int  # the slab's bytes (what the host tier would hold)
    file_bytes: int
    path: Path


@dataclass(frozen=True)
class DiskStats:
    enabled: bool
    bytes: int
    files: int
    budget_bytes: int
    writes: int
    loads: int
    skips: int  # files quarantined: truncated, bad checksum, other model/version/TP layout
    evictions: int
    write_errors: int
    imports: int  # files another worker wrote into the shared directory, found on a miss


class CorruptSlab(Exception):
    """A slab file that must not be restored (the message says why)."""

    status = 400  # sent to `POST /anchor/import`: a file that is not this worker's to take


class DiskTierOff(Exception):
    """No disk tier to import into or export from (none configured, or turned off)."""

    status = 409


class DiskTier:
    """Slab files of one model and TP rank in one directory; see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: str, *,
                 budget_bytes: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        if budget_bytes < 1:
            raise ValueError("budget_bytes must be positive (no disk tier: do not build one)")
        self.root = Path(directory)
        self.fingerprint = fingerprint
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.dir = self.root / f"{fingerprint[:16]}-tp{tp_rank}of{tp_size}"
        self.budget_bytes = budget_bytes
        self.enabled = True
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # oldest use first
        self._pinned: set[bytes] = set()
        self._counts = {"writes": 0, "loads": 0, "skips": 0, "evictions": 0, "write_errors": 0,
                        "imports": 0}
        self._queue: queue.Queue[SlabRecord | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._disable(f"cannot create {self.dir}: {e}")

    # ---- start ------------------------------------------------------------------------
    def index(self) -> int:
        """Read every slab file's header (oldest first, by mtime) into the index; delete
        leftover temporary files, quarantine bad ones. Returns the number of files indexed."""
        if not self.enabled:
            return 0
        files = []
        stale = time.time() - STALE_TMP_S
        for f in self.dir.iterdir():
            if f.name.endswith(TMP_SUFFIX):
                try:  # a write a crash cut short: never whole. A recent one may be another
                    if f.stat().st_mtime < stale:  # worker's, sharing the directory, mid-write
                        f.unlink(missing_ok=True)
                except FileNotFoundError:
                    pass
            elif f.suffix == SUFFIX:
                try:
                    files.append((f.stat().st_mtime_ns, f))
                except FileNotFoundError:
                    continue
        for _, f in sorted(files):
            try:
                entry = self._read_header(f)
            except CorruptSlab as e:
                self._quarantine(f, str(e))
                continue
            with self._lock:
                self._entries[entry.key] = entry
        with self._lock:
            self._evict_over_budget()
            return len(self._entries)

    # ---- the worker's loop --------------------------------------------------------------
    def put(self, slab: SlabRecord) -> None:
        """Queue `slab` for writing (a confirmed anchor); the writer thread does the rest."""
        if not self.enabled:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="anchorcache-disk",
                                            daemon=True)
            self._writer.start()
        self._queue.put(slab)

    def depths_below(self, limit: int) -> list[int]:
        """The distinct depths of the anchors held, those below `limit`."""
        with self._lock:
            return sorted({e.depth for e in self._entries.values() if e.depth < limit})

    def has(self, key: bytes, depth: int, discover: bool = True) -> bool:
        """Whether the tier holds `key` at `depth`: indexed, or (`discover`, a directory
        other workers of this model write too) a file of exactly that name found now, whose
        header checks out (`_discover`)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                return entry.depth == depth
        return discover and self._discover(key, depth)

    def entry(self, key: bytes) -> DiskEntry | None:
        """The index's entry of `key` (no stat, no LRU touch), or None."""
        with self._lock:
            return self._entries.get(key)

    def _discover(self, key: bytes, depth: int) -> bool:
        """Index the file `<key hex>-<depth>.slab` if another worker sharing the directory
        wrote it since `index`: one stat when there is none. Its header is checked as at
        start (format, fingerprint, TP layout, name against key and depth); the payload when
        it is loaded."""
        if not self.enabled:
            return False
        path = self.dir / f"{key.hex()}-{depth}{SUFFIX}"
        try:
            if not path.is_file():
                return False
            entry = self._read_header(path)
        except FileNotFoundError:
            return False
        except CorruptSlab as e:
            self._quarantine(path, str(e))
            return False
        if entry.key != key or entry.depth != depth:  # `_check_header` checked the name
            return False
        with self._lock:
            if key not in self._entries:
                self._entries[key] = entry
                self._counts["imports"] += 1
            self._touch(key)
            self._evict_over_budget()
            return key in self._entries and self._entries[key].depth == depth

    def load(self, key: bytes, depth: int) -> SlabRecord | None:
        """The slab of `key` at `depth` if its file is whole and checks out (LRU touch);
        None when there is none. A file that fails a check is quarantined and counted."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.depth != depth:
                return None
            self._touch(key)
        try:
            record = self._read(entry.path)
            if record.key != key or record.depth != depth:
                raise CorruptSlab("key or depth differs from the index")
        except FileNotFoundError:  # removed under us (another worker's eviction)
            with self._lock:
                self._entries.pop(key, None)
            return None
        except CorruptSlab as e:
            with self._lock:
                self._entries.pop(key, None)
            self._quarantine(entry.path, str(e))
            return None
        with self._lock:
            self._counts["loads"] += 1
        return record

    def reject(self, key: bytes, why: str) -> None:
        """Quarantine the anchor's file, which its caller found unfit (counted as a skip)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None:
            self._quarantine(entry.path, why)

    def pin(self, key: bytes) -> None:
        with self._lock:
            self._pinned.add(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self._pinned.discard(key)

    def remove(self, key: bytes) -> bool:
        """Delete the anchor's file (an admin eviction: it must not come back)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            self._pinned.discard(key)
        if entry is not None:
            entry.path.unlink(missing_ok=True)
        return entry is not None

    def clear(self) -> int:
        """Delete every slab file of this model and rank (a flush); queued writes go first."""
        self.drain()
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._pinned.clear()
        for entry in entries:
            entry.path.unlink(missing_ok=True)
        return len(entries)

    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries.values())

    def pinned(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pinned

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.enabled, sum(e.file_bytes for e in self._entries.values()),
                             len(self._entries), self.budget_bytes, **self._counts)

    def drain(self) -> None:
        """Wait until every queued write is on disk (tests, flush, shutdown)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=60)
            self._writer = None

    # ---- writer thread ------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            slab = self._queue.get()
            try:
                if slab is None:
                    return
                if self.enabled and not self.has(slab.key, slab.depth):
                    self._write(slab)
            except Exception:  # a bug, not a disk error: keep the writer alive
                log.exception("disk tier: writing the anchor at depth %d failed",
                              slab.depth if slab else -1)
            finally:
                self._queue.task_done()

    def _write(self, slab: SlabRecord) -> None:
        tensors = _tensors(slab)
        meta = {
            "format": FORMAT, "version": str(FORMAT_VERSION), "fingerprint": self.fingerprint,
            "tp_rank": str(self.tp_rank), "tp_size": str(self.tp_size),
            "key": slab.key.hex(), "depth": str(slab.depth), "start": str(slab.start),
            "parent": slab.parent.hex() if slab.parent else "", "kind": slab.kind,
            "nbytes": str(slab.nbytes),
            "layout": json.dumps({n: [str(t.dtype), list(t.shape)] for n, t in tensors.items()},
                                 sort_keys=True),
            "checksum": _checksum(tensors),
        }
        path = self.dir / f"{slab.key.hex()}-{slab.depth}{SUFFIX}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.dir)
            size = path.stat().st_size
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._counts["write_errors"] += 1
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                self._disable(f"{self.dir}: {e}")
            else:
                log.warning("disk tier: could not write %s: %s", path.name, e)
            return
        entry = DiskEntry(slab.key, slab.depth, slab.start, slab.parent, slab.kind,
                          slab.nbytes, size, path)
        with self._lock:
            self._entries[slab.key] = entry
            self._touch(slab.key)
            self._counts["writes"] += 1
            self._evict_over_budget()

    def _touch(self, key: bytes) -> None:
        """Make `key`, then each ancestor, the newest (the slot table's rule): LRU evicts a
        chain's leaves before its links. Holds the lock."""
        seen: set[bytes] = set()
        cur: bytes | None = key
        while cur is not None and cur in self._entries and cur not in seen:
            seen.add(cur)
            self._entries.move_to_end(cur)
            cur = self._entries[cur].parent

    def _evict_over_budget(self) -> None:
        """Oldest first, never a pinned anchor or an ancestor of one. Holds the lock."""
        total = sum(e.file_bytes for e in self._entries.values())
        if total <= self.budget_bytes:
            return
        protected: set[bytes] = set()
        for key in self._pinned:
            cur: bytes | None = key
            while cur is not None and cur not in protected and cur in self._entries:
                protected.add(cur)
                cur = self._entries[cur].parent
        for key in list(self._entries):
            if total <= self.budget_bytes:
                break
            if key in protected:
                continue
            entry = self._entries.pop(key)
            entry.path.unlink(missing_ok=True)
            total -= entry.file_bytes
            self._counts["evictions"] += 1

    def _disable(self, why: str) -> None:
        if self.enabled:
            self.enabled = False
            log.error("disk tier off (serving goes on from memory): %s", why)

    # ---- files moved between workers -----------------------------------------------------
    def import_file(self, data: bytes) -> tuple[DiskEntry, bool]:
        """Take in the bytes of a slab file another worker of this model wrote: checked as
        `load` checks a file (format, fingerprint, TP layout, tensors against the header,
        checksum, sizes) under a temporary name, then fsynced, renamed into place and indexed
        (counted as an import). (entry, False) when the tier holds the anchor already.
        CorruptSlab when a check fails (the bytes are not kept; counted as a skip);
        DiskTierOff when the tier is off or cannot write."""
        if not self.enabled:
            raise DiskTierOff("the disk tier is off")
        tmp = self.dir / f".import-{uuid.uuid4().hex}{TMP_SUFFIX}"  # `index` deletes leftovers
        try:
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise DiskTierOff(f"cannot write the file: {e}") from None
            try:
                record = self._read(tmp, named=False)
                with self._lock:
                    held = self._entries.get(record.key)
                if held is not None and held.depth != record.depth:  # a key names one prefix
                    raise CorruptSlab(f"this worker holds that key at depth {held.depth}, "
                                      f"not {record.depth}")
            except CorruptSlab as e:
                with self._lock:
                    self._counts["skips"] += 1
                log.warning("disk tier: an imported file was refused: %s", e)
                raise
            if held is not None:
                return held, False
            path = self.dir / f"{record.key.hex()}-{record.depth}{SUFFIX}"
            os.replace(tmp, path)
            _fsync_dir(self.dir)
            entry = DiskEntry(record.key, record.depth, record.start, record.parent,
                              record.kind, record.nbytes, path.stat().st_size, path)
        finally:
            tmp.unlink(missing_ok=True)
        with self._lock:
            self._entries[entry.key] = entry
            self._touch(entry.key)
            self._counts["imports"] += 1
            self._evict_over_budget()
        return entry, True

    def export_file(self, key: bytes) -> bytes:
        """The bytes of the anchor's file, for `import_file` on another worker. DiskTierOff
        when the tier is off; KeyError when it holds no file for `key` (a slab confirmed
        moments ago may still be queued for writing)."""
        if not self.enabled:
            raise DiskTierOff("the disk tier is off")
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(key)
        try:
            return entry.path.read_bytes()
        except FileNotFoundError:  # removed under us (another worker's eviction)
            with self._lock:
                self._entries.pop(key, None)
            raise KeyError(key) from None

    # ---- files ------------------------------------------------------------------------
    def _check_header(self, meta: dict[str, str] | None, path: Path, named: bool = True
                      ) -> DiskEntry:
        if not meta or meta.get("format") != FORMAT:
            raise CorruptSlab("not an anchorcache slab")
        if meta.get("version") != str(FORMAT_VERSION):
            raise CorruptSlab(f"format version {meta.get('version')!r}, not {FORMAT_VERSION}")
        if meta.get("fingerprint") != self.fingerprint:
            raise CorruptSlab("another model's fingerprint")
        if (meta.get("tp_rank"), meta.get("tp_size")) != (str(self.tp_rank), str(self.tp_size)):
            raise CorruptSlab(f"TP layout {meta.get('tp_rank')}/{meta.get('tp_size')}, "
                              f"not {self.tp_rank}/{self.tp_size}")
        try:
            key = bytes.fromhex(meta["key"])
            depth, start, nbytes = int(meta["depth"]), int(meta["start"]), int(meta["nbytes"])
            parent = bytes.fromhex(meta["parent"]) if meta["parent"] else None
            kind = meta["kind"]
            json.loads(meta["layout"])
            meta["checksum"]
        except (KeyError, ValueError) as e:
            raise CorruptSlab(f"malformed header: {e}") from None
        if len(key) != 16 or (parent is not None and len(parent) != 16) \
                or not 0 <= start < depth or nbytes < 0 or (start == 0) != (parent is None):
            raise CorruptSlab("header fields out of range")
        if named and path.name != f"{key.hex()}-{depth}{SUFFIX}":
            raise CorruptSlab("file name disagrees with the header's key and depth")
        return DiskEntry(key, depth, start, parent, kind, nbytes, path.stat().st_size, path)

    def _read_header(self, path: Path) -> DiskEntry:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors: truncated, bad JSON, offsets past the end
            raise CorruptSlab(f"unreadable: {e}") from None
        return self._check_header(meta, path)

    def _read(self, path: Path, named: bool = True) -> SlabRecord:
        """The whole file, every check made (`named`: its name must be its key and depth)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                entry = self._check_header(meta, path, named)
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (FileNotFoundError, CorruptSlab):
            raise
        except Exception as e:
            raise CorruptSlab(f"unreadable: {e}") from None
        layout = json.loads(meta["layout"])
        if {n: [str(t.dtype), list(t.shape)] for n, t in tensors.items()} != layout:
            raise CorruptSlab("tensors disagree with the header's dtype and layout")
        if _checksum(tensors) != meta["checksum"]:
            raise CorruptSlab("checksum mismatch")
        kv, state, tokens = tensors.get("kv"), tensors.get("state"), tensors.get("tokens")
        size = sum(t.numel() * t.element_size() for t in (kv, state) if t is not None)
        if size != entry.nbytes or (kv is not None and kv.shape[2] != entry.depth - entry.start) \
                or (tokens is not None and tokens.numel() != entry.depth - entry.start):
            raise CorruptSlab("payload size disagrees with depth and nbytes")
        return SlabRecord(entry.key, entry.depth, entry.start, entry.parent, entry.kind, kv,
                          state, entry.nbytes, tokens)

    def _quarantine(self, path: Path, why: str) -> None:
        with self._lock:
            self._counts["skips"] += 1
        log.warning("disk tier: %s skipped and quarantined: %s", path.name, why)
        try:
            q = self.root / QUARANTINE
            q.mkdir(exist_ok=True)
            shutil.move(str(path), q / f"{path.parent.name}-{path.name}")
        except OSError:
            path.unlink(missing_ok=True)


def _tensors(slab: SlabRecord) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in (("kv", slab.kv), ("state", slab.state), ("tokens", slab.tokens)):
        if t is not None:
            out[name] = t.detach().to("cpu").contiguous()
    return out


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"anchorcache.sl")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.numel() * t.element_size()};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def default_budget_bytes(directory: str | os.PathLike[str]) -> int:
    """`DEFAULT_FREE_SHARE` of the free bytes of the disk holding `directory` (its nearest
    existing ancestor), at least 1 byte."""
    p = Path(directory).absolute()
    while not p.exists():
        p = p.parent
    return max(1, int(shutil.disk_usage(p).free * DEFAULT_FREE_SHARE))
