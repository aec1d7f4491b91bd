"""The value format and key namespace of the Redis tier (pure: no redis-py, no I/O).

One Redis value per offloaded chunk (one CPU slot, every layer, every rank)::

    header  >4s B B 16s H Q 16s   magic "KVRD", format version, flags (0), namespace digest,
                                  key length, payload length, checksum
    key     the offload key (its bytes), so a value stored under another key is detected
    payload the slot bytes

The checksum is BLAKE2b-128 over the header fields before it, the key and the payload: a value truncated,
overwritten or flipped on the server fails it. The namespace digest (:meth:`Namespace.digest`) hashes the
model, the KV geometry, the dtype and the world size, and is also part of every Redis key
(:meth:`Namespace.redis_key`), so engines serving different models on one server never even read each
other's values, and a value copied between namespaces is still refused. Anything that does not decode is
a :class:`ValueMismatch` with the :class:`MismatchKind` saying why: the tier counts it as a miss and never
serves it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import Enum

from kvfsm.errors import ConfigError, KvfsmError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MismatchKind",
    "Namespace",
    "ValueMismatch",
    "decode_value",
    "encode_value",
]

MAGIC = b"KVRD"
FORMAT_VERSION = 1
HEADER = struct.Struct(">4sBB16sHQ16s")
_PREFIX = struct.Struct(">4sBB16sHQ")  # the header fields the checksum covers


class MismatchKind(Enum):
    """Why a value read from the server was not served."""

    TRUNCATED = "truncated"  #: shorter than its header says
    MAGIC = "magic"  #: not a kvfsm value at all (garbage, another application's)
    VERSION = "version"  #: written by another format version
    NAMESPACE = "namespace"  #: written for another model, geometry, dtype or world size
    KEY = "key"  #: the value of another chunk
    LENGTH = "length"  #: the payload is not one slot of this geometry
    CHECKSUM = "checksum"  #: damaged on the server or on the wire


class ValueMismatch(KvfsmError):
    """A value read from the server is not the chunk asked for; ``kind`` says why."""

    def __init__(self, kind: MismatchKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Namespace:
    """What a chunk's bytes depend on besides its content: two engines share values only if all agree.

    - ``model`` (str): the model's name or path (and revision, if it matters).
    - ``num_layers``, ``num_heads``, ``head_dim``, ``tokens_per_block``, ``blocks_per_chunk`` (ints >= 1):
      the KV geometry (``num_heads`` over all ranks).
    - ``dtype`` (str): the KV cache element type (``"float16"``).
    - ``world_size`` (int >= 1): tensor-parallel ranks (the slot is their shards, rank 0 first).
    - ``prefix`` (str; default ``"kvfsm"``): the configurable start of every Redis key.
    """

    model: str
    num_layers: int
    num_heads: int
    head_dim: int
    tokens_per_block: int
    blocks_per_chunk: int
    dtype: str
    world_size: int
    prefix: str = "kvfsm"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "tokens_per_block", "blocks_per_chunk", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"namespace {name}={v!r}; expected an int >= 1")
        if not self.model:
            raise ConfigError("namespace model is empty; expected the model's name")
        if not self.prefix or any(c in self.prefix for c in "{} \r\n"):
            raise ConfigError(f"namespace prefix={self.prefix!r}; expected a non-empty string without braces or spaces")

    def digest(self) -> bytes:
        """16 bytes identifying everything a chunk's layout depends on (not the prefix)."""
        text = "\0".join(
            str(v)
            for v in (
                self.model,
                self.num_layers,
                self.num_heads,
                self.head_dim,
                self.tokens_per_block,
                self.blocks_per_chunk,
                self.dtype,
                self.world_size,
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvfsm-redis-ns").digest()

    @property
    def tag(self) -> str:
        """The namespace part of every key: the prefix and the digest in hex."""
        return f"{self.prefix}:{self.digest().hex()}"

    def redis_key(self, key: bytes) -> str:
        """The Redis key of one chunk. No hash tag: in a cluster, chunks spread over every slot (and
        node); the tier groups its batches by slot itself."""
        return f"{self.tag}:{key.hex()}"


def _checksum(prefix: bytes, key: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(prefix, digest_size=16)
    h.update(key)
    h.update(payload)
    return h.digest()


def encode_value(namespace_digest: bytes, key: bytes, payload: bytes) -> bytes:
    """The Redis value of chunk ``key`` holding ``payload``."""
    if len(namespace_digest) != 16:
        raise ConfigError(f"namespace digest of {len(namespace_digest)} bytes; expected 16")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, namespace_digest, len(key), len(payload))
    return b"".join((prefix, _checksum(prefix, key, payload), key, payload))


def decode_value(raw: bytes, namespace_digest: bytes, key: bytes, payload_len: int | None) -> bytes:
    """The payload of ``raw`` if it is chunk ``key`` of this namespace (``payload_len`` bytes, when given);
    :class:`ValueMismatch` otherwise."""
    if len(raw) < HEADER.size:
        raise ValueMismatch(MismatchKind.TRUNCATED, f"value of {len(raw)} bytes is shorter than the header")
    magic, version, _flags, ns, key_len, length, checksum = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ValueMismatch(MismatchKind.MAGIC, f"value starts with {magic!r}; expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ValueMismatch(MismatchKind.VERSION, f"value format {version}; expected {FORMAT_VERSION}")
    if ns != namespace_digest:
        raise ValueMismatch(MismatchKind.NAMESPACE, "value was written for another model, geometry or world size")
    end = HEADER.size + key_len + length
    if len(raw) != end:
        raise ValueMismatch(MismatchKind.TRUNCATED, f"value has {len(raw)} bytes; its header says {end}")
    stored_key = raw[HEADER.size : HEADER.size + key_len]
    if stored_key != key:
        raise ValueMismatch(MismatchKind.KEY, f"value holds chunk {stored_key.hex()[:16]}; expected {key.hex()[:16]}")
    if payload_len is not None and length != payload_len:
        raise ValueMismatch(MismatchKind.LENGTH, f"payload of {length} bytes; expected {payload_len}")
    payload = raw[HEADER.size + key_len :]
    if _checksum(raw[: _PREFIX.size], stored_key, payload) != checksum:
        raise ValueMismatch(MismatchKind.CHECKSUM, "value checksum does not match its bytes")
    return payload
