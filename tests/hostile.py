"""Services that misbehave on purpose, on loopback: a raw HTTP/1.1 server that answers with
bytes no well-behaved framework would send (bombs, drips, broken framing, redirects), over
plain TCP or TLS, and the TLS material for it."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import struct
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class Seen:
    """One request the server read: its request line, headers (lower-case names) and body."""

    line: str
    headers: dict[str, str]
    body: bytes


Respond = Callable[[Seen, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawServer:
    """`respond` writes whatever it likes for each request; the connection then closes.
    `seen` holds every request read; `sni` every TLS server name a client sent."""

    respond: Respond
    tls: ssl.SSLContext | None = None
    host: str = "127.0.0.1"
    seen: list[Seen] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)
    connections: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def __aenter__(self) -> RawServer:
        if self.tls is not None:
            self.tls.sni_callback = lambda _obj, name, _ctx: self.sni.append(name)  # type: ignore[assignment, misc]
        self.server = await asyncio.start_server(self._handle, self.host, 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.handlers:  # a drip or a sleeper still at it: stop it now
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        await asyncio.wait_for(self.server.wait_closed(), 5)

    def url(self, path: str = "/", *, host: str | None = None, scheme: str = "http") -> str:
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            line, *rest = head.decode("latin-1").split("\r\n")
            headers = {}
            for item in rest:
                if ":" in item:
                    name, value = item.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            seen = Seen(line, headers, body)
            self.seen.append(seen)
            await self.respond(seen, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError):
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


def head(status: int = 200, *headers: tuple[str, str], reason: str = "X") -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def answer(body: bytes, status: int = 200, *headers: tuple[str, str]) -> Respond:
    """A complete answer with a Content-Length."""

    async def respond(_seen: Seen, writer: asyncio.StreamWriter) -> None:
        writer.write(head(status, ("content-length", str(len(body))), *headers) + body)

    return respond


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A valid gzip stream of `inflated` zero bytes, about a thousandth of that on the wire
    (1 GiB: ~1 MiB). Built in a fifth of a second: one fully flushed block, repeated."""
    chunk = 1 << 20
    assert inflated % chunk == 0
    zeros = bytes(chunk)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    tail = deflate.flush(zlib.Z_FINISH)
    crc = 0
    for _ in range(inflated // chunk):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    return header + block * (inflated // chunk) + tail + struct.pack("<II", crc, inflated % 2**32)


def zlib_bomb(inflated: int = 1 << 30, *, raw: bool = False) -> bytes:
    """`deflate` as RFC 9110 means it (zlib-wrapped), or raw deflate as some servers send;
    its trailing checksum covers only the first two blocks (a reader that stops at its
    limit never gets there)."""
    chunk = 1 << 20
    zeros = bytes(chunk)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS if raw else zlib.MAX_WBITS)
    first = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    rest = block * (inflated // chunk - 1)
    return first + rest + deflate.flush(zlib.Z_FINISH)


@dataclass(frozen=True)
class Tls:
    server: ssl.SSLContext
    client: ssl.SSLContext  # trusts the test CA only


def make_tls(tmp: Path, names: list[str]) -> Tls:
    """A throwaway CA and a server certificate for `names` (DNS names, or IP addresses)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainyard test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.OID_SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = tmp / "server.pem", tmp / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return Tls(server, client)
