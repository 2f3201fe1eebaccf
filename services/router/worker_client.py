"""How the orchestrator calls a worker: the interface (the gRPC implementation is in
``grpc_worker_client.py``; tests drive the orchestrator with an in-process one)."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

import grpc

from pdserve.services.router.workers import Worker
from pdserve.v1 import engine_pb2


class WorkerCallError(Exception):
    """A worker call failed with ``code`` (a gRPC status code, the vocabulary of
    :mod:`pdserve.errors`) and the worker's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name} {details}")
        self.code = code
        self.details = details


class DecodeCall(abc.ABC):
    """One running Decode stream: iterate it for the worker's messages in order."""

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[engine_pb2.DecodeResponse]:
        """Called once. The iterator raises :class:`WorkerCallError` when the worker fails,
        also CANCELLED after :meth:`cancel` (a consumer cancelled itself gets CancelledError)."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ends the call and frees the worker's slot. May be called from a callback, at any
        time, repeatedly; a no-op once the stream ended."""


class WorkerClient(abc.ABC):
    """Calls to prefill and decode workers. Implementations hold no routing state: the
    orchestrator does the choosing and the accounting on :class:`Worker`."""

    @abc.abstractmethod
    async def prefill(
        self, worker: Worker, request: engine_pb2.PrefillRequest, timeout: float | None
    ) -> engine_pb2.PrefillResponse:
        """Runs ``request`` on ``worker`` within ``timeout`` seconds (None = no limit).
        Raises :class:`WorkerCallError`; cancelling the awaiting task cancels the call."""

    @abc.abstractmethod
    def decode(
        self, worker: Worker, request: engine_pb2.DecodeRequest, timeout: float | None
    ) -> DecodeCall:
        """Starts ``request`` on ``worker`` (the whole stream within ``timeout`` seconds);
        never blocks and never raises: failures surface while iterating the call."""
