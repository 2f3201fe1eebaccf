"""Errors that map to gRPC status codes, in one place.

Service logic raises these (plain Python, no gRPC imports); :func:`pdserve.grpcutil.rpc`
turns them into the matching status with the message intact.
"""

from __future__ import annotations

import grpc


class PdserveError(Exception):
    """Base class: an error with a gRPC status code and a message for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(PdserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PdserveError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(PdserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(PdserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PdserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PdserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for any exception raised by service logic."""
    if isinstance(exc, PdserveError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
