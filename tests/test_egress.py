"""The egress module as an attacker meets it: the policy on every spelling of a refused
address, and the client against services on loopback that send bombs, drips, redirects,
broken framing and secrets to echo, over plain TCP and TLS."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from app.egress import (
    EgressClient,
    EgressError,
    EgressPolicy,
    EgressRefused,
    Rule,
    check_headers,
    special_use,
)
from app.settings import Settings
from tests.hostile import RawServer, Seen, answer, gzip_bomb, head, make_tls, zlib_bomb

MiB = 1 << 20
SECRET = "s3cr3t-marker-7f1e"


def rss() -> int:
    """This process's resident memory now, in bytes (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@asynccontextmanager
async def watched() -> AsyncIterator[dict[str, float]]:
    """Samples the event loop's lag (how late a 10 ms sleep wakes) and RSS while the block
    runs: `lag` is the worst lag in seconds, `rss` the largest growth in bytes."""
    loop = asyncio.get_running_loop()
    seen = {"lag": 0.0, "rss": 0.0}
    base = rss()

    async def tick() -> None:
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            seen["lag"] = max(seen["lag"], loop.time() - start - 0.01)
            seen["rss"] = max(seen["rss"], rss() - base)

    ticker = asyncio.create_task(tick())
    try:
        yield seen
    finally:
        ticker.cancel()


async def post(
    url: str,
    *,
    policy: EgressPolicy | None = None,
    timeout_s: float = 5,
    max_bytes: int = MiB,
    headers: dict[str, str] | None = None,
    **client: Any,
) -> Any:
    async with EgressClient(policy or EgressPolicy(), **client) as egress:
        return await egress.post_json(
            url, b'{"q":1}', headers=headers or {}, timeout_s=timeout_s, max_bytes=max_bytes
        )


async def refused(url: str, **kwargs: Any) -> str:
    with pytest.raises(EgressError) as info:
        await post(url, **kwargs)
    return str(info.value)


# -- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("169.254.0.1", "link-local"),
        ("fe80::1", "link-local"),
        ("fe80::a9fe:a9fe%1", "link-local"),
        ("::ffff:169.254.169.254", "link-local (as 169.254.169.254)"),
        ("64:ff9b::a9fe:a9fe", "link-local (as 169.254.169.254)"),  # NAT64
        ("2002:a9fe:a9fe::1", "link-local (as 169.254.169.254)"),  # 6to4
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("0.1.2.3", "this-network"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("240.0.0.1", "reserved"),
        ("::127.0.0.1", "reserved"),  # IPv4-compatible, deprecated
        ("100.64.0.1", "shared address space"),
        ("192.0.0.8", "IETF protocol assignments"),
        ("192.0.2.1", "documentation"),
        ("203.0.113.9", "documentation"),
        ("2001:db8::1", "documentation"),
        ("198.18.0.1", "benchmarking"),
        ("fec0::1", "site-local"),
        ("2001::1", "Teredo"),
        ("100::1", "reserved"),
    ],
)
def test_special_use_addresses_are_refused_by_default(address: str, why: str) -> None:
    ip = ipaddress.ip_address(address)
    assert special_use(ip) == why
    refusal = EgressPolicy().refuse_address(address, ip)
    assert refusal is not None and why in refusal


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "::ffff:127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "172.31.255.254",
        "192.168.1.1",
        "fd00::1",
        "8.8.8.8",
        "2606:4700::1111",
    ],
)
def test_loopback_private_and_global_addresses_are_allowed_by_default(address: str) -> None:
    assert EgressPolicy().refuse_address(address, ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "::1", "::ffff:127.0.0.1", "10.0.0.7", "192.168.0.1", "fd12::1"]
)
def test_an_operator_can_deny_loopback_and_private_ranges(address: str) -> None:
    policy = EgressPolicy.from_settings(Settings(egress_deny="loopback, private"))  # type: ignore[arg-type]
    assert policy.refuse_address(address, ipaddress.ip_address(address)) == f"{address} is denied"
    assert policy.refuse_address("8.8.8.8", ipaddress.ip_address("8.8.8.8")) is None


def test_deny_by_name_domain_and_network_wins_over_allow() -> None:
    policy = EgressPolicy.of(
        allow=["10.0.0.0/8", "*.example.com"], deny=["bad.example.com", ".internal", "10.9.0.0/16"]
    )
    ip = ipaddress.ip_address
    assert policy.refuse_address("ok.example.com", ip("10.1.1.1")) is None
    assert policy.refuse_address("BAD.example.com.", ip("10.1.1.1")) is not None
    assert policy.refuse_address("x.y.internal", ip("10.1.1.1")) is not None
    assert policy.refuse_address("ok.example.com", ip("10.9.1.1")) is not None
    assert policy.refuse_name("svc.internal") == "svc.internal is denied"


def test_a_non_empty_allow_list_is_the_only_set_allowed() -> None:
    policy = EgressPolicy.of(allow=["api.example.com", "10.0.0.0/8"])
    ip = ipaddress.ip_address
    assert policy.refuse_address("api.example.com", ip("8.8.8.8")) is None
    assert policy.refuse_address("anything", ip("10.2.3.4")) is None
    assert "not in the allowed" in str(policy.refuse_address("other.example.com", ip("8.8.8.8")))
    assert "not in the allowed" in str(policy.refuse_address("127.0.0.1", ip("127.0.0.1")))
    # A name in the allow list does not make a special-use address it resolves to allowed.
    assert "link-local" in str(policy.refuse_address("api.example.com", ip("169.254.169.254")))


def test_an_allowed_network_lifts_the_default_refusal_of_special_use_addresses() -> None:
    policy = EgressPolicy.of(allow=["169.254.10.0/24"])
    ip = ipaddress.ip_address
    assert policy.refuse_address("169.254.10.5", ip("169.254.10.5")) is None
    assert policy.refuse_address("169.254.169.254", ip("169.254.169.254")) is not None


@pytest.mark.parametrize("entry", ["a b", "http://x", "10.0.0.0/33", "*.", "exa mple.com", "-"])
def test_a_bad_policy_entry_stops_the_service_from_starting(entry: str) -> None:
    with pytest.raises(ValidationError, match="not an address, a network"):
        Settings(egress_deny=entry)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an address, a network"):
        Rule.parse([entry])


def test_settings_read_comma_separated_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_EGRESS_ALLOW", "loopback, 10.0.0.0/8,api.example.com")
    monkeypatch.setenv("TRAINYARD_EGRESS_DENY", "*.internal")
    settings = Settings()
    assert settings.egress_allow == ["loopback", "10.0.0.0/8", "api.example.com"]
    assert settings.egress_deny == ["*.internal"]


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"X-Key": f"{SECRET}\r\nX-Evil: 1"}, "line break"),
        ({"X-Key": f"{SECRET}\n"}, "line break"),
        ({"X-Key": f"{SECRET}\0"}, "control character"),
        ({"X-Key": f"{SECRET}\x7f"}, "control character"),
        ({"X-Key": f"{SECRET}\u2603"}, "outside Latin-1"),
        ({"bad name": SECRET}, "not a valid header name"),
        ({"": SECRET}, "not a valid header name"),
        ({"Host": SECRET}, "set by Trainyard"),
        ({"content-length": SECRET}, "set by Trainyard"),
        ({"Transfer-Encoding": SECRET}, "set by Trainyard"),
        ({"Connection": SECRET}, "set by Trainyard"),
    ],
)
def test_headers_a_call_cannot_send_are_refused_without_echoing_the_value(
    headers: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        check_headers(headers)
    assert SECRET not in str(info.value)


# -- answers: bombs and limits ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzip_bomb(1 << 30)  # 1 GiB of zeros in ~1 MiB


async def test_a_gzip_bomb_stops_at_the_limit_without_inflating_it(bomb: bytes) -> None:
    assert len(bomb) < 1.1 * MiB
    served = answer(bomb, 200, ("content-encoding", "gzip"), ("content-type", "text/plain"))
    async with RawServer(served) as server, watched() as seen:
        start = time.monotonic()
        message = await refused(server.url("/"), max_bytes=16 * MiB)
        elapsed = time.monotonic() - start
    assert message == f"answered more than {16 * MiB} bytes"
    assert elapsed < 20, elapsed  # a bounded stop, not the whole GiB (speed: bench)
    assert seen["rss"] < 100 * MiB, seen  # the old client inflated all of it (+2.8 GB)
    # Inflated on the loop, the loop would wait the whole read (lag ≈ elapsed).
    assert seen["lag"] < max(0.5, elapsed / 2), (seen, elapsed)


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("deflate", zlib_bomb(256 * MiB)),
        ("deflate", zlib_bomb(256 * MiB, raw=True)),
        ("x-gzip", gzip_bomb(256 * MiB)),
        ("GZIP", gzip_bomb(256 * MiB)),
        ("identity, gzip", gzip_bomb(256 * MiB)),
    ],
)
async def test_every_decoded_encoding_is_bounded(encoding: str, body: bytes) -> None:
    served = answer(body, 200, ("content-encoding", encoding))
    async with RawServer(served) as server:
        assert await refused(server.url(), max_bytes=MiB) == f"answered more than {MiB} bytes"


async def test_a_chunked_bomb_is_bounded_too(bomb: bytes) -> None:
    async def respond(_seen: Seen, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, ("transfer-encoding", "chunked"), ("content-encoding", "gzip")))
        for start in range(0, len(bomb), 4096):
            piece = bomb[start : start + 4096]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async with RawServer(respond) as server:
        assert await refused(server.url(), max_bytes=MiB) == f"answered more than {MiB} bytes"


async def test_an_endless_plain_body_stops_at_the_limit() -> None:
    async def respond(_seen: Seen, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, ("content-length", str(1 << 40))))
        chunk = b"x" * 65536
        for _ in range(10_000):  # bounded: 640 MiB at most, the client stops far sooner
            writer.write(chunk)
            await writer.drain()

    async with RawServer(respond) as server, watched() as seen:
        assert await refused(server.url(), max_bytes=MiB) == f"answered more than {MiB} bytes"
    assert seen["rss"] < 50 * MiB


@pytest.mark.parametrize(
    ("headers", "body", "message"),
    [
        ((("content-encoding", "br"),), b"x", "answered an unsupported Content-Encoding"),
        ((("content-encoding", "zstd"),), b"x", "answered an unsupported Content-Encoding"),
        (
            (("content-encoding", "gzip, gzip"),),
            b"x",
            "answered with more than one Content-Encoding",
        ),
        ((("content-encoding", "gzip"),), SECRET.encode(), "a body that does not decode"),
        ((("content-encoding", "gzip"),), gzip_bomb(MiB)[:200], "cut short"),
    ],
)
async def test_bodies_that_cannot_be_decoded_are_errors(
    headers: tuple[tuple[str, str], ...], body: bytes, message: str
) -> None:
    async with RawServer(answer(body, 200, *headers)) as server:
        text = await refused(server.url())
    assert message in text and SECRET not in text


async def test_a_body_exactly_at_the_limit_is_read_whole_and_decoded() -> None:
    body = b'{"x":"' + b"y" * (MiB - 8) + b'"}'
    assert len(body) == MiB
    compressed = gzip_bomb(MiB)  # 1 MiB of zeros: exactly the limit, once decoded
    async with (
        RawServer(answer(body)) as plain,
        RawServer(answer(compressed, 200, ("content-encoding", "gzip"))) as gz,
    ):
        assert (await post(plain.url(), max_bytes=MiB)).body == body
        assert (await post(gz.url(), max_bytes=MiB)).body == bytes(MiB)


# -- answers: time ---------------------------------------------------------------------------


async def drip_body(_seen: Seen, writer: asyncio.StreamWriter) -> None:
    writer.write(head(200, ("content-length", "100")))
    for _ in range(100):
        writer.write(b"x")
        await writer.drain()
        await asyncio.sleep(0.2)


async def drip_head(_seen: Seen, writer: asyncio.StreamWriter) -> None:
    # Over 100 bytes, a byte every 0.2 s: it drips for 20 s, as the others do.
    for byte in head(200, ("content-length", "2"), ("x-pad", "p" * 64)) + b"{}":
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.2)


async def never(_seen: Seen, _writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


async def drip_chunks(_seen: Seen, writer: asyncio.StreamWriter) -> None:
    writer.write(head(200, ("transfer-encoding", "chunked")))
    for _ in range(100):
        writer.write(b"1\r\nx\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("respond", [drip_body, drip_head, never, drip_chunks])
async def test_the_deadline_is_total_not_per_read(respond: Any) -> None:
    async with RawServer(respond) as server:
        start = time.monotonic()
        message = await refused(server.url(), timeout_s=1)
        elapsed = time.monotonic() - start
    assert message == "timed out after 1 s"
    # Every read was quicker than the deadline and each answer drips for 20 s or more: a
    # per-read deadline would wait it out. 10 s is 10x the typical, for a loaded machine.
    assert 0.9 < elapsed < 10, elapsed


async def test_a_server_that_does_not_read_the_request_hits_the_deadline() -> None:
    stop = asyncio.Event()

    async def deaf(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.wait_for(stop.wait(), 30)  # reads nothing: the request stalls
        writer.close()

    server = await asyncio.start_server(deaf, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with EgressClient(EgressPolicy()) as egress:
            start = time.monotonic()
            with pytest.raises(EgressError, match="timed out after 1 s"):
                await egress.post_json(
                    f"http://127.0.0.1:{port}/",
                    b"x" * (64 * MiB),
                    headers={},
                    timeout_s=1,
                    max_bytes=MiB,
                )
            assert time.monotonic() - start < 10  # the server would hold it 30 s
    finally:
        stop.set()
        server.close()


# -- answers: redirects and what errors say --------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_redirects_are_not_followed(status: int) -> None:
    async with RawServer(answer(b'{"reward": 1}')) as target:
        moved = answer(SECRET.encode(), status, ("location", target.url("/grade")))
        async with RawServer(moved) as server:
            reply = await post(server.url("/start"))
    assert reply.status == status and not reply.ok
    assert reply.describe() == f"HTTP {status} ({len(SECRET)} bytes); redirects are not followed"
    assert target.seen == []


@pytest.mark.parametrize(
    "respond",
    [
        answer(f"Traceback: {SECRET}".encode(), 500),
        answer(f"<html>{SECRET}</html>".encode(), 200),
        # broken framing that quotes the remote in the parser's own error
        answer(b"", 200, ("x-bad header", SECRET)),
    ],
)
async def test_errors_and_descriptions_hold_no_byte_of_the_remote_answer(respond: Any) -> None:
    async def broken_status(_seen: Seen, writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 {SECRET}\r\n\r\n".encode())

    async with RawServer(respond) as server, RawServer(broken_status) as broken:
        try:
            reply = await post(server.url())
        except EgressError as exc:
            text = str(exc)
        else:
            text = reply.describe()
            with pytest.raises(ValueError) as info:
                reply.json()
            assert SECRET not in str(info.value)
        broken_text = await refused(broken.url())
    assert SECRET not in text
    assert broken_text == "request failed: RemoteProtocolError"


# -- the policy at call time -----------------------------------------------------------------


async def test_a_denied_address_is_refused_before_any_connection() -> None:
    async with RawServer(answer(b"{}")) as server:
        deny = EgressPolicy.of(deny=["loopback"])
        for url in (server.url(), server.url(host="localhost"), server.url(host="127.1.2.3")):
            assert "call refused by the egress policy" in await refused(url, policy=deny)
        assert server.connections == 0


def resolver(table: dict[str, Sequence[str]], calls: list[str]) -> Any:
    async def resolve(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        return table[host]

    return resolve


async def test_a_name_is_resolved_once_and_the_checked_address_is_the_one_connected() -> None:
    calls: list[str] = []
    answers = iter([["127.0.0.1"], ["169.254.169.254"]])  # a rebinding name server

    async def rebinding(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        return next(answers)

    async with RawServer(answer(b'{"ok":true}')) as server:
        reply = await post(server.url("/x", host="rebind.test"), resolver=rebinding)
    assert reply.json() == {"ok": True}
    assert calls == ["rebind.test"]  # checked and connected on the same answer
    assert server.seen[0].headers["host"] == f"rebind.test:{server.port}"
    assert server.seen[0].line == "POST /x HTTP/1.1"


@pytest.mark.parametrize(
    "addresses",
    [
        ["169.254.169.254"],
        ["127.0.0.1", "169.254.169.254"],  # one bad address refuses the name
        ["fe80::1"],
        ["::ffff:169.254.169.254"],
        ["0.0.0.0"],
        ["224.0.0.251"],
    ],
)
async def test_a_name_that_resolves_to_a_refused_address_is_refused(
    addresses: list[str],
) -> None:
    calls: list[str] = []
    async with RawServer(answer(b"{}")) as server:
        table = {"evil.test": addresses}
        message = await refused(
            server.url(host="evil.test"), resolver=resolver(table, calls), timeout_s=2
        )
        assert server.connections == 0
    assert message.startswith("call refused by the egress policy: evil.test (")


async def test_a_name_the_allow_list_does_not_hold_is_refused_after_resolving() -> None:
    calls: list[str] = []
    table = {"a.test": ["127.0.0.1"], "b.test": ["127.0.0.1"]}
    policy = EgressPolicy.of(allow=["a.test"])
    async with RawServer(answer(b"{}")) as server:
        assert (
            await post(server.url(host="a.test"), policy=policy, resolver=resolver(table, calls))
        ).ok
        message = await refused(
            server.url(host="b.test"), policy=policy, resolver=resolver(table, calls)
        )
    assert "b.test (127.0.0.1) is not in the allowed destinations" in message


async def test_a_denied_name_is_not_even_resolved() -> None:
    calls: list[str] = []
    policy = EgressPolicy.of(deny=["*.corp.test"])
    message = await refused("http://db.corp.test:1/", policy=policy, resolver=resolver({}, calls))
    assert message == "call refused by the egress policy: db.corp.test is denied"
    assert calls == []


async def test_a_name_that_does_not_resolve_is_an_error() -> None:
    async def nowhere(host: str, port: int) -> Sequence[str]:
        raise OSError(-2, "Name or service not known")

    assert await refused("http://nowhere.test:1/", resolver=nowhere) == (
        "could not resolve nowhere.test: Name or service not known"
    )


# -- TLS -------------------------------------------------------------------------------------


async def test_https_verifies_and_names_the_urls_host_while_connecting_to_the_checked_address(
    tmp_path: Path,
) -> None:
    tls = make_tls(tmp_path, ["agent.test"])
    calls: list[str] = []
    table = {"agent.test": ["127.0.0.1"]}
    async with RawServer(answer(b'{"ok":1}'), tls=tls.server) as server:
        reply = await post(
            server.url("/run", host="agent.test", scheme="https"),
            tls_context=tls.client,
            resolver=resolver(table, calls),
        )
    assert reply.json() == {"ok": 1}
    assert server.sni == ["agent.test"]
    assert server.seen[0].headers["host"] == f"agent.test:{server.port}"
    assert calls == ["agent.test"]


@pytest.mark.parametrize(
    ("names", "host", "reason"),
    [
        (["other.test"], "agent.test", "Hostname mismatch"),
        (["agent.test"], "127.0.0.1", "IP address mismatch"),  # no IP in the certificate
    ],
)
async def test_https_refuses_a_certificate_for_another_name(
    tmp_path: Path, names: list[str], host: str, reason: str
) -> None:
    tls = make_tls(tmp_path, names)
    table = {"agent.test": ["127.0.0.1"]}
    async with RawServer(answer(b"{}"), tls=tls.server) as server:
        message = await refused(
            server.url(host=host, scheme="https"),
            tls_context=tls.client,
            resolver=resolver(table, []),
        )
        assert server.seen == []
    assert message.startswith("request failed: ConnectError: TLS: certificate verify failed")
    assert reason in message


async def test_https_with_the_default_trust_store_refuses_an_unknown_ca(tmp_path: Path) -> None:
    tls = make_tls(tmp_path, ["127.0.0.1"])
    async with RawServer(answer(b"{}"), tls=tls.server) as server:
        message = await refused(server.url(scheme="https"))
    assert "certificate verify failed" in message


async def test_headers_are_sent_and_trainyards_own_win() -> None:
    async with RawServer(answer(b"{}")) as server:
        await post(
            server.url(),
            headers={
                "Authorization": f"Bearer {SECRET}",
                "Content-Type": "text/evil",
                "Accept-Encoding": "br",
                "User-Agent": "mine",
                "X-Latin": "caf\u00e9",
            },
        )
    sent = server.seen[0].headers
    assert sent["authorization"] == f"Bearer {SECRET}"
    assert sent["content-type"] == "application/json"
    assert sent["accept-encoding"] == "gzip, deflate"
    assert sent["user-agent"] == "mine"
    assert sent["x-latin"] == "caf\u00e9"
    assert sent["content-length"] == "7" and server.seen[0].body == b'{"q":1}'


async def test_the_refused_error_is_an_egress_error() -> None:
    assert issubclass(EgressRefused, EgressError)
