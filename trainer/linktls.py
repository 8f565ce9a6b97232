"""TLS on a run's links, keyed by the run's secret (docs/architecture.md, "Encrypted links").

Every rank of a run holds the same secret (the control plane derives one per run and attempt;
the agent hands it over in an owner-only file). From it each rank derives the same Ed25519 key
and the same self-signed certificate, and trusts only that certificate. A connection is mutual
TLS 1.3: both ends prove they hold the run's key, so the secret protects the rendezvous (a
process without it is refused at the handshake) and encrypts and authenticates every frame.
This is a pre-shared key carried in certificates because Python's ssl module offers TLS-PSK
only from 3.13; ECDHE still gives each connection its own keys.

Within one site the connecting end may ask for plain TCP instead: both ends then prove they
hold the secret (HMAC over fresh nonces, both ways) and the frames go unencrypted, as on any
LAN job runner; only links between sites must carry TLS, and TLS costs CPU (BENCHMARKS.md,
"Encrypted links"). The rendezvous is protected either way.

One connection is read by one thread while another writes to it (trainer.sockets), and an
OpenSSL connection must not be used by two threads at once. So the TLS state runs over memory
buffers under a lock held only while records are sealed or opened, never while the socket
blocks: reading and writing stay full-duplex.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket
import ssl
import tempfile
import threading
from pathlib import Path

__all__ = ["LinkTls", "TlsSocket", "run_identity"]

# Plaintext sealed per lock hold: large enough to amortise the call, small enough that the
# reading thread never waits long for the lock.
_SEAL_CHUNK = 256 << 10
_RECV_CHUNK = 256 << 10
# Fixed so that every rank builds a byte-identical certificate from the same key.
_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.timezone.utc)


def run_identity(secret: str) -> tuple[bytes, bytes]:
    """The run's certificate and private key (PEM), the same on every rank for one secret."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.x509.oid import NameOID

    seed = hmac.new(secret.encode(), b"hybridtrain link key", hashlib.sha256).digest()
    key = Ed25519PrivateKey.from_private_bytes(seed)
    public = key.public_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hybridtrain run")])
    serial = int.from_bytes(hashlib.sha256(b"serial" + seed).digest()[:16], "big") >> 1
    ski = x509.SubjectKeyIdentifier.from_public_key(public)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(serial)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        # Ed25519 signatures are deterministic: the same key signs the same certificate.
        .sign(key, algorithm=None)
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _context(server_side: bool, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # load_cert_chain reads files only: the key exists on disk, owner-only, for this call.
    with tempfile.TemporaryDirectory(prefix="hybridtrain-tls-") as tmp:
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(cert_pem)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key_pem)
        ctx.load_cert_chain(cert_path, key_path)
    ctx.load_verify_locations(cadata=cert_pem.decode())
    # Peers are named by address, and they are who they are by holding the run's key.
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    if server_side:
        # No session tickets: after the handshake a read never has to write (see TlsSocket).
        ctx.num_tickets = 0
    return ctx


class TlsSocket:
    """A connected TCP socket carried over TLS; one thread may read while another writes."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, *, server_side: bool) -> None:
        self.raw = raw
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        # _state guards the TLS object; _order keeps sealed records in order on the wire.
        self._state = threading.Lock()
        self._order = threading.Lock()
        self._handshake()

    def _handshake(self) -> None:
        while True:
            try:
                with self._state:
                    self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = self.raw.recv(_RECV_CHUNK)
                if not data:
                    raise ConnectionResetError("the peer closed the connection during the TLS handshake") from None
                with self._state:
                    self._incoming.write(data)
            except ssl.SSLError:
                # Send our alert, so the peer learns why, before the caller closes.
                self._flush()
                raise
        self._flush()

    def _flush(self) -> None:
        with self._order:
            with self._state:
                data = self._outgoing.read()
            if data:
                self.raw.sendall(data)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Seal `data` into TLS records and write them all."""
        view = memoryview(data).cast("B")
        with self._order:
            for at in range(0, len(view), _SEAL_CHUNK):
                with self._state:
                    self._tls.write(view[at:at + _SEAL_CHUNK])
                    sealed = self._outgoing.read()
                self.raw.sendall(sealed)

    def recv_into(self, buffer: bytearray | memoryview, nbytes: int = 0) -> int:
        """Up to `nbytes` bytes of plaintext into `buffer`; 0 once the peer has closed."""
        view = memoryview(buffer).cast("B")
        n = nbytes or len(view)
        while True:
            with self._state:
                try:
                    return self._tls.read(n, view)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
            data = self.raw.recv(_RECV_CHUNK)
            if not data:
                return 0
            with self._state:
                self._incoming.write(data)

    def settimeout(self, value: float | None) -> None:
        self.raw.settimeout(value)

    def getsockopt(self, *args: int) -> int | bytes:
        return self.raw.getsockopt(*args)

    def setsockopt(self, *args: int) -> None:
        self.raw.setsockopt(*args)

    def fileno(self) -> int:
        return self.raw.fileno()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()


class LinkTls:
    """A run's link security, built once per process from its secret: TLS for links between
    sites; within a site, where the traffic stays on the site's own network, plain TCP that
    each end enters only once the other has proved it holds the secret (`connect`, `accept`)."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a run's link secret must not be empty")
        cert_pem, key_pem = run_identity(secret)
        self._proof_key = hmac.new(secret.encode(), b"hybridtrain link proof", hashlib.sha256).digest()
        self._server = _context(True, cert_pem, key_pem)
        self._client = _context(False, cert_pem, key_pem)

    @classmethod
    def given(cls, secret: str | None) -> LinkTls | None:
        """The run's TLS where it has a link secret; None (plain TCP) where it has none."""
        return cls(secret) if secret else None

    def wrap(self, sock: socket.socket, *, server_side: bool) -> TlsSocket:
        """`sock` after a mutual handshake; ssl.SSLError when the peer holds another key."""
        return TlsSocket(sock, self._server if server_side else self._client, server_side=server_side)

    def connect(self, sock: socket.socket, *, encrypt: bool) -> socket.socket | TlsSocket:
        """The connecting end: say which mode, then TLS (`encrypt`) or the secret's proof alone."""
        sock.sendall(_ENCRYPTED if encrypt else _AUTHENTICATED)
        if encrypt:
            return self.wrap(sock, server_side=False)
        self._prove(sock, initiator=True)
        return sock

    def accept(self, sock: socket.socket) -> socket.socket | TlsSocket:
        """The listening end: whichever mode the peer asked for, once it proved the secret."""
        mode = _recv_exact(sock, 1)
        if mode == _ENCRYPTED:
            return self.wrap(sock, server_side=True)
        if mode != _AUTHENTICATED:
            raise ssl.SSLError(f"not a hybridtrain peer (mode byte {mode!r})")
        self._prove(sock, initiator=False)
        return sock

    def _prove(self, sock: socket.socket, *, initiator: bool) -> None:
        # Challenge and response both ways: each end shows it holds the secret without sending
        # it, over fresh nonces, so a recorded exchange proves nothing later.
        mine = os.urandom(_NONCE)
        if initiator:
            theirs = _recv_exact(sock, _NONCE)
            sock.sendall(mine)
            # The listener proves itself first: a rank holding another run's secret learns so
            # at once, instead of retrying a connection that will never be accepted.
            if not hmac.compare_digest(_recv_exact(sock, _MAC), self._mac(b"listener", mine, theirs)):
                raise ssl.SSLError("the peer does not hold this run's link secret")
            sock.sendall(self._mac(b"initiator", theirs, mine))
        else:
            sock.sendall(mine)
            theirs = _recv_exact(sock, _NONCE)
            sock.sendall(self._mac(b"listener", theirs, mine))
            if not hmac.compare_digest(_recv_exact(sock, _MAC), self._mac(b"initiator", mine, theirs)):
                raise ssl.SSLError("the peer does not hold this run's link secret")

    def _mac(self, role: bytes, *nonces: bytes) -> bytes:
        return hmac.new(self._proof_key, role + b"".join(nonces), hashlib.sha256).digest()


_ENCRYPTED, _AUTHENTICATED = b"T", b"A"
_NONCE, _MAC = 32, 32


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection during the handshake")
        data += chunk
    return data
