"""Block files: the on-disk format of the file-system tier, and the I/O that reads and writes them.

One file per block: ``<root>/<2 hex>/<40 hex>.<16 hex>.kvb``, named by a hash of the key and a version
(newer writes of the same key get larger versions). Each file is a fixed header, the key, then the
payload::

    magic "KVFB" | format version u16 | flags u16 | key length u32 | payload length u64 |
    block version u64 | blake2b-128 digest of (header fields, key, payload)

Writes are atomic: the bytes go to a temporary file (``.<name>.<pid>.<token>.<n>.tmp``, created
exclusively), are checked for short writes, optionally fsynced, and only then renamed onto the final name
with ``os.replace``. So a reader, or a process started after a crash, sees either the whole block or none
of it. Reads verify everything (magic, format, key, lengths, digest); any failure removes the file and
raises, so corrupt data is never served and never probed as a hit again.

Everything here runs on I/O threads; none of it touches the tier's bookkeeping.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from kvfsm.control.types import OffloadKey
from kvfsm.errors import KvfsmError
from kvfsm.tiers.faults import FaultPlan

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "BlockIO",
    "CorruptBlockError",
    "FileInfo",
    "ScanResult",
    "decode",
    "encode",
    "key_name",
]

logger = logging.getLogger(__name__)

MAGIC = b"KVFB"
FORMAT_VERSION = 1
#: magic, format version, flags, key length, payload length, block version, digest
HEADER = struct.Struct(">4sHHIQQ16s")
_DIGEST_SIZE = 16
_SUFFIX = ".kvb"
_TMP_SUFFIX = ".tmp"


class CorruptBlockError(KvfsmError):
    """A block file is damaged: bad header, wrong key, short, or its checksum does not match."""


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A block file on disk (its header checked, its payload not yet)."""

    path: str
    version: int
    size: int  #: the whole file, header included
    payload_len: int


@dataclass(slots=True)
class ScanResult:
    entries: dict[OffloadKey, FileInfo]
    temp_removed: int = 0
    bad_removed: int = 0
    old_versions_removed: int = 0


def key_name(key: bytes) -> str:
    """The file-name stem of a key: 40 hex digits of its blake2b hash (keys may be long or binary)."""
    return hashlib.blake2b(key, digest_size=20).hexdigest()


def _digest(key: bytes, payload: bytes | memoryview, version: int) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=b"kvfsm-block")
    h.update(struct.pack(">HIQQ", FORMAT_VERSION, len(key), len(payload), version))
    h.update(key)
    h.update(payload)
    return h.digest()


def encode(key: bytes, payload: bytes, version: int) -> bytes:
    header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(key), len(payload), version, _digest(key, payload, version))
    return header + key + payload


def _parse_header(buf: bytes, where: str) -> tuple[int, int, int, bytes]:
    """(key length, payload length, version, digest); raises CorruptBlockError."""
    if len(buf) < HEADER.size:
        raise CorruptBlockError(f"{where}: {len(buf)} bytes; expected a header of {HEADER.size} bytes")
    magic, fmt, _flags, key_len, payload_len, version, digest = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptBlockError(f"{where}: magic {magic!r}; expected {MAGIC!r}")
    if fmt != FORMAT_VERSION:
        raise CorruptBlockError(f"{where}: format version {fmt}; expected {FORMAT_VERSION}")
    return key_len, payload_len, version, digest


def decode(buf: bytes, key: bytes, where: str = "block") -> tuple[int, bytes]:
    """Check a whole block file's bytes against ``key``; returns (version, payload)."""
    key_len, payload_len, version, digest = _parse_header(buf, where)
    want = HEADER.size + key_len + payload_len
    if len(buf) != want:
        raise CorruptBlockError(f"{where}: {len(buf)} bytes; expected {want} (short or trailing data)")
    start = HEADER.size
    if buf[start : start + key_len] != key:
        raise CorruptBlockError(f"{where}: holds another key; expected {key.hex()[:16]}...")
    payload = buf[start + key_len :]
    if _digest(key, payload, version) != digest:
        raise CorruptBlockError(f"{where}: checksum mismatch; the payload or header is damaged")
    return version, payload


def _parse_name(name: str) -> tuple[str, int] | None:
    """(key name, version) of a final block file name, or None."""
    if not name.endswith(_SUFFIX) or name.startswith("."):
        return None
    stem = name[: -len(_SUFFIX)]
    knm, dot, ver = stem.partition(".")
    if not dot or len(knm) != 40 or len(ver) != 16:
        return None
    try:
        int(knm, 16)
        return knm, int(ver, 16)
    except ValueError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class BlockIO:
    """Block-file I/O on one directory, with a fault plan consulted at every operation. Thread-safe.

    - ``root`` (path; required): the directory, created if missing.
    - ``faults`` (:class:`~kvfsm.tiers.faults.FaultPlan`; default None): consulted at every operation.
    - ``durable`` (bool; default False): fsync each file before its rename and its directory after (see
      :class:`~kvfsm.tiers.fs.FileSystemTier`).
    - ``cancel`` (:class:`threading.Event`; default a new one): set by a shutdown to cut injected hangs short.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        faults: FaultPlan | None = None,
        durable: bool = False,
        cancel: threading.Event | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.faults = faults
        self.durable = durable
        self.cancel = cancel if cancel is not None else threading.Event()
        #: Distinguishes this instance's temporary files from a dead process's with the same pid.
        self.token = os.urandom(4).hex()
        self._counter = 0
        self._lock = threading.Lock()
        self._synced_subdirs: set[str] = set()  #: subdirectories whose entry in the root was fsynced

    # -- names --

    def subdir(self, knm: str) -> Path:
        return self.root / knm[:2]

    def path_of(self, key: bytes, version: int) -> Path:
        knm = key_name(key)
        return self.subdir(knm) / f"{knm}.{version:016x}{_SUFFIX}"

    def _temp_path(self, final: Path) -> Path:
        with self._lock:
            self._counter += 1
            n = self._counter
        return final.with_name(f".{final.name}.{os.getpid()}.{self.token}.{n}{_TMP_SUFFIX}")

    def _fault(self, op: str, key: bytes) -> object:
        if self.faults is None:
            return None
        return self.faults.apply(op, key, cancel=self.cancel)

    # -- write --

    def write(self, key: bytes, payload: bytes, version: int, *, sync: bool | None = None) -> FileInfo:
        """Write one block atomically; returns its file. On any error nothing new is visible.

        ``sync`` (default None: ``durable``): fsync the file before its rename and its directory after.
        False leaves both to a later :meth:`make_durable` (the tier's background durability).
        """
        sync = self.durable if sync is None else sync
        data = encode(key, payload, version)
        final = self.path_of(key, version)
        final.parent.mkdir(exist_ok=True)
        tmp = self._temp_path(final)
        rule = self.faults.apply("fs.write", key, cancel=self.cancel) if self.faults is not None else None
        out = data if rule is None else FaultPlan.mangle(rule, data)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                view = memoryview(out)
                written = 0
                while written < len(out):
                    n = os.write(fd, view[written:])
                    if n <= 0:
                        break
                    written += n
                if written != len(data):
                    raise OSError(errno.EIO, f"short write of {tmp.name}: {written} of {len(data)} bytes")
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._fault("fs.replace", key)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if sync:
            self._fsync_dir(final.parent)
            self._sync_root_once(final.parent)
        return FileInfo(str(final), version, len(data), len(payload))

    def make_durable(self, info: FileInfo, key: bytes) -> bool:
        """Make a block written with ``sync=False`` durable: fsync its data (``fs.fsync``), then its
        directory, and the first time a subdirectory is synced, the root that names it (``fs.dirsync``;
        the directory is the index a restart's scan rebuilds, so this persists the index entry).

        Returns False if the file is gone (evicted or replaced meanwhile: nothing to make durable).
        Raises the OSError of a failed sync: the block's bytes on disk are then in doubt.
        """
        self._fault("fs.fsync", key)
        try:
            fd = os.open(info.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._fault("fs.dirsync", key)
        parent = Path(info.path).parent
        self._fsync_dir(parent)
        self._sync_root_once(parent)
        return True

    def _sync_root_once(self, subdir: Path) -> None:
        """fsync the root the first time ``subdir`` (which it names) is made durable by this instance."""
        with self._lock:
            if subdir.name in self._synced_subdirs:
                return
            self._synced_subdirs.add(subdir.name)
        self._fsync_dir(self.root)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- read --

    def read(self, info: FileInfo, key: bytes, expected_len: int | None = None) -> bytes:
        """The payload of a block, verified; on any failure the file is removed and the error raised."""
        try:
            rule = self.faults.apply("fs.read", key, cancel=self.cancel) if self.faults is not None else None
            with open(info.path, "rb") as f:
                buf = f.read()
            if rule is not None:
                buf = FaultPlan.mangle(rule, buf)
            if len(buf) < info.size:
                raise OSError(errno.EIO, f"short read of {Path(info.path).name}: {len(buf)} of {info.size} bytes")
            _version, payload = decode(buf, key, Path(info.path).name)
            if expected_len is not None and len(payload) != expected_len:
                raise CorruptBlockError(
                    f"{Path(info.path).name}: payload of {len(payload)} bytes; expected {expected_len} (one slot)"
                )
            return payload
        except BaseException as exc:
            if not (isinstance(exc, OSError) and exc.errno == errno.ECANCELED):
                self.unlink(info.path, quiet=True)
            raise

    # -- remove --

    def unlink(self, path: str, *, quiet: bool = False) -> bool:
        """Remove a block file; False if it was not there (or, with ``quiet``, if removing it failed)."""
        try:
            self._fault("fs.unlink", b"")
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            if quiet:
                return False
            raise

    def supersede(self, old: FileInfo, new: FileInfo) -> bool:
        """Remove ``old``, a version that ``new`` (a newer version of the same key) replaces, but only once
        ``new`` is on disk (and, with ``durable``, fsynced with its directory): the only valid copy of a
        block is never removed first. Returns True if ``old`` was removed; on any doubt it is kept (a
        restart's scan removes it then)."""
        try:
            if self.durable:
                fd = os.open(new.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._fsync_dir(Path(new.path).parent)
            elif not os.path.exists(new.path):
                return False
        except OSError:
            return False
        return self.unlink(old.path, quiet=True)

    # -- discovery --

    def _header_info(self, path: Path, knm: str, version: int) -> FileInfo | None:
        """The file's info if its header is sound and its size matches; None if not."""
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                key_len, payload_len, hver, _ = _parse_header(head, path.name)
                key = f.read(key_len)
        except (OSError, CorruptBlockError):
            return None
        if hver != version or len(key) != key_len or key_name(key) != knm:
            return None
        if size != HEADER.size + key_len + payload_len:
            return None
        return FileInfo(str(path), version, size, payload_len)

    def key_of(self, info: FileInfo) -> bytes | None:
        try:
            with open(info.path, "rb") as f:
                head = f.read(HEADER.size)
                key_len = _parse_header(head, info.path)[0]
                return f.read(key_len)
        except (OSError, CorruptBlockError):
            return None

    def probe(self, key: bytes) -> FileInfo | None:
        """The newest sound file of ``key`` on disk, or None (runs on the lookup thread)."""
        self._fault("fs.probe", key)
        knm = key_name(key)
        d = self.subdir(knm)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return None
        best: FileInfo | None = None
        for name in names:
            parsed = _parse_name(name)
            if parsed is None or parsed[0] != knm:
                continue
            info = self._header_info(d / name, knm, parsed[1])
            if info is not None and (best is None or info.version > best.version):
                best = info
        return best

    def scan(self) -> ScanResult:
        """Rebuild the index: newest sound file per key; remove stray temporary files of dead writers,
        damaged files and superseded versions."""
        self._fault("fs.scan", b"")
        result = ScanResult({})
        newest: dict[str, tuple[FileInfo, bytes]] = {}
        own = os.getpid()
        try:
            subdirs = sorted(p for p in self.root.iterdir() if p.is_dir() and len(p.name) == 2)
        except FileNotFoundError:
            return result
        for d in subdirs:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                path = d / name
                if name.startswith(".") and name.endswith(_TMP_SUFFIX):
                    parts = name[: -len(_TMP_SUFFIX)].rsplit(".", 3)
                    try:
                        pid, token = int(parts[1]), parts[2]
                    except (IndexError, ValueError):
                        pid, token = -1, ""
                    if token == self.token:
                        continue  # ours, being written right now
                    dead = pid == own or pid < 0 or not _pid_alive(pid)
                    if dead and self.unlink(str(path), quiet=True):
                        result.temp_removed += 1
                    continue
                parsed = _parse_name(name)
                if parsed is None:
                    continue
                knm, version = parsed
                info = self._header_info(path, knm, version)
                if info is None:
                    if self.unlink(str(path), quiet=True):
                        result.bad_removed += 1
                    continue
                prev = newest.get(knm)
                if prev is not None and prev[0].version >= version:
                    if self.unlink(str(path), quiet=True):
                        result.old_versions_removed += 1
                    continue
                key = self.key_of(info)
                if key is None:
                    continue
                if prev is not None and self.unlink(prev[0].path, quiet=True):
                    result.old_versions_removed += 1
                newest[knm] = (info, key)
        result.entries = {OffloadKey(key): info for info, key in newest.values()}
        return result
