"""One metrics registry and one structured logger per process.

The request id travels in a context variable and appears on every log line, so one grep
follows a request across services. The router takes it from the request (``request_id``),
else from the caller's :data:`REQUEST_ID_HEADER` (HTTP header or gRPC metadata), else makes
one, echoes it back under the same header, and passes it to the workers in their request
messages; each service sets the variable from the message it handles.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from prometheus_client import CollectorRegistry, start_http_server

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
#: HTTP header / gRPC metadata key carrying a caller's request id (lowercase, as gRPC needs).
REQUEST_ID_HEADER = "x-request-id"

#: The process-wide registry every service's metrics live in; served at /metrics.
REGISTRY = CollectorRegistry(auto_describe=True)


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(service: str, level: str = "info", *, json_lines: bool = True) -> None:
    """Configures the root logger once for ``service`` (JSON lines on stderr by default)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(_JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serves :data:`REGISTRY` at http://host:port/metrics (port 0 = a free port); returns the
    port, or 0 when ``port`` is negative (metrics disabled)."""
    if port < 0:
        return 0
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_port


def now_ms() -> float:
    return time.time() * 1000.0
