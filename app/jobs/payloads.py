"""What a queued job holds: a spec, validated and normalized at the edge, stored as
zstd-compressed JSON with `payload_format` naming its version, and decoded through one
codec per kind keyed on that name.

The wire contract (request bodies) and the stored shape change apart: a new spec version
adds a decoder here, and jobs queued before an upgrade keep decoding with theirs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import zstandard

from app.ingest import jsontext

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


FEED = 1 << 20
"""Bytes handed to the compressor in one call."""


def compress(raw: bytes) -> bytes:
    """One zstd frame of `raw`, in a bytes object of its own size."""
    view = memoryview(raw)
    data, _ = compress_pieces(view[start : start + FEED] for start in range(0, len(raw), FEED))
    return data


def compress_pieces(pieces: Iterable[bytes | memoryview]) -> tuple[bytes, int]:
    """One zstd frame of the pieces' concatenation, and that concatenation's size (see
    `Compressing`)."""
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = _compressor()
    frame = Compressing(compressor)
    for piece in pieces:
        frame.add(piece)
    return frame.finish()


def _compressor() -> zstandard.ZstdCompressor:
    # Level 1: several hundred MB/s; JSON trajectories still shrink 5-10x.
    return zstandard.ZstdCompressor(level=1)


class Compressing:
    """One zstd frame of pieces handed in one at a time. The compressor is fed about FEED
    bytes at a time, so the uncompressed text never exists whole; and what `finish` returns
    is the frame's size. (`ZstdCompressor.compress` returns an object that keeps its whole
    worst-case buffer: a 25 MB spec's 3 MB frame held 25 MB for as long as the job's payload
    lived.) Without a `compressor`, it has one of its own: one compressor serves one frame
    at a time."""

    def __init__(self, compressor: zstandard.ZstdCompressor | None = None) -> None:
        self._stream = (compressor or _compressor()).compressobj()
        self._frame: list[bytes] = []
        self._batch: list[bytes | memoryview] = []
        self._batched = 0
        self._size = 0

    def add(self, piece: bytes | memoryview) -> None:
        self._batch.append(piece)
        self._batched += len(piece)
        if self._batched >= FEED:
            self._feed()

    def _feed(self) -> None:
        self._frame.append(self._stream.compress(b"".join(self._batch)))
        self._size += self._batched
        self._batch.clear()
        self._batched = 0

    def finish(self) -> tuple[bytes, int]:
        """The frame, and the size of what was added."""
        self._feed()
        self._frame.append(self._stream.flush())
        return b"".join(self._frame), self._size


def decompress(data: bytes, size: int) -> bytes:
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=size)


@dataclass(frozen=True)
class Codec(Generic[T]):
    """The stored formats of one kind of job: `current` is what new jobs are written in;
    `decoders` read every format ever written (each takes the uncompressed JSON)."""

    current: str
    decoders: Mapping[str, Callable[[bytes], T]]

    def encode(self, document: Any) -> Payload:
        # `json_dumps`'s text, built and compressed a piece at a time: a large spec is
        # encoded in a thread while the event loop keeps serving (see `app.ingest.jsontext`), and
        # its whole text is never held at once.
        data, size = compress_pieces(jsontext.dumps_pieces(document))
        return Payload(self.current, data, size)

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
