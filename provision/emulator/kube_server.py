"""The emulator's Kubernetes API server: HTTPS on 127.0.0.1 with its own CA (the endpoint and the certificate
GetCluster gives), each request answered by kube.handle in one transaction of the emulated world, and a
Service's proxy forwarded to a pod's local server.

Written by hand on the standard library's HTTP server because no library serves the Kubernetes
API from Python; the subset is small and its answers follow the API's conventions (Status
objects, label and field selectors, list kinds).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from provision.emulator import kube, kube_objects
from provision.emulator.gke_world import GkeWorld
from provision.emulator.kube import WorldCall
from provision.emulator.kube_base import KubeError


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that went away before its answer (it timed out, or was killed) is not the server's error:
        the answer is dropped, as an API server does, without a traceback."""
        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLEOFError, TimeoutError)):
            return
        super().handle_error(request, client_address)


class KubeServer:
    """The HTTPS server, started on 127.0.0.1 on a free port; its CA certificate for clients."""

    def __init__(self, world_call: WorldCall) -> None:
        self.ca_pem, cert_pem, key_pem = _certificates()
        self._dir = tempfile.TemporaryDirectory(prefix="moe-tpu-kube-")
        cert, key = Path(self._dir.name) / "server.pem", Path(self._dir.name) / "server.key"
        cert.write_bytes(cert_pem)
        key.write_bytes(key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server = _Server(("127.0.0.1", 0), _handler(world_call))
        # The TLS handshake happens on a connection's first read, in its own thread: done in accept(), a
        # client that connects and sends nothing would stop the server taking any other connection.
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                  do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="emulator-kube", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._dir.cleanup()


class _Handler(BaseHTTPRequestHandler):
    """One request to the API server, answered by kube.handle in one transaction of `world_call` (or, for a
    Service's proxy, forwarded to a pod's local server); `world_call` is set by _handler."""

    protocol_version = "HTTP/1.1"
    # An answer's headers and body leave in two writes: with Nagle's algorithm the body waited for the
    # client's delayed acknowledgement of the headers, some 40 ms on every request.
    disable_nagle_algorithm = True
    world_call: WorldCall

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass

    def _serve(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if match := kube_objects.PROXY.match(url.path):
            return self._proxy(method, match, url.query, raw)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(400, KubeError(400, "BadRequest", "the body is not JSON").status())
        try:
            code, answer = self.world_call(
                lambda world, now: kube.handle(GkeWorld.of(world), now, method, url.path, query, body))
        except KubeError as error:
            return self._send(error.code, error.status())
        self._send(code, answer)

    def _proxy(self, method: str, match, query: str, raw: bytes) -> None:
        """The Service's proxy: the request forwarded to a Ready pod's local server (outside the world's
        transaction: a completion takes seconds), its answer streamed back as it comes."""
        namespace, service, path = match.group(1), match.group(2), match.group(3) or "/"
        try:
            servers, key = self.world_call(lambda world, now: (
                GkeWorld.of(world).servers, kube_objects.proxy_target(GkeWorld.of(world), now, namespace, service)))
            if servers is None:
                raise KubeError(503, "ServiceUnavailable", "error trying to reach service: this emulator runs "
                                                           "no server (a dry run's does)")
            try:
                stream = bool(json.loads(raw).get("stream")) if raw else False
            except (ValueError, AttributeError):
                stream = False
            try:
                code, kind, body = servers.forward(key, method, path + (f"?{query}" if query else ""), raw,
                                                   stream)
            except OSError as exc:
                raise KubeError(503, "ServiceUnavailable", f"error trying to reach service: {exc}") from None
        except KubeError as error:
            return self._send(error.code, error.status())
        self.send_response(code)
        self.send_header("Content-Type", kind)
        if isinstance(body, bytes):
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in body:
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _send(self, code: int, answer: Any) -> None:
        if isinstance(answer, str):
            data, kind = answer.encode(), "text/plain; charset=utf-8"
        elif isinstance(answer, list):  # a watch: one event per line
            data, kind = "".join(json.dumps(e) + "\n" for e in answer).encode(), "application/json"
        else:
            data, kind = json.dumps(answer).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's names
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._serve("PATCH")





def _handler(world_call: WorldCall) -> type[_Handler]:
    """The request handler class of a server on `world_call` (the standard library's server takes a class)."""
    return type("Handler", (_Handler,), {"world_call": staticmethod(world_call)})


def _certificates() -> tuple[bytes, bytes, bytes]:
    """A CA and a server certificate for 127.0.0.1 signed by it, as a cluster's control plane has:
    (CA PEM, server certificate PEM, server key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moe-tpu emulator cluster CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ca.public_bytes(pem), cert.public_bytes(pem), key_pem
