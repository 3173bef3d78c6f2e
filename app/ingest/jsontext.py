"""JSON text in and out of the service, in pieces that keep the event loop serving.

`loads` is the one parser of request bodies. It reads what `json.loads` reads and refuses
what the rest of the service could not keep or the worker could not read back:

- nesting deeper than `max_depth` (the worker's JSON reader stops near 200 levels,
  responses near 250, Python's parser near 1000);
- strings or object keys that are not valid Unicode: a lone UTF-16 surrogate such as
  `"\\ud800"` (UTF-8 cannot encode it: SQLite would store it and fail every read after,
  Postgres refuses it);
- `NaN`, `Infinity` and numbers too large for a float (`1e400`): no JSON number.

Each problem is reported with the path of the value (`groups[0].metadata.k`).

Why not `json.loads` on the whole text: it holds the GIL for the whole parse (about 0.5 s
for 60 MB here), so a thread does not keep the event loop serving. `loads` walks the top
of the document itself and hands every piece that fits in `CHUNK` characters to the same
C scanner `json.loads` uses; each call holds the GIL for a few milliseconds at most.

`dumps` is `app.db.json_dumps` (the same text) built the same way, piece by piece.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from itertools import islice
from json import JSONDecodeError
from json.scanner import make_scanner
from typing import Any

from app.db import json_dumps

CHUNK = 64 * 1024
"""Characters of text one call of the C scanner may parse: about a millisecond, during which
no other thread (the event loop's included) runs. 256 KiB took 3-8 ms and parsed no faster."""
_FIRST_WINDOW = 4096

Loc = tuple[str | int, ...]


class JsonTextError(ValueError):
    """A JSON text this service does not accept: `path` names the value, or `pos` the
    character where the syntax breaks."""

    def __init__(self, message: str, *, type: str, path: Loc = (), pos: int | None = None):
        super().__init__(message)
        self.message = message
        self.type = type
        self.path = path
        self.pos = pos
        # What was parsed before the error: the caller frees it (see `loads`).
        self.document: Any = None


class _NonFinite:
    """What `NaN`, `Infinity` and `-Infinity` parse to, until the checks report them."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_DECODER = json.JSONDecoder(parse_constant=_NonFinite, strict=True)
scanstring = json.decoder.scanstring  # type: ignore[attr-defined]
_DECODE_ERRORS = (StopIteration, JSONDecodeError, ValueError, RecursionError)
_WS = re.compile(r"[ \t\n\r]*")
_WS_CHARS = " \t\n\r"
_SURROGATE = re.compile("[\ud800-\udfff]")
_DIGITS = bytes.maketrans(b"123456789E", b"000000000e")
_WINDOW = 1 << 20
_DIGIT_RUN = 200
_OVERLAP = 320  # over _DIGIT_RUN and the longest other mark
_UTF16_OR_32 = re.compile(rb"\A(?:\xff\xfe|\xfe\xff|\x00\x00|\x00.\x00|.\x00)", re.S)


class JsonValueErrors(ValueError):
    """Values of a JSON text that the checks refuse (see the module), in document order."""

    def __init__(self, errors: list[JsonTextError], document: Any) -> None:
        super().__init__(f"{len(errors)} value(s) refused")
        self.errors = errors
        self.document = document  # the parsed text: the caller frees it (see `loads`)


class Unstreamable(ValueError):
    """A text `loads` cannot hand out a piece at a time: it may hold a value the checks
    refuse (found on the whole document), or it gives a key twice on the way to a
    streamed array (the last counts); or an item its taker would not take. Parse it
    whole."""


Streams = Mapping[Loc, Callable[[Any], None]]
"""Arrays handed out an item at a time: the path of an array (object keys from the top,
`("collection", "trajectories")`), and what takes each of its items as it is parsed."""


def loads(
    data: bytes, *, max_depth: int, max_errors: int = 100, streams: Streams | None = None
) -> Any:
    """Parse a JSON text (UTF-8 bytes) as `json.loads` does, checked as the module says.
    Raises `JsonTextError` for text that is not UTF-8 or not JSON (with `pos`, a character
    offset, for a syntax error) or a value nested too deep (with `path`), and
    `JsonValueErrors` for values the checks refuse (at most `max_errors`).

    With `streams`, each item of an array at one of its paths goes to its taker as soon as
    it is parsed, and the document holds that array empty: a large body's groups need not
    exist all at once. What a taker raises stops the parse and is raised as it is. A text
    the value checks would walk raises `Unstreamable` before anything is parsed."""
    if streams and _suspect(data):
        raise Unstreamable("the text may hold refused values; parse it whole")
    text = decode(data)
    parser = _Parser(text, max_depth, streams or {})
    try:
        value, end = parser.value(parser.skip(0), 0, ())
    except JsonTextError as exc:
        exc.document = parser.open  # what was parsed so far, outermost first
        raise
    end = parser.skip(end)
    if end != len(text):
        error = _syntax("Extra data", end)
        error.document, value = value, None
        raise error
    if not streams and _suspect(data):
        problems = list(islice(_problems(value), max_errors))
        if problems:
            refused, value = JsonValueErrors(problems, value), None
            raise refused
    return value


STORED_DEPTH = 256
"""How deep `load_stored` lets a document nest: what the service stores was read at the
edge within `max_json_depth` (at most 128), inside a few levels of its own."""


def load_stored(data: bytes) -> Any:
    """A JSON text this service wrote (a payload, a dataset), parsed a piece at a time as
    `loads` parses: read in a worker thread, one `json.loads` of a large payload would hold
    the GIL, and so the event loop, for the whole parse."""
    return loads(data, max_depth=STORED_DEPTH)


def decode(data: bytes) -> str:
    """UTF-8 bytes as text: no byte order mark, no UTF-16 or UTF-32 (RFC 8259: JSON
    exchanged between systems is UTF-8)."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise JsonTextError(
            "the body starts with a byte order mark (U+FEFF): send UTF-8 JSON without one",
            type="json_invalid",
        )
    if _UTF16_OR_32.match(data):
        raise JsonTextError(
            "the body is UTF-16 or UTF-32 text: send JSON as UTF-8 (RFC 8259)",
            type="json_invalid",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonTextError(
            f"the body is not UTF-8 text: {exc.reason} at byte {exc.start}", type="json_invalid"
        ) from None


def _syntax(message: str, pos: int) -> JsonTextError:
    return JsonTextError(message, type="json_invalid", pos=pos)


def _suspect(data: bytes) -> bool:
    """Whether the text may hold a value the checks refuse: a surrogate escape, NaN,
    Infinity, an exponent of three digits or more, a run of 200 digits (with an exponent
    under 100, a number overflows a double from 211 digits on: `1` and 300 zeros `e10` is
    infinite). Most bodies hold none; those that do are walked. A window at a time: each
    call holds the GIL."""
    for start in range(0, len(data), _WINDOW):
        window = data[start : start + _WINDOW + _OVERLAP]
        if b"\\ud" in window or b"\\uD" in window or b"NaN" in window or b"Infinity" in window:
            return True
        digits = window.translate(_DIGITS)
        if b"e000" in digits or b"e+000" in digits or b"0" * _DIGIT_RUN in digits:
            return True
    return False


class _Parser:
    def __init__(self, text: str, max_depth: int, streams: Streams) -> None:
        # The C scanner `json.loads` uses; one per text (it keeps a memo of keys).
        self.scan = make_scanner(_DECODER)  # type: ignore[arg-type]
        self.s = text
        self.n = len(text)
        self.max_depth = max_depth
        # Characters of windows the scanner gave up on (the value was larger): past the
        # budget, containers are walked here without trying the scanner first.
        self.wasted = 0
        self.budget = max(self.n, 4 * CHUNK)
        # The containers being walked, outermost first (what an error leaves behind).
        self.open: list[Any] = []
        self.streams = streams
        # The containers on the way to a streamed array. Streamed or not, the parse takes
        # the same steps (the same calls of the scanner, the same walks), so it refuses and
        # accepts the same texts; only a walked streamed array's items are handed out.
        self.above = {path[:n] for path in streams for n in range(len(path) + 1)}

    def skip(self, idx: int) -> int:
        if idx < self.n and self.s[idx] in _WS_CHARS:
            return _WS.match(self.s, idx).end()  # type: ignore[union-attr]
        return idx

    def value(self, idx: int, depth: int, path: Loc, hint: int = 0) -> tuple[Any, int]:
        """The value at `idx` (no whitespace before it), inside `depth` containers.
        `hint`: the length of the value before it in the same container."""
        char = self.s[idx : idx + 1]
        if char != "{" and char != "[":
            return self.scalar(idx)
        if depth >= self.max_depth:
            raise _too_deep(self.max_depth, path)
        parsed = self.whole(idx, depth, path, hint)
        if parsed is not None:  # a streamed array in it stays in it: nothing was taken
            return parsed
        if char == "{":
            return self.object(idx, depth, path)
        return self.array(idx, depth, path)

    def scalar(self, idx: int) -> tuple[Any, int]:
        try:
            result: tuple[Any, int] = self.scan(self.s, idx)
        except StopIteration as exc:
            raise _syntax("Expecting value", exc.value) from None
        except JSONDecodeError as exc:
            raise _syntax(exc.msg, exc.pos) from None
        except ValueError as exc:  # an integer of more than 4300 digits
            raise _syntax(str(exc).split(";")[0], idx) from None
        return result

    def whole(self, idx: int, depth: int, path: Loc, hint: int) -> tuple[Any, int] | None:
        """The container at `idx`, parsed by one call of the scanner if it fits in a
        window; None if it does not, or breaks somewhere (walking it finds where)."""
        if self.wasted > self.budget:
            return None
        rest = self.n - idx
        window = min(CHUNK, max(_FIRST_WINDOW, 2 * hint))
        while True:
            if rest <= window:
                try:
                    value, end = self.scan(self.s, idx)
                except _DECODE_ERRORS:
                    return None
                break
            try:
                value, end = self.scan(self.s[idx : idx + window], 0)
            except _DECODE_ERRORS:
                self.wasted += window
                if window == CHUNK:
                    return None
                window = CHUNK
                continue
            end += idx
            break
        if _brackets(self.s, idx, end) > self.max_depth - depth:
            _check_depth(value, depth, self.max_depth, path)
        return value, end

    def object(self, idx: int, depth: int, path: Loc) -> tuple[dict[str, Any], int]:
        s, skip = self.s, self.skip
        result: dict[str, Any] = {}
        idx = skip(idx + 1)
        if s[idx : idx + 1] == "}":
            return result, idx + 1
        self.open.append(result)
        hint = 0
        while True:
            if s[idx : idx + 1] != '"':
                raise _syntax("Expecting property name enclosed in double quotes", idx)
            try:
                key, idx = scanstring(s, idx + 1, True)
            except JSONDecodeError as exc:
                raise _syntax(exc.msg, exc.pos) from None
            if key in result and path in self.above:
                # The last of the keys counts, and the items of a streamed array it held
                # (here, or further in) were handed out already.
                raise Unstreamable(f"{(*path, key)} is given more than once")
            idx = skip(idx)
            if s[idx : idx + 1] != ":":
                raise _syntax("Expecting ':' delimiter", idx)
            start = skip(idx + 1)
            result[key], idx = self.value(start, depth + 1, (*path, key), hint)
            hint = idx - start
            idx = skip(idx)
            char = s[idx : idx + 1]
            if char == "}":
                self.open.pop()
                return result, idx + 1
            if char != ",":
                raise _syntax("Expecting ',' delimiter", idx)
            idx = skip(idx + 1)

    def array(self, idx: int, depth: int, path: Loc) -> tuple[list[Any], int]:
        s, skip = self.s, self.skip
        result: list[Any] = []
        idx = skip(idx + 1)
        if s[idx : idx + 1] == "]":
            return result, idx + 1
        self.open.append(result)
        take = self.streams.get(path) if self.above else None
        hint = count = 0
        while True:
            start = idx
            item, idx = self.value(start, depth + 1, (*path, count), hint)
            if take is None:
                result.append(item)
            else:
                take(item)
                del item  # the taker's now, to keep or let go
            count += 1
            hint = idx - start
            idx = skip(idx)
            char = s[idx : idx + 1]
            if char == "]":
                self.open.pop()
                return result, idx + 1
            if char != ",":
                raise _syntax("Expecting ',' delimiter", idx)
            idx = skip(idx + 1)


def _brackets(text: str, start: int, end: int) -> int:
    """An upper bound of how deep the value text[start:end] nests."""
    return text.count("[", start, end) + text.count("{", start, end)


def _too_deep(max_depth: int, path: Loc) -> JsonTextError:
    return JsonTextError(
        f"nests arrays or objects deeper than {max_depth} levels",
        type="json_too_deep",
        path=_printable(path),
    )


def _check_depth(value: Any, depth: int, max_depth: int, path: Loc) -> None:
    """Raise at the first container of `value` (inside `depth` containers, at `path`)
    nested deeper than `max_depth`."""
    if _nests_within(value, max_depth - depth):
        return
    stack: list[tuple[Any, int, Loc]] = [(value, depth, path)]
    while stack:
        item, level, where = stack.pop()
        if isinstance(item, dict):
            children: Any = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if level >= max_depth:
            raise _too_deep(max_depth, where)
        stack.extend((child, level + 1, (*where, key)) for key, child in reversed(list(children)))


def _nests_within(value: Any, levels: int) -> bool:
    """Whether `value` nests at most `levels` containers deep (a level at a time)."""
    frontier = [value] if type(value) is dict or type(value) is list else []
    while frontier:
        levels -= 1
        if levels < 0:
            return False
        children: list[Any] = []
        for item in frontier:
            children.extend(item.values() if type(item) is dict else item)
        frontier = [child for child in children if type(child) is dict or type(child) is list]
    return True


_UNICODE = "is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff escape)"


def _problems(value: Any) -> Iterator[JsonTextError]:
    """The values the checks refuse, in document order."""
    stack: list[tuple[Any, Loc, bool]] = [(value, (), False)]
    while stack:
        item, path, bad_key = stack.pop()
        if bad_key:
            yield JsonTextError(f"the key {_UNICODE}", type="string_unicode", path=_printable(path))
        if isinstance(item, str):
            if _SURROGATE.search(item):
                yield JsonTextError(
                    f"the text {_UNICODE}", type="string_unicode", path=_printable(path)
                )
        elif isinstance(item, float):
            if not math.isfinite(item):
                yield JsonTextError(
                    "the number is too large for a double",
                    type="finite_number",
                    path=_printable(path),
                )
        elif type(item) is _NonFinite:
            yield JsonTextError(
                f"{item.text} is not a JSON number", type="finite_number", path=_printable(path)
            )
        elif isinstance(item, dict):
            stack.extend(
                (child, (*path, key), bool(_SURROGATE.search(key)))
                for key, child in reversed(item.items())
            )
        elif isinstance(item, list):
            stack.extend((item[i], (*path, i), False) for i in range(len(item) - 1, -1, -1))


def _printable(path: Loc) -> Loc:
    """`path` with lone surrogates in its keys written as escapes, so it can be sent."""
    return tuple(
        part.encode("utf-8", "backslashreplace").decode("utf-8")
        if isinstance(part, str) and _SURROGATE.search(part)
        else part
        for part in path
    )


# --------------------------------------------------------------------------------------------
# Out
# --------------------------------------------------------------------------------------------


def dumps(value: Any) -> str:
    """`app.db.json_dumps(value)`: the same text, encoded a piece of at most about
    `PIECE` nodes at a time (see the module)."""
    return "".join(_pieces(value, _Weights()))


def dumps_bytes(value: Any) -> bytes:
    """`dumps(value)` as UTF-8, for a large document. Joining str pieces, or encoding a
    large str, is one call that holds the GIL while it copies (50 MB: tens of ms, more on
    a loaded machine); `bytes.join` copies without it (from 1 MiB on)."""
    return b"".join(dumps_pieces(value))


def dumps_pieces(value: Any) -> Iterator[bytes]:
    """`dumps_bytes(value)` a piece at a time (UTF-8), for a consumer that need not hold
    the whole text (a compressor)."""
    for piece in _pieces(value, _Weights()):
        yield piece.encode()


PIECE = 4096
"""Nodes (values; a long string counts as several) one call of the encoder may take."""


def _pieces(value: Any, weights: _Weights) -> Iterator[str]:
    if weights.of(value) is not None:
        yield json_dumps(value)
    elif isinstance(value, dict) and all(type(key) is str for key in value):
        yield "{"
        yield from _members(list(value.items()), "{}", weights)
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        yield from _members(value, "[]", weights)
        yield "]"
    else:
        yield json_dumps(value)


def _members(members: Any, brackets: str, weights: _Weights) -> Iterator[str]:
    """An object's members (key, value) or an array's items, separated as `json.dumps`
    separates them: small neighbours are encoded together, each larger one in pieces."""
    batch: list[Any] = []
    room = PIECE
    first = True
    for member in members:
        item = member[1] if brackets == "{}" else member
        weight = weights.of(item)
        if weight is not None and weight < room:
            batch.append(member)
            room -= weight + 1
            continue
        if batch:
            yield ("" if first else ", ") + _encode_batch(batch, brackets)
            first, batch, room = False, [], PIECE
        if weight is not None:
            batch.append(member)
            room -= weight + 1
            continue
        if not first:
            yield ", "
        first = False
        if brackets == "{}":
            yield json.dumps(member[0]) + ": "
        yield from _pieces(item, weights)
    if batch:
        yield ("" if first else ", ") + _encode_batch(batch, brackets)


def _encode_batch(batch: list[Any], brackets: str) -> str:
    return json_dumps(dict(batch) if brackets == "{}" else batch)[1:-1]


_UNKNOWN = object()
_REMEMBERED = 64
"""Containers heavier than this many nodes have their weight remembered."""


class _Weights:
    """How many nodes a value has (a long string counts as several), or None if more than
    `PIECE`, for one document being encoded. The weight of each container over
    `_REMEMBERED` nodes is remembered (by `id`, while the document is alive): walking down
    into a heavy container, its members were weighed already, so every node is counted at
    most about twice rather than once per level above it (that was 3.5x the time of
    encoding the document whole). Small ones are weighed again when asked."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[int, int | None] = {}

    def of(self, value: Any) -> int | None:
        kind = type(value)
        if kind is str:
            return 1 + (len(value) >> 6)
        if kind is not dict and kind is not list and kind is not tuple:
            return 1
        key = id(value)
        known = self._known.get(key, _UNKNOWN)
        if known is not _UNKNOWN:
            return known  # type: ignore[return-value]
        total = 1 + len(value)
        weight: int | None = None
        if total <= PIECE:
            for item in value.values() if kind is dict else value:
                inner = type(item)
                if inner is str:
                    total += len(item) >> 6
                elif (inner is dict or inner is list or inner is tuple) and item:
                    below = self.of(item)  # an empty one weighs 1, counted above
                    if below is None:
                        break
                    total += below - 1
                if total > PIECE:
                    break
            else:
                weight = total
        if weight is None or weight > _REMEMBERED:
            # Small containers are weighed again when asked (a few nodes); remembering
            # each of the document's many small ones cost more than that.
            self._known[key] = weight
        return weight
