"""The protobuf messages the Tinker SDK sends and expects, read and written by hand.

The SDK (0.38) posts `forward_backward` as a `tinker_public.ForwardBackwardRequest` and reads
`forward`/`forward_backward` and `sample` results only as `ForwardBackwardOutput` and
`SampleResponse` protobufs. Those are a few small messages of a public schema (field numbers
in docs/tinker.md, from the SDK's `tinker/proto/tinker_public_pb2.py`), so they are decoded
and encoded here rather than through generated code: the server then depends neither on the
SDK nor on a protobuf runtime, and `tests/test_tinker_wire.py` checks both directions against
the SDK's own encoder and decoder.

Wire types: 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32. Unknown fields are skipped.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
STOP_REASON = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A body that is not the message it claims to be."""


# -- reading ------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for every field of one message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        value: int | bytes
        if kind == 0:
            value, pos = _varint(buf, pos)
        elif kind == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif kind == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif kind == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise WireError(f"unsupported wire type {kind}")
        if pos > len(buf):
            raise WireError("truncated field")
        yield number, kind, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_ints(value: int | bytes) -> list[int]:
    if isinstance(value, int):
        return [_signed(value)]
    out, pos = [], 0
    while pos < len(value):
        item, pos = _varint(value, pos)
        out.append(_signed(item))
    return out


def _bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise WireError("expected a length-delimited field")
    return value


@dataclass
class Tensor:
    """A dense or CSR tensor, as a flat numpy array and its shape."""

    array: np.ndarray
    shape: list[int]


def read_tensor(buf: bytes) -> Tensor:
    dense, csr, dtype, shape = b"", None, 0, []
    for number, _, value in _fields(buf):
        if number == 1:
            dense = _bytes(value)
        elif number == 2:
            csr = {n: _bytes(v) for n, _, v in _fields(_bytes(value))}
        elif number == 3 and isinstance(value, int):
            dtype = value
        elif number == 4:
            shape += _packed_ints(value)
    kind = _NUMPY.get(dtype)
    if kind is None:
        raise WireError(f"unsupported tensor dtype {dtype}")
    if csr is None:
        array = np.frombuffer(dense, dtype=kind)
        return Tensor(array, shape or [array.size])
    values = np.frombuffer(csr.get(1, b""), dtype=kind)
    crow = np.frombuffer(csr.get(2, b""), dtype=np.int64)
    cols = np.frombuffer(csr.get(3, b""), dtype=np.int64)
    if len(shape) != 2 or len(crow) != shape[0] + 1:
        raise WireError("a sparse tensor needs a 2-D shape and rows + 1 row offsets")
    full = np.zeros(shape, dtype=kind)
    for row in range(shape[0]):
        full[row, cols[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
    return Tensor(full.reshape(-1), shape)


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, Tensor]


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


def _map_entry(buf: bytes) -> tuple[str, int | bytes]:
    key = ""
    value_: int | bytes = b""
    for number, _, item in _fields(buf):
        if number == 1:
            key = _bytes(item).decode()
        elif number == 2:
            value_ = item
    return key, value_


def _read_datum(buf: bytes) -> Datum:
    tokens: list[int] = []
    inputs: dict[str, Tensor] = {}
    for number, _, value in _fields(buf):
        if number == 1:
            for kind, _, chunk in _fields(_bytes(value)):
                if kind != 1:
                    raise WireError("only encoded-text chunks are supported (no images or audio)")
                text = dict((n, v) for n, _, v in _fields(_bytes(chunk)))
                tokens += np.frombuffer(_bytes(text.get(1, b"")), dtype=np.int32).tolist()
        elif number == 2:
            key, tensor = _map_entry(_bytes(value))
            inputs[key] = read_tensor(_bytes(tensor))
    return Datum(tokens, inputs)


def read_forward_backward(buf: bytes) -> ForwardBackwardRequest:
    request = ForwardBackwardRequest()
    for number, _, value in _fields(buf):
        if number == 1:
            request.model_id = _bytes(value).decode()
        elif number == 2 and isinstance(value, int):
            request.seq_id = _signed(value)
        elif number == 3:
            request.data.append(_read_datum(_bytes(value)))
        elif number == 4:
            request.loss_fn = _bytes(value).decode()
        elif number == 5:
            key, number_value = _map_entry(_bytes(value))
            request.loss_fn_config[key] = struct.unpack("<d", _bytes(number_value))[0]
        elif number == 6 and isinstance(value, int):
            request.forward_only = bool(value)
    return request


def read_output_metrics(buf: bytes) -> dict[str, float]:
    """The `metrics` of a `ForwardBackwardOutput` (field 3), its arrays skipped: what the
    journal's record of a `forward_backward` says of its loss (`loss:sum`)."""
    metrics: dict[str, float] = {}
    for number, _, value in _fields(buf):
        if number == 3:
            key, number_value = _map_entry(_bytes(value))
            metrics[key] = struct.unpack("<d", _bytes(number_value))[0]
    return metrics


# -- writing ------------------------------------------------------------------------------


def _put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _put_varint(number << 3 | kind)


def _len(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _put_varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return _key(number, 0) + _put_varint(value) if value else b""


def _packed(number: int, values: list[int]) -> bytes:
    return _len(number, b"".join(_put_varint(v) for v in values)) if values else b""


def _batched(arrays: list[np.ndarray], dtype: int) -> bytes:
    """A `BatchedTensor`: the data concatenated, with byte offsets per datum."""
    kind = _NUMPY[dtype]
    parts = [np.ascontiguousarray(a, dtype=kind).reshape(-1) for a in arrays]
    sizes = np.cumsum([0, *(p.nbytes for p in parts)], dtype=np.int64)
    data = b"".join(p.tobytes() for p in parts)
    return _len(1, data) + _len(2, sizes.tobytes()) + _int(3, dtype)


def write_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A `ForwardBackwardOutput` of one `ArrayRecord`: each datum's 1-D float32 fields."""
    names = list(outputs[0]) if outputs else []
    fields = b"".join(
        _len(2, _len(1, name.encode()) + _len(2, _batched([o[name] for o in outputs], 1)))
        for name in names
    )
    record = _len(1, b"ArrayRecord") + fields + _int(3, len(outputs))
    body = _len(1, b"ArrayRecord") + _len(2, record)
    for name, value in metrics.items():
        body += _len(3, _len(1, name.encode()) + _key(2, 1) + struct.pack("<d", value))
    return body


@dataclass
class OutTensor:
    """A `Tensor` of an answer: `values` (float32 or int64), every cell of `shape` row-major
    (dense), or only those CSR `crow` and `cols` list."""

    values: np.ndarray
    shape: list[int]
    crow: np.ndarray | None = None
    cols: np.ndarray | None = None


def _tensor(tensor: OutTensor) -> bytes:
    dtype = DTYPE_INT64 if tensor.values.dtype == np.int64 else DTYPE_FLOAT32
    values = np.ascontiguousarray(tensor.values, dtype=_NUMPY[dtype]).tobytes()
    if tensor.crow is None or tensor.cols is None:
        encoded = _len(1, values)
    else:
        crow = np.ascontiguousarray(tensor.crow, dtype=np.int64).tobytes()
        cols = np.ascontiguousarray(tensor.cols, dtype=np.int64).tobytes()
        encoded = _len(2, _len(1, values) + _len(2, crow) + _len(3, cols))
    return encoded + _int(3, dtype) + _packed(4, tensor.shape)


@dataclass
class TopK:
    """`TopkLogprobs`: the k likeliest tokens and their logprobs at each of `length`
    positions, row-major; a position with nothing is the SDK's sentinel (token 0, logprob
    `MASK_LOGPROB`), which it reads as None."""

    token_ids: np.ndarray  # int32, (length, k)
    logprobs: np.ndarray  # float32, (length, k)


MASK_LOGPROB = -99999.0


def _topk(topk: TopK) -> bytes:
    length, k = topk.token_ids.shape
    return (
        _len(1, np.ascontiguousarray(topk.token_ids, dtype=np.int32).tobytes())
        + _len(2, np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes())
        + _int(3, k)
        + _int(4, length)
    )


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk: TopK | None = None  # `topk_sample_logprobs`: at each sampled position


@dataclass
class SampleAnswer:
    """A `SampleResponse`: the sequences, and what was asked of the prompt."""

    sequences: list[Sequence]
    prompt_logprobs: list[float] | None = None
    topk_prompt_logprobs: TopK | None = None
    target_prompt_logprobs: OutTensor | None = None
    prompt_alt_tokens: tuple[OutTensor, OutTensor] | None = None  # tokens, logprobs


def write_sample_response(answer: SampleAnswer) -> bytes:
    body = b""
    for seq in answer.sequences:
        message = (
            _int(1, STOP_REASON[seq.stop_reason])
            + _len(2, np.asarray(seq.tokens, dtype=np.int32).tobytes())
            + _len(3, np.asarray(seq.logprobs, dtype=np.float32).tobytes())
        )
        if seq.topk is not None:
            message += _len(4, _topk(seq.topk))
        body += _len(1, message)
    if answer.prompt_logprobs is not None:
        body += _len(2, np.asarray(answer.prompt_logprobs, dtype=np.float32).tobytes())
    if answer.topk_prompt_logprobs is not None:
        body += _len(3, _topk(answer.topk_prompt_logprobs))
    if answer.target_prompt_logprobs is not None:
        body += _len(5, _tensor(answer.target_prompt_logprobs))
    if answer.prompt_alt_tokens is not None:
        tokens, logprobs = answer.prompt_alt_tokens
        body += _len(6, _len(1, _tensor(tokens)) + _len(2, _tensor(logprobs)))
    return body
