"""What a queued job holds: a spec, validated and normalized at the edge, stored as
zstd-compressed JSON with `payload_format` naming its version, and decoded through one
codec per kind keyed on that name.

The wire contract (request bodies) and the stored shape change apart: a new spec version
adds a decoder here, and jobs queued before an upgrade keep decoding with theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zstandard

from app import jsontext

T = TypeVar("T")
# A compressor per thread: big specs are encoded in worker threads (`asyncio.to_thread`),
# and a zstd compressor must not be used by two threads at once.
_local = threading.local()


class UnknownPayloadFormat(ValueError):
    """A job stored in a format this version of Trainyard cannot read."""


@dataclass(frozen=True)
class Payload:
    """An encoded spec, as the `payload*` columns store it."""

    format: str
    data: bytes  # compressed
    size: int  # bytes of JSON before compression (caps decompression)


def compress(raw: bytes) -> bytes:
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        # Level 1: several hundred MB/s; JSON trajectories still shrink 5-10x.
        compressor = _local.compressor = zstandard.ZstdCompressor(level=1)
    data: bytes = compressor.compress(raw)
    return data


def decompress(data: bytes, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


@dataclass(frozen=True)
class Codec(Generic[T]):
    """The stored formats of one kind of job: `current` is what new jobs are written in;
    `decoders` read every format ever written (each takes the uncompressed JSON)."""

    current: str
    decoders: Mapping[str, Callable[[bytes], T]]

    def encode(self, document: Any) -> Payload:
        # `json_dumps`'s text, built a piece at a time: a large spec is encoded in a
        # thread while the event loop keeps serving (see `app.jsontext`).
        return self.encode_json(jsontext.dumps_bytes(document))

    def encode_json(self, raw: bytes) -> Payload:
        """A document already encoded as JSON (UTF-8)."""
        return Payload(self.current, compress(raw), len(raw))

    def decode(self, payload_format: str, data: bytes, size: int) -> T:
        decoder = self.decoders.get(payload_format)
        if decoder is None:
            raise UnknownPayloadFormat(
                f"payload format {payload_format!r} is unknown to this version; "
                f"known: {', '.join(sorted(self.decoders))}"
            )
        return decoder(decompress(data, size))
