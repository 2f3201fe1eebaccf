"""The one way a service becomes a ``pdserve`` command: flags from its config dataclass,
config errors as a clean message (exit 2), the process's TLS identity and the protected-mode
checks (:mod:`pdserve.identity` for its ports, ``telemetry.configure_metrics`` for its
metrics port), its gRPC ports' connection limits and file-descriptor limit
(:mod:`pdserve.grpc_limits`), structured logging, tracing (:mod:`pdserve.tracing`), and the
service's ``serve(cfg, stop)`` run under :func:`pdserve.lifecycle.run` (SIGTERM/SIGINT drain)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve import config, errors, identity


def add_service_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    *,
    config_cls: type,
    section: str,
    serve: str,
    help: str,
    description: str,
    service: str | None = None,
) -> argparse.ArgumentParser:
    """Registers ``name``. ``serve`` is ``"module:function"``, imported only when the command
    runs so that ``pdserve --help`` stays light; ``service`` names it in logs (default
    ``name``)."""
    parser = subparsers.add_parser(name, help=help, description=description)
    config.add_arguments(parser, config_cls)
    label = service or name

    def run(args: argparse.Namespace) -> int:
        from pdserve import grpc_limits, lifecycle, telemetry, tracing

        try:
            cfg = config.from_args(config_cls, section, args)
            identity.configure(cfg)
            grpc_limits.configure(cfg)
            keys = ("api_key", "api_key_file", "tenant_keys_file")
            has_key = any(getattr(cfg, k, "") for k in keys) if hasattr(cfg, "api_key") else None
            identity.check_exposure(cfg, f"pdserve {label}", has_key=has_key)
            telemetry.configure_metrics(cfg, f"pdserve {label}")
            endpoint = tracing.resolve_endpoint(getattr(cfg, "otlp_traces_endpoint", ""))
            tracing.configure(endpoint, tracing.service_name(label))
        except config.ConfigError as exc:
            print(f"pdserve {label}: {exc}", file=sys.stderr)
            return 2
        module, _, func = serve.partition(":")
        serve_fn = getattr(importlib.import_module(module), func)
        telemetry.setup_logging(label, cfg.log_level)
        try:
            return lifecycle.run(lambda stop: serve_fn(cfg, stop))
        except errors.PdserveError as exc:  # a clear start-up refusal, not a crash
            print(f"pdserve {label}: error: {exc}", file=sys.stderr)
            return 1
        finally:
            tracing.shutdown()  # exports the spans still buffered

    parser.set_defaults(func=run)
    return parser
