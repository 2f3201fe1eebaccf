"""Errors that map to gRPC status codes, in one place.

Service logic raises these (plain Python, no gRPC imports); :func:`pdserve.grpcutil.rpc`
turns them into the matching status with the message intact. Only these are the caller's
fault: any other exception is a bug (or a failed dependency) and becomes INTERNAL, so that it
is logged and counts against the server (the router's circuit breaker), never against the
client.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import grpc


def did_you_mean(name: object, known: Iterable[object]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``known`` to ``name``, or ``""``: the hint
    of every "unknown key / field / setting" message."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class PdserveError(Exception):
    """Base class: an error with a gRPC status code and a message for the caller.

    ``param`` optionally names the request field at fault (``"top_p"``, ``"messages[0].role"``);
    the OpenAI front end reports it as the error's ``param``."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidArgument(PdserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PdserveError):
    code = grpc.StatusCode.NOT_FOUND


class ModelNotFound(NotFound):
    """The request names a model this cluster (or worker) does not serve."""


class AlreadyExists(PdserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(PdserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PdserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RateLimited(ResourceExhausted):
    """RESOURCE_EXHAUSTED that says when a retry can pass: ``retry_after_s`` (seconds). The
    router's OpenAI API sends it as ``Retry-After`` and its gRPC API as the trailing metadata
    ``retry-after`` (:attr:`retry_after`: whole seconds, rounded up, at least 1); ``limit``
    names the limit that refused (for metrics)."""

    def __init__(self, message: str, *, retry_after_s: float, limit: str = "") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class PermissionDenied(PdserveError):
    """The caller is known, but its identity may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(PdserveError):
    """The caller presented no identity (certificate or API key) the service accepts."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PdserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(PdserveError):
    """The service cannot do this kind of request (a capability it lacks, not the caller's
    fault): e.g. a decode engine that cannot wait for write-mode chunks. Not in
    :func:`from_status`: to a client, a peer's UNIMPLEMENTED is the peer failing
    (:class:`Unavailable`); the router reads the status itself where it has a fallback."""

    code = grpc.StatusCode.UNIMPLEMENTED


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for any exception raised by service logic: a :class:`PdserveError`'s
    own code, DEADLINE_EXCEEDED for a timeout, INTERNAL for anything else (a ``ValueError``
    too: input checks raise :class:`InvalidArgument`, so any other one is a bug)."""
    if isinstance(exc, PdserveError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


#: gRPC status -> the error class that carries it (the inverse of ``code``).
_BY_STATUS: dict[grpc.StatusCode, type[PdserveError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
    )
}


def from_status(code: grpc.StatusCode, message: str) -> PdserveError:
    """The error a client raises for a peer's gRPC status ``code``: the class that carries
    it, or :class:`Unavailable` for any other code (the peer failed, not the caller)."""
    return _BY_STATUS.get(code, Unavailable)(message)
