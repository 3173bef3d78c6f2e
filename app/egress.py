"""Outbound calls to services a job names (agent services, webhook graders): one policy, one
client.

The policy (`EgressPolicy`) decides which addresses such a call may reach: special-use
addresses (link-local, the cloud metadata address among them, unspecified, multicast,
broadcast, reserved, documentation, benchmarking, shared and the rest of the IANA
special-purpose ranges) are refused unless the operator allows them by network; loopback
and private ranges are allowed unless the operator denies them (`TRAINYARD_EGRESS_DENY`);
`TRAINYARD_EGRESS_ALLOW`, when set, is the only set of destinations allowed.

The client (`EgressClient`) resolves a host once per connection, checks every address it
resolves to, and connects to a checked address: a name that resolves elsewhere a moment
later (DNS rebinding) changes nothing. The request keeps the URL's host in its `Host` header
and, over https, in TLS SNI and certificate verification. An answer is read under one total
deadline, at most `max_bytes` of it once decoded (gzip and deflate are decoded incrementally,
never past the limit); redirects are not followed. Every `EgressError` message is written
here and holds no byte of the remote answer, so callers may show it to any reader of the job.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import socket
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpcore
import httpx


class EgressSettings(Protocol):
    """What a policy is built from (`app.settings.Settings` is one)."""

    egress_allow: list[str]
    egress_deny: list[str]


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

USER_AGENT = "trainyard"
# Headers Trainyard writes itself: a caller's headers may not set them (`check_headers`).
RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "content-encoding",
    }
)
# Headers Trainyard sets on every call, over any a caller gives.
_OWN_HEADERS = frozenset({"content-type", "accept-encoding"})
_HEADER_NAME = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)

LOOPBACK: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
PRIVATE: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("10.0.0.0/8"),
    ipaddress.ip_network("172.16.0.0/12"),
    ipaddress.ip_network("192.168.0.0/16"),
    ipaddress.ip_network("fc00::/7"),
)
# Ranges that carry another address inside: judged by the IPv4 address they carry.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Special-use ranges, by name (the rest of what is not global is "special-purpose").
_EXTRA_SPECIAL: tuple[tuple[IPNetwork, str], ...] = (
    (ipaddress.ip_network("0.0.0.0/8"), "this-network"),
    (ipaddress.ip_network("100.64.0.0/10"), "shared address space"),
    (ipaddress.ip_network("192.0.2.0/24"), "documentation"),
    (ipaddress.ip_network("198.51.100.0/24"), "documentation"),
    (ipaddress.ip_network("203.0.113.0/24"), "documentation"),
    (ipaddress.ip_network("198.18.0.0/15"), "benchmarking"),
    (ipaddress.ip_network("192.0.0.0/24"), "IETF protocol assignments"),
    (ipaddress.ip_network("192.88.99.0/24"), "6to4 relay anycast"),
    (ipaddress.ip_network("64:ff9b:1::/48"), "local-use NAT64"),
    (ipaddress.ip_network("100::/64"), "discard-only"),
    (ipaddress.ip_network("2001::/23"), "IETF protocol assignments"),
    (ipaddress.ip_network("2001:db8::/32"), "documentation"),
)
_KEYWORDS: dict[str, tuple[IPNetwork, ...]] = {"loopback": LOOPBACK, "private": PRIVATE}


def special_use(address: IPAddress) -> str | None:
    """Why `address` is refused by default (a special-use address), or None: global,
    loopback and private addresses are not special here."""
    forms = _forms(address)
    if len(forms) > 1:
        why = special_use(forms[1])
        return f"{why} (as {forms[1]})" if why else None
    if isinstance(address, ipaddress.IPv6Address) and address.teredo is not None:
        return "Teredo"
    if any(address in net for net in LOOPBACK + PRIVATE):
        return None
    if address.is_unspecified:
        return "unspecified"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if isinstance(address, ipaddress.IPv4Address) and address == ipaddress.IPv4Address(
        "255.255.255.255"
    ):
        return "broadcast"
    if address.is_reserved:
        return "reserved"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return "site-local"
    for network, why in _EXTRA_SPECIAL:
        if address in network:
            return why
    if not address.is_global:
        return "special-purpose"
    return None


def _forms(address: IPAddress) -> list[IPAddress]:
    """`address` and the IPv4 address it carries, if any (mapped, 6to4, NAT64): rules on
    IPv4 networks hold for the IPv6 spellings of their addresses too."""
    forms: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is None and address in _NAT64:
            inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if inner is not None:
            forms.append(inner)
    return forms


def _ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


@dataclass(frozen=True)
class Rule:
    """A set of destinations: networks, host names (exact) and domains (`*.example.com`
    or `.example.com`: every name under it)."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Rule:
        """Entries: `loopback`, `private`, an address, a network (CIDR), a host name, or
        `*.domain`. Raises ValueError naming a bad entry."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        domains: list[str] = []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry in _KEYWORDS:
                networks += _KEYWORDS[entry]
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = entry.removeprefix("*.").removeprefix(".")
            if not _is_host_name(name):
                raise ValueError(
                    f"{raw!r} is not an address, a network, a host name, `*.domain`, "
                    "`loopback` or `private`"
                )
            if entry != name:
                domains.append(name.rstrip("."))
            else:
                hosts.add(name.rstrip("."))
        return cls(tuple(networks), frozenset(hosts), tuple(domains))

    def __bool__(self) -> bool:
        return bool(self.networks or self.hosts or self.domains)

    def has_name(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return host in self.hosts or any(host == d or host.endswith("." + d) for d in self.domains)

    def has_address(self, address: IPAddress) -> bool:
        return any(form in net for form in _forms(address) for net in self.networks)


def _is_host_name(name: str) -> bool:
    labels = name.rstrip(".").split(".")
    return (
        0 < len(name) <= 253
        and all(labels)
        and all(
            len(label) <= 63
            and label.isascii()
            and label[0].isalnum()
            and label[-1].isalnum()
            and all(c.isalnum() or c in "-_" for c in label)
            for label in labels
        )
    )


@dataclass(frozen=True)
class EgressPolicy:
    """Where outbound calls may go. `deny` wins; a special-use address needs an `allow`
    network that holds it; a non-empty `allow` is the only set allowed."""

    allow: Rule = field(default_factory=Rule)
    deny: Rule = field(default_factory=Rule)

    @classmethod
    def of(cls, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> EgressPolicy:
        return cls(Rule.parse(allow), Rule.parse(deny))

    @classmethod
    def from_settings(cls, settings: EgressSettings) -> EgressPolicy:
        return _cached_policy(tuple(settings.egress_allow), tuple(settings.egress_deny))

    def refuse_name(self, host: str) -> str | None:
        """Why a call to host name `host` is refused before it is resolved, or None."""
        if self.deny.has_name(host):
            return f"{host} is denied"
        return None

    def refuse_address(self, host: str, address: IPAddress) -> str | None:
        """Why a call to `host`, resolved to `address`, is refused, or None."""
        shown = host if _ip(host) == address else f"{host} ({address})"
        if self.deny.has_name(host) or self.deny.has_address(address):
            return f"{shown} is denied"
        if self.allow.has_address(address):
            return None
        why = special_use(address)
        if why is not None:
            return f"{shown} is a {why} address"
        if self.allow and not self.allow.has_name(host):
            return f"{shown} is not in the allowed destinations"
        return None

    def refuse_url(self, url: str) -> str | None:
        """What can be decided about `url` without resolving it (at submission): its host
        when it is an address literal, or a denied name; else None."""
        host = httpx.URL(url).raw_host.decode("ascii").rstrip(".")
        address = _ip(host)
        if address is not None:
            return self.refuse_address(host, address)
        return self.refuse_name(host)


@functools.lru_cache(maxsize=16)
def _cached_policy(allow: tuple[str, ...], deny: tuple[str, ...]) -> EgressPolicy:
    return EgressPolicy.of(allow, deny)


def check_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    """Raises ValueError for a header a call cannot send: a bad name, a value with a
    control character or outside Latin-1, or one Trainyard writes itself. Messages name
    the header, never its value."""
    for name, value in headers.items():
        if not name or not set(name) <= _HEADER_NAME:
            raise ValueError(f"{name!r} is not a valid header name")
        if name.lower() in RESERVED_HEADERS:
            raise ValueError(f"header {name!r} is set by Trainyard")
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F or ord(c) > 0xFF for c in value):
            raise ValueError(
                f"the value of header {name!r} contains a line break, a control character "
                "or a character outside Latin-1"
            )
    return headers


# -- the client ------------------------------------------------------------------------------


class EgressError(Exception):
    """An outbound call that got no usable answer. `str()` is safe to show: it holds no
    byte of the remote answer and no header the caller gave."""


class EgressRefused(EgressError):
    """The policy refused the destination."""


class EgressTimeout(EgressError):
    """No whole answer within the call's deadline (connecting included)."""


@dataclass(frozen=True)
class Reply:
    """A remote answer: its status and its body, decoded, at most the call's `max_bytes`."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def describe(self) -> str:
        """`HTTP 502 (1234 bytes)`, plus a word on redirects: what job-visible errors say
        of an answer, instead of its body."""
        text = f"HTTP {self.status} ({len(self.body)} bytes)"
        if 300 <= self.status < 400:
            text += "; redirects are not followed"
        return text

    def json(self) -> Any:
        """The body as JSON; ValueError (with a safe message) when it is not."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            raise ValueError(f"a body that is not JSON ({len(self.body)} bytes)") from None


async def _system_resolver(host: str, port: int) -> Sequence[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return [str(info[4][0]) for info in infos]


class _PolicyBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network layer with the policy in it: resolves once, checks every address,
    connects to a checked one. TLS (started by httpcore on the returned stream) still
    verifies and sends SNI for the URL's host name."""

    def __init__(self, policy: EgressPolicy, resolver: Resolver) -> None:
        self.policy = policy
        self.resolver = resolver
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        literal = _ip(host)
        if literal is not None:
            addresses: list[IPAddress] = [literal]
        else:
            refused = self.policy.refuse_name(host)
            if refused is not None:
                raise EgressRefused(f"call refused by the egress policy: {refused}")
            try:
                resolved = await self.resolver(host, port)
            except OSError as exc:
                raise EgressError(f"could not resolve {host}: {_os_reason(exc)}") from None
            addresses = list(dict.fromkeys(a for a in map(_ip, resolved) if a is not None))
            if not addresses:
                raise EgressError(f"could not resolve {host}: no address")
        for address in addresses:  # every one: a name with one bad address is refused
            refused = self.policy.refuse_address(host, address)
            if refused is not None:
                raise EgressRefused(f"call refused by the egress policy: {refused}")
        error: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(
                    str(address), port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - never asked for
        raise EgressRefused("call refused by the egress policy: unix sockets")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@functools.cache
def default_tls_context() -> ssl.SSLContext:
    """A verifying TLS context (httpx's CA bundle), built once per process."""
    return httpx.create_ssl_context()


class EgressClient:
    """POSTs JSON to the services jobs name, under an `EgressPolicy`. One per job run; at
    most `max_connections` connections at once."""

    def __init__(
        self,
        policy: EgressPolicy,
        *,
        max_connections: int = 8,
        tls_context: ssl.SSLContext | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        self.policy = policy
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=tls_context or default_tls_context(),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
            network_backend=_PolicyBackend(policy, resolver or _system_resolver),
        )

    async def post_json(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str],
        timeout_s: float,
        max_bytes: int,
    ) -> Reply:
        """POST `body` (JSON) to `url`; the answer within `timeout_s` seconds in all (name
        resolution, connection, sending, every byte received), at most `max_bytes` once
        decoded. Raises `EgressError`."""
        target = httpx.URL(url)
        if target.scheme not in ("http", "https") or not target.host:
            raise EgressError("the URL is not an http(s) URL")
        own = {"user-agent": USER_AGENT, "accept": "application/json"}  # a caller may change
        given: list[tuple[bytes, bytes]] = []
        for name, value in check_headers(headers).items():
            key = name.lower()
            if key in own:
                own[key] = value
            elif key not in _OWN_HEADERS:
                given.append((name.encode("ascii"), value.encode("latin-1")))
        request_headers = [
            (b"Host", target.netloc),
            (b"User-Agent", own["user-agent"].encode("latin-1")),
            (b"Accept", own["accept"].encode("latin-1")),
            (b"Accept-Encoding", b"gzip, deflate"),
            (b"Content-Type", b"application/json"),
            *given,
        ]
        core_url = httpcore.URL(
            scheme=target.raw_scheme,
            host=target.raw_host,
            port=target.port,
            target=target.raw_path,
        )
        timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
        try:
            async with asyncio.timeout(timeout_s):
                async with self._pool.stream(
                    b"POST",
                    core_url,
                    headers=request_headers,
                    content=body,
                    extensions={"timeout": timeouts},
                ) as response:
                    decoder = _Decoder(response.headers, max_bytes)
                    async for chunk in response.aiter_stream():
                        decoder.feed(chunk)
                    return Reply(response.status, decoder.finish())
        except EgressError:
            raise
        except (TimeoutError, httpcore.TimeoutException):
            raise EgressTimeout(f"timed out after {timeout_s:g} s") from None
        except httpcore.ConnectError as exc:
            raise EgressError(f"request failed: ConnectError: {_connect_reason(exc)}") from None
        except (httpcore.ProtocolError, httpcore.NetworkError) as exc:
            # The message may quote what the remote sent: only the kind is shown.
            raise EgressError(f"request failed: {type(exc).__name__}") from None
        except Exception as exc:  # whatever else broke: its kind, never its words
            raise EgressError(f"request failed: {type(exc).__name__}") from None

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def __aenter__(self) -> EgressClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _connect_reason(exc: Exception) -> str:
    """What went wrong connecting: the local system's or TLS's words, never the remote's."""
    cause = exc.__cause__ or exc.__context__
    inner = cause.__cause__ if isinstance(cause, OSError) and not cause.strerror else None
    if isinstance(inner, BaseExceptionGroup):
        inner = inner.exceptions[0]
    if isinstance(inner, OSError):  # anyio's "all connection attempts failed": the first
        cause = inner
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS: certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):
        return f"TLS: {cause.reason or type(cause).__name__}"
    if isinstance(cause, OSError):
        return f"[Errno {cause.errno}] {cause.strerror}" if cause.strerror else str(cause)
    return type(cause).__name__ if cause is not None else "no detail"


class _TooLarge(EgressError):
    pass


class _Decoder:
    """The body, decoded as it arrives, never past `max_bytes` (nor its wire bytes past
    `max_bytes` plus a little): a small compressed answer that inflates without end stops
    at the limit."""

    def __init__(self, headers: Sequence[tuple[bytes, bytes]], max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.wire_limit = max_bytes + 65536
        self.wire = 0
        self.body = bytearray()
        encodings = [
            token.strip().lower()
            for name, value in headers
            if name.lower() == b"content-encoding"
            for token in value.split(b",")
        ]
        encodings = [e for e in encodings if e and e != b"identity"]
        self.zlib: Any = None
        self.deflate = False
        if len(encodings) > 1:
            raise EgressError("answered with more than one Content-Encoding")
        if encodings:
            if encodings[0] in (b"gzip", b"x-gzip"):
                self.zlib = zlib.decompressobj(16 + zlib.MAX_WBITS)
            elif encodings[0] == b"deflate":
                self.zlib = zlib.decompressobj(zlib.MAX_WBITS)
                self.deflate = True
            else:
                raise EgressError("answered an unsupported Content-Encoding")

    def _too_large(self) -> _TooLarge:
        return _TooLarge(f"answered more than {self.max_bytes} bytes")

    def feed(self, chunk: bytes) -> None:
        self.wire += len(chunk)
        if self.wire > self.wire_limit:
            raise self._too_large()
        if self.zlib is None:
            self.body += chunk
        else:
            self._inflate(chunk)
        if len(self.body) > self.max_bytes:
            raise self._too_large()

    def _inflate(self, chunk: bytes) -> None:
        room = self.max_bytes - len(self.body) + 1  # one more byte says "too large"
        try:
            self.body += self.zlib.decompress(chunk, room)
        except zlib.error:
            if not (self.deflate and self.wire == len(chunk)):
                raise EgressError("answered a body that does not decode") from None
            # Some servers send raw deflate, without the zlib header.
            self.zlib, self.deflate = zlib.decompressobj(-zlib.MAX_WBITS), False
            self._inflate(chunk)

    def finish(self) -> bytes:
        if self.zlib is not None and not self.zlib.eof and self.wire:
            raise EgressError("answered a compressed body that is cut short")
        return bytes(self.body)
