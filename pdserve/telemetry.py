"""One metrics registry and one structured logger per process.

The registry is served at ``/metrics`` on the service's metrics port (:func:`serve_metrics`).
Protected mode, as :func:`pdserve.identity.check_exposure` for the gRPC ports: a metrics port
that listens beyond loopback on a cluster with TLS needs a key (``metrics_key``: scrapers send
``Authorization: Bearer <key>``), or an explicit ``metrics_open``; otherwise the service
refuses to start (:func:`configure_metrics`). The figures carry no request data, but they tell
anyone who reaches the port the cluster's load, cache contents' size and traffic.

The request id travels in a context variable and appears on every log line, so one grep
follows a request across services. The router takes it from the request (``request_id``),
else from the caller's :data:`REQUEST_ID_HEADER` (HTTP header or gRPC metadata), else makes
one, echoes it back under the same header, and passes it to the workers in their request
messages; each service sets the variable from the message it handles.
"""

from __future__ import annotations

import contextvars
import hmac
import itertools
import json
import logging
import resource
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdserve.config_fields import ConfigError, help_field

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
#: HTTP header / gRPC metadata key carrying a caller's request id (lowercase, as gRPC needs).
REQUEST_ID_HEADER = "x-request-id"

#: The process-wide registry every service's metrics live in; served at /metrics.
REGISTRY = CollectorRegistry(auto_describe=True)


class _VllmMetrics:
    """vLLM's own metrics (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, its
    latency histograms, ...), which vLLM's Prometheus stat logger keeps in prometheus_client's
    default registry of a worker on the vLLM engine: served beside pdserve's, under their own
    names, so vLLM's dashboards, KEDA/HPA rules and llm-d's scorers see a pdserve worker as
    they see ``vllm serve`` (none in a process without a vLLM engine)."""

    def collect(self) -> Any:
        from prometheus_client import REGISTRY as vllm_registry

        for family in vllm_registry.collect():
            if family.name.startswith("vllm:"):
                yield family

    def describe(self) -> list[Any]:
        return []  # the families appear once an engine starts


REGISTRY.register(_VllmMetrics())


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


def init_labels(metric: Any, *values: Sequence[str]) -> Any:
    """Creates ``metric``'s child for every combination of the label ``values`` (one sequence
    per label), so a fresh scrape shows each at 0: dashboards and ``rate()`` see the series
    before its first event. ``metric`` may be :class:`Relayed`. Returns ``metric``."""
    target = metric.metric if isinstance(metric, Relayed) else metric
    for combo in itertools.product(*values):
        target.labels(*combo)
    return metric


@dataclass
class MetricsConfig:
    """The fields of every service config with a ``metrics_port`` (a base class of each):
    who may read its ``/metrics``."""

    metrics_key: str = help_field(
        "",
        "key that GET /metrics must carry as 'Authorization: Bearer <key>' (Prometheus: "
        "authorization: {credentials_file: FILE}); empty = open. Needed when the metrics port "
        "listens beyond loopback with TLS on, unless metrics_open; prefer metrics_key_file",
    )
    metrics_key_file: str = help_field("", "file whose first line is metrics_key")
    metrics_open: bool = help_field(
        False,
        "serve /metrics without a key on a non-loopback address although TLS is on: anyone "
        "who reaches the port reads the service's load and traffic figures",
    )


#: The key this process's /metrics takes ("" = open), set once at start (configure_metrics).
_metrics_key = ""


def configure_metrics(cfg: object, service: str) -> None:
    """Sets this process's metrics key from ``cfg`` (a :class:`MetricsConfig`; anything else
    is left alone) and applies protected mode to its metrics port. Call after
    :func:`pdserve.identity.configure`: TLS on makes a metrics port beyond loopback need the
    key. Raises ConfigError with the reason and the ways out."""
    global _metrics_key
    if not isinstance(cfg, MetricsConfig):
        return
    from pdserve import identity
    from pdserve.auth import load_key

    _metrics_key = load_key(cfg.metrics_key, cfg.metrics_key_file, name="metrics_key")
    host = getattr(cfg, "host", "127.0.0.1")
    if (
        getattr(cfg, "metrics_port", -1) < 0
        or _metrics_key
        or cfg.metrics_open
        or identity.is_loopback(host)  # the rule check_exposure keeps for gRPC ports
        or (identity.tls() is None and getattr(cfg, "insecure", False))
    ):
        return
    raise ConfigError(
        f"{service}'s metrics port would listen on {host!r}, reachable from other hosts, "
        "without a metrics key (metrics_key or metrics_key_file; Prometheus sends it with "
        "authorization: {credentials_file: FILE}): anyone who reaches it could read the "
        "service's load and traffic. Bind 127.0.0.1, set the key, turn the port off "
        "(--metrics-port -1), or pass --metrics-open to accept the risk"
    )


def _key_problem(header: str | None, key: str) -> str:
    """Why an ``Authorization`` value does not carry the metrics ``key`` ("" = it does);
    compared in constant time."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return "missing metrics key: send 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        return "invalid metrics key"
    return ""


#: Seconds a metrics connection may go without sending its request's next bytes (a scraper
#: sends its request at once); then it is closed. Without it an idle connection held its
#: thread and descriptor until the client left.
METRICS_IDLE_TIMEOUT_S = 10.0
#: Connections a metrics port serves at once (a thread each), from all addresses together (at
#: most an eighth of the file-descriptor limit) and from one address; a further one is closed
#: at once, unread. A scraper holds one.
METRICS_MAX_CONNECTIONS = 1024
METRICS_MAX_CONNECTIONS_PER_PEER = 4


def metrics_connection_cap() -> int:
    """:data:`METRICS_MAX_CONNECTIONS`, at most an eighth of the file-descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return METRICS_MAX_CONNECTIONS
    return max(1, min(METRICS_MAX_CONNECTIONS, soft // 8))


def serve_metrics(port: int, host: str = "127.0.0.1", *, key: str | None = None) -> int:
    """Serves :data:`REGISTRY` at http://host:port/metrics (port 0 = a free port); returns the
    port, or 0 when ``port`` is negative (metrics disabled). With ``key`` (default: the
    process's, :func:`configure_metrics`) a request without ``Authorization: Bearer <key>``
    gets 401. A connection is closed when it sends nothing for :data:`METRICS_IDLE_TIMEOUT_S`,
    and at most :data:`METRICS_MAX_CONNECTIONS` are served at once,
    :data:`METRICS_MAX_CONNECTIONS_PER_PEER` from one address."""
    if port < 0:
        return 0
    from wsgiref.simple_server import make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

    key = _metrics_key if key is None else key
    metrics = make_wsgi_app(REGISTRY)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        why = _key_problem(environ.get("HTTP_AUTHORIZATION"), key) if key else ""
        if not why:
            return metrics(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="pdserve-metrics"'),
            ],
        )
        return [f"{why} (the service's metrics_key)\n".encode()]

    class Handler(_SilentHandler):
        timeout = METRICS_IDLE_TIMEOUT_S  # each read and write on the connection

    class Server(ThreadingWSGIServer):
        request_queue_size = 128  # socketserver's 5 dropped SYNs under a burst
        cap = metrics_connection_cap()
        peer_cap = METRICS_MAX_CONNECTIONS_PER_PEER
        active = 0
        peers: dict[str, int] = {}
        lock = threading.Lock()

        def process_request(self, request: Any, client_address: Any) -> None:
            peer = client_address[0]
            with self.lock:
                n = self.peers.get(peer, 0)
                full = self.active >= self.cap or n >= self.peer_cap
                if not full:
                    self.active += 1
                    self.peers[peer] = n + 1
            if full:
                self.shutdown_request(request)
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                with self.lock:
                    self.active -= 1
                    n = self.peers.pop(client_address[0]) - 1
                    if n:
                        self.peers[client_address[0]] = n

        def handle_error(self, request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], OSError):  # timed out, or the client went away
                return
            super().handle_error(request, client_address)

    Server.address_family, addr = _get_best_family(host, port)
    httpd = make_server(addr, port, app, Server, handler_class=Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd.server_port


def now_ms() -> float:
    return time.time() * 1000.0


# --- metrics relay -----------------------------------------------------------------------
# A process whose registry no /metrics serves (vLLM's engine core, where the vLLM engine's KV
# connector and its store client run) turns the relay on (start_relay): every update of a
# Relayed metric is then also kept, the connector hands the batch to vLLM as its KV connector
# stats (drain_relay), vLLM carries them to the worker's process with its scheduler stats, and
# the engine's stat logger applies them there (replay).

#: Updates kept at most between two drains (vLLM drains every engine step); past it the
#: oldest are dropped.
RELAY_MAX = 10_000
_relay: list[list[Any]] | None = None
_relay_lock = threading.Lock()
_relay_dropped = 0
#: Every Relayed metric by name.
_RELAYED: dict[str, Relayed] = {}


class Relayed:
    """A Counter or Histogram whose updates are also kept while the relay is on, known to
    :func:`replay` by ``name``. Used like the metric itself: ``.labels(*values).inc(n)`` /
    ``.observe(v)``, or ``.inc(n)``."""

    def __init__(self, name: str, metric: Counter | Histogram) -> None:
        if name in _RELAYED:
            raise ValueError(f"a relayed metric named {name!r} exists already")
        self.name = name
        self.metric = metric
        #: The child of each label tuple used so far (prometheus_client's ``labels`` takes a
        #: lock and checks the values on every call: a store get updates two metrics).
        self._children: dict[tuple[str, ...], _RelayedChild] = {}
        _RELAYED[name] = self

    def labels(self, *values: str) -> _RelayedChild:
        child = self._children.get(values)
        if child is None:
            child = _RelayedChild(self, values)
            self._children = {**self._children, values: child}  # readers never see it change
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)


class _RelayedChild:
    __slots__ = ("metric", "parent", "values")

    def __init__(self, parent: Relayed, values: tuple[str, ...]) -> None:
        self.parent = parent
        self.values = values
        self.metric = parent.metric.labels(*values) if values else parent.metric

    def inc(self, amount: float = 1.0) -> None:
        self._apply("inc", amount)

    def observe(self, value: float) -> None:
        self._apply("observe", value)

    def _apply(self, kind: str, value: float) -> None:
        global _relay_dropped
        getattr(self.metric, kind)(value)
        if _relay is None:
            return
        with _relay_lock:
            _relay.append([self.parent.name, list(self.values), kind, value])
            if len(_relay) > RELAY_MAX:
                del _relay[0]
                _relay_dropped += 1
                if _relay_dropped in (1, 1000) or _relay_dropped % 100_000 == 0:
                    logging.getLogger(__name__).warning(
                        "metrics relay: %d updates dropped (not drained)", _relay_dropped
                    )


def _update(metric: Counter | Histogram, values: Any, kind: str, value: float) -> None:
    getattr(metric.labels(*values) if values else metric, kind)(value)


def start_relay() -> None:
    """Keeps every update of a :class:`Relayed` metric from now on (idempotent)."""
    global _relay
    with _relay_lock:
        if _relay is None:
            _relay = []


def stop_relay() -> None:
    global _relay
    with _relay_lock:
        _relay = None


def drain_relay() -> list[list[Any]]:
    """The updates kept since the last drain, oldest first: ``[name, [label values], "inc" |
    "observe", value]`` each (plain lists: they travel in vLLM's msgpack messages)."""
    global _relay
    with _relay_lock:
        if not _relay:
            return []
        out, _relay = _relay, []
    return out


def replay(updates: list[Any]) -> int:
    """Applies updates from :func:`drain_relay` of another process to this process's metrics
    (not relayed again); returns how many applied. Unknown names or kinds are skipped."""
    done = 0
    for item in updates:
        try:
            name, values, kind, value = item
            metric = _RELAYED[name].metric
            if kind not in ("inc", "observe"):
                continue
            _update(metric, tuple(values), kind, float(value))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        done += 1
    return done
