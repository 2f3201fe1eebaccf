"""Who is calling: the process's TLS identity and the identities of its peers.

Every pdserve process has at most one certificate, set once at start from its service
config's ``tls_*`` fields (:func:`configure`); :mod:`pdserve.grpcutil` then makes every gRPC
server and channel of the process mutual TLS, and the KV master's control wire wraps its
sockets the same way (:func:`server_context`, :func:`client_context`).

A certificate names its holder's identity (``pdserve certs`` makes them): the subject's
organizational unit (OU) is the **role**, the common name (CN) the **name** of the instance.
Roles: ``meta``, ``master``, ``node``, ``worker`` (prefill and decode), ``router``, ``admin``,
``gateway`` (a gateway in front of the router: services/router/gateway.py).
Services authorize on the role, and the KV master and meta also on the name (a node mounts
only segments of its own node id; a client commits, revokes, releases or removes only what
its own identity started, unless it is an admin).

Without TLS (the loopback default) there are no identities: every caller is ``None`` and
every check passes, as before. :func:`check_exposure` keeps that to loopback.

Renewal: certificates are short-lived (``pdserve up`` renews them in place, at half their
life). :func:`tls` looks at most every :data:`RELOAD_CHECK_S` whether the files changed and
then loads them again (the same identity only, the key matching the certificate; a torn or
foreign write keeps the current files). gRPC servers hand new handshakes the new certificate
(:func:`pdserve.grpcutil.start_server`), channels dial new connections with it
(:mod:`pdserve.reloading`), and the SSL contexts of the control wire and meta's HTTPS load it
(:func:`renewing`). Connections already up stay as they are: TLS checks a certificate's
dates only at the handshake.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import ssl
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.config_fields import ConfigError, help_field
from pdserve.errors import PermissionDenied, Unauthenticated
from pdserve.grpc_limits import GrpcLimitsConfig
from pdserve.tracing import TracingConfig

log = logging.getLogger(__name__)

ROLES = ("meta", "master", "node", "worker", "router", "admin", "gateway")
#: How often :func:`tls` looks whether the certificate files were renewed (seconds).
RELOAD_CHECK_S = 1.0


def role_name(role: str) -> str:
    """The DNS name every certificate of ``role`` carries (``pdserve certs``): a client that
    dials a master expects it (:func:`pdserve.grpcutil.channel` ``role``), so a server with
    any other certificate of the cluster (all are valid for localhost) is refused."""
    return f"{role}.role.pdserve"


@dataclass(frozen=True)
class Identity:
    """A peer, as its certificate names it."""

    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


@dataclass
class SecurityConfig(TracingConfig, GrpcLimitsConfig):
    """The fields every service config carries (a base class of each): TLS and exposure, and
    with :class:`~pdserve.tracing.TracingConfig` where its request traces go, with
    :class:`~pdserve.grpc_limits.GrpcLimitsConfig` its gRPC ports' connection limits."""

    tls_ca: str = help_field(
        "",
        "CA certificate (PEM) that signs every pdserve certificate; with tls_cert and "
        "tls_key, every gRPC link and the KV control wire is mutual TLS (empty = plaintext)",
    )
    tls_cert: str = help_field("", "this service's certificate (PEM), made by `pdserve certs`")
    tls_key: str = help_field("", "this service's private key (PEM)")
    insecure: bool = help_field(
        False,
        "allow binding a non-loopback address without TLS (or, for the router, without an "
        "API key): anyone who reaches the port can then read and write the KV cache",
    )
    advertise_host: str = help_field(
        "", "host name or address peers use to reach this service (empty = the bound host)"
    )


@dataclass(frozen=True)
class TlsFiles:
    """A process's CA, certificate and key, read once."""

    ca: bytes
    cert: bytes
    key: bytes
    paths: tuple[str, str, str]

    @classmethod
    def load(cls, ca: str, cert: str, key: str) -> TlsFiles | None:
        """The files named, or None when none is; a partial set or an unreadable file is a
        ConfigError naming it."""
        given = {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise ConfigError(f"TLS needs tls_ca, tls_cert and tls_key; missing {missing}")
        data = []
        for field, path in given.items():
            try:
                data.append(Path(path).expanduser().read_bytes())
            except OSError as exc:
                raise ConfigError(f"{field} {path!r}: {exc.strerror or exc}") from exc
        files = cls(*data, paths=(ca, cert, key))
        files.identity()  # a certificate without a pdserve identity fails now, not per call
        files.check_pair()
        return files

    def identity(self) -> Identity:
        return identity_of_pem(self.cert)

    def check_pair(self) -> None:
        """ConfigError unless the key is the certificate's (a renewal caught half-written)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            public = x509.load_pem_x509_certificate(self.cert).public_key()
            key = serialization.load_pem_private_key(self.key, password=None)
        except ValueError as exc:
            raise ConfigError(f"tls_cert/tls_key {self.paths[1:]}: {exc}") from exc
        raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(*raw) != public.public_bytes(*raw):
            raise ConfigError(f"tls_key {self.paths[2]!r} is not the key of {self.paths[1]!r}")


_tls: TlsFiles | None = None
_generation = 0  # +1 at each renewal :func:`tls` loads
_stamp: tuple | None = None  # the loaded files' (inode, size, mtime)
_checked = 0.0  # monotonic time of the last look at the files
_reload_lock = threading.Lock()
_contexts: weakref.WeakSet[ssl.SSLContext] = weakref.WeakSet()


def _set(files: TlsFiles | None) -> TlsFiles | None:
    global _tls, _stamp, _checked
    with _reload_lock:
        _tls, _checked = files, time.monotonic()
        _stamp = _file_stamp(files.paths) if files is not None else None
    return files


def _file_stamp(paths: tuple[str, str, str]) -> tuple | None:
    """The files' (inode, size, mtime); None when some cannot be read or there are none
    (files given in memory)."""
    if not all(paths):
        return None
    try:
        stats = [os.stat(Path(p).expanduser()) for p in paths]
    except OSError:
        return None
    return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)


def configure(cfg: SecurityConfig) -> TlsFiles | None:
    """Sets this process's TLS from its config (once, at start) and returns it."""
    return _set(TlsFiles.load(cfg.tls_ca, cfg.tls_cert, cfg.tls_key))


def configure_env() -> TlsFiles | None:
    """Sets this process's TLS from ``PDSERVE_TLS_CA``, ``PDSERVE_TLS_CERT`` and
    ``PDSERVE_TLS_KEY`` (the client commands' way; all empty = plaintext)."""
    env = os.environ.get
    return _set(
        TlsFiles.load(
            env("PDSERVE_TLS_CA", ""), env("PDSERVE_TLS_CERT", ""), env("PDSERVE_TLS_KEY", "")
        )
    )


def configure_files(files: TlsFiles | None) -> None:
    """Sets this process's TLS directly (tests, CLIs that load their own files)."""
    _set(files)


def tls() -> TlsFiles | None:
    """This process's TLS files (None = plaintext), the renewed ones once they are written."""
    files = _tls
    if files is None or time.monotonic() - _checked < RELOAD_CHECK_S:
        return files
    return _reload()


def generation() -> int:
    """How many renewals :func:`tls` has loaded: a client that made its connections with
    older files makes new ones (:mod:`pdserve.reloading`)."""
    tls()
    return _generation


def _reload() -> TlsFiles | None:
    global _tls, _stamp, _checked, _generation
    with _reload_lock:
        current, _checked = _tls, time.monotonic()
        if current is None:
            return None
        stamp = _file_stamp(current.paths)
        if stamp is None or stamp == _stamp:
            return current
        try:
            new = TlsFiles.load(*current.paths)
        except ConfigError as exc:  # caught mid-write: the next look tries again
            log.info("TLS files changed but do not load yet (%s); keeping the current ones", exc)
            return current
        _stamp = stamp
        if new.identity() != current.identity():
            log.error(
                "TLS: %s now holds %s's certificate; keeping %s's (an identity is fixed at start)",
                current.paths[1],
                new.identity(),
                current.identity(),
            )
            return current
        for ctx in list(_contexts):
            _load_into(ctx, new, add_ca=new.ca != current.ca)
        _tls, _generation = new, _generation + 1
    log.info("TLS: %s's certificate renewed (%s)", new.identity(), _validity(new.cert))
    return new


def _validity(pem: bytes) -> str:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    return f"valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC"


def renewing(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """Registers a server-side SSL context holding this process's certificate: a renewal
    :func:`tls` loads goes into it too (new handshakes present the new certificate)."""
    with _reload_lock:
        _contexts.add(ctx)
    return ctx


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("", 0.0.0.0) reaches other hosts


def check_exposure(cfg: SecurityConfig, service: str, *, has_key: bool | None = None) -> None:
    """Protected mode: refuses a non-loopback bind without protection unless ``insecure``.

    Protection is TLS for internal services; for the router (``has_key`` given) it is an
    API key on the public API."""
    host = getattr(cfg, "host", "127.0.0.1")
    if cfg.insecure or is_loopback(host):
        return
    if has_key is None:
        if _tls is not None:
            return
        why = "without TLS (tls_ca, tls_cert, tls_key: see `pdserve certs`)"
    else:
        if has_key:
            return
        why = "without an API key (api_key or api_key_file)"
    raise ConfigError(
        f"{service} would listen on {host!r}, reachable from other hosts, {why}: anyone who "
        "reaches it could read, overwrite or redirect the KV cache. Bind 127.0.0.1, turn the "
        "protection on, or pass --insecure to accept the risk"
    )


def advertised(cfg: SecurityConfig, port: int) -> str:
    """``host:port`` peers should dial: advertise_host, else the bound host (127.0.0.1 for
    a wildcard)."""
    host = cfg.advertise_host or getattr(cfg, "host", "127.0.0.1")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


@functools.lru_cache(maxsize=512)
def identity_of_pem(pem: bytes) -> Identity:
    from cryptography import x509

    return _identity(x509.load_pem_x509_certificate(pem).subject)


@functools.lru_cache(maxsize=512)
def identity_of_der(der: bytes) -> Identity:
    from cryptography import x509

    return _identity(x509.load_der_x509_certificate(der).subject)


def _identity(subject) -> Identity:
    from cryptography.x509.oid import NameOID

    def one(oid) -> str:
        attrs = subject.get_attributes_for_oid(oid)
        return str(attrs[0].value) if attrs else ""

    role, name = one(NameOID.ORGANIZATIONAL_UNIT_NAME), one(NameOID.COMMON_NAME)
    if role not in ROLES or not name:
        raise ConfigError(
            f"certificate subject {subject.rfc4514_string()!r} names no pdserve identity "
            f"(OU must be one of {', '.join(ROLES)}, CN the instance name)"
        )
    return Identity(role, name)


def grpc_caller(context) -> Identity | None:
    """The identity of a gRPC call's peer (None on a plaintext server)."""
    if _tls is None:
        return None
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        raise Unauthenticated("this service takes mutual TLS: present a pdserve certificate")
    try:
        return identity_of_pem(pems[0])
    except (ConfigError, ValueError) as exc:
        raise Unauthenticated(str(exc)) from exc


def socket_caller(sock: ssl.SSLSocket) -> Identity:
    """The identity of a TLS socket's verified peer."""
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise Unauthenticated("the control wire takes mutual TLS: present a certificate")
    try:
        return identity_of_der(der)
    except (ConfigError, ValueError) as exc:
        raise Unauthenticated(str(exc)) from exc


def require(caller: Identity | None, roles: tuple[str, ...], action: str) -> None:
    """PERMISSION_DENIED unless ``caller`` (None = no TLS: anyone) holds one of ``roles``."""
    if caller is not None and caller.role not in roles and caller.role != "admin":
        raise PermissionDenied(f"{caller} may not {action}: it takes the role {' or '.join(roles)}")


def _context(purpose: ssl.Purpose, files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose, cadata=files.ca.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_into(ctx, files)
    return ctx


def _load_into(ctx: ssl.SSLContext, files: TlsFiles, add_ca: bool = False) -> None:
    """Loads ``files``' certificate and key (and with ``add_ca`` its CA) into ``ctx``."""
    import tempfile

    if add_ca:
        ctx.load_verify_locations(cadata=files.ca.decode())
    # ssl loads a certificate chain from files only: the key goes through a private temp file
    with tempfile.TemporaryDirectory() as d:
        cert, key = Path(d, "cert.pem"), Path(d, "key.pem")
        cert.write_bytes(files.cert)
        key.touch(mode=0o600)
        key.write_bytes(files.key)
        ctx.load_cert_chain(cert, key)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """An SSL context for a server socket that requires a client certificate from the CA;
    it follows renewals (:func:`renewing`)."""
    return renewing(_context(ssl.Purpose.CLIENT_AUTH, files))


@functools.lru_cache(maxsize=4)
def client_context(files: TlsFiles) -> ssl.SSLContext:
    """An SSL context for a client socket that presents this process's certificate."""
    return _context(ssl.Purpose.SERVER_AUTH, files)


class RequireRole(grpc.aio.ServerInterceptor):
    """A gRPC server interceptor (pass it to :func:`pdserve.grpcutil.start_server`) that
    answers PERMISSION_DENIED, before the handler runs, to peers whose role is not one of
    ``roles`` (admin always passes). Plaintext servers and the health and reflection
    services are open."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, roles: tuple[str, ...], action: str) -> None:
        self.roles = roles
        self.action = action

    def _problem(self, context) -> tuple[grpc.StatusCode, str] | None:
        try:
            require(grpc_caller(context), self.roles, self.action)
        except (PermissionDenied, Unauthenticated) as exc:
            return exc.code, str(exc)
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _tls is None or handler_call_details.method.startswith(self.OPEN):
            return handler
        check = self._problem
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                problem = check(context)
                if problem:
                    await context.abort(*problem)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                problem = check(context)
                if problem:
                    await context.abort(*problem)
                async for item in inner_stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
