"""``remote_url: pdserve://HOST:PORT`` inside LMCache itself: an LMCache ``ConnectorAdapter``
for the ``pdserve://`` scheme, and its registration where LMCache finds its own adapters.

LMCache 0.5.6 builds a connector for ``remote_url`` by asking every adapter it knows whether it
can parse the URL. It knows two kinds: its built-in adapters, found by walking the modules named
``*_adapter`` in ``lmcache.v1.storage_backend.connector`` (``redis_adapter``,
``mooncakestore_adapter``, ...), and ``remote_storage_plugins`` entries. ``pdserve lmcache
register`` adds the first kind: a two-line module ``pdserve_adapter.py`` in that package that
re-exports :class:`PdserveConnectorAdapter`, so an LMCache configured with nothing but
``remote_url: pdserve://10.0.0.5:50051`` reads and writes pdserve's store (``make setup`` runs
it; ``pdserve lmcache unregister`` removes the file). Without registering, LMCache's
``remote_storage_plugins`` load pdserve's connector (docs/lmcache.md).

The URL's query carries the plugin's optional settings (docs/lmcache.md)::

    pdserve://HOST:PORT?namespace=lmcache&transport=tcp&timeout_s=5&replicas=1&ttl_ms=0
                       &soft_pin=false&io_threads=4
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pdserve import errors
from pdserve.integrations.lmcache import PluginSettings

SCHEME = "pdserve://"
#: The module LMCache's adapter discovery finds (its name must end in ``_adapter``).
SHIM_NAME = "pdserve_adapter.py"
SHIM = (
    '"""pdserve\'s adapter for remote_url: pdserve://HOST:PORT (written by `pdserve lmcache '
    'register`)."""\n'
    "from pdserve.integrations.lmcache_url import PdserveConnectorAdapter  # noqa: F401\n"
)
#: Settings a ``pdserve://`` URL's query may carry (the master is the URL's host and port; a
#: Mooncake Store is LMCache's own ``mooncakestore://``).
URL_SETTINGS = tuple(
    f.name for f in fields(PluginSettings) if f.name not in ("master_address", "backend")
)


def settings_from_url(url: str) -> PluginSettings:
    """The plugin settings a ``pdserve://HOST:PORT[?key=value&...]`` URL names; an
    InvalidArgument says what is wrong with any other URL or query key."""
    if not url.startswith(SCHEME):
        raise errors.InvalidArgument(f"remote_url {url!r} is not a pdserve:// URL")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path.strip("/") or parts.fragment:
        raise errors.InvalidArgument(
            f"remote_url {url!r} must name the KV store master as pdserve://HOST:PORT "
            "(with optional ?key=value settings)"
        )
    extra: dict[str, Any] = {"remote_storage_plugin.url.master_address": parts.netloc}
    for key, values in parse_qs(parts.query, keep_blank_values=True, strict_parsing=False).items():
        if key not in URL_SETTINGS:
            hint = errors.did_you_mean(key, URL_SETTINGS)
            raise errors.InvalidArgument(
                f"remote_url {url!r}: unknown setting {key!r}{hint}; a pdserve:// URL takes "
                f"{', '.join(URL_SETTINGS)}"
            )
        if len(values) != 1:
            raise errors.InvalidArgument(f"remote_url {url!r}: {key} is given {len(values)} times")
        extra[f"remote_storage_plugin.url.{key}"] = values[0]
    try:
        return PluginSettings.from_extra_config(extra, "url")
    except ValueError as exc:  # a number that does not parse
        raise errors.InvalidArgument(f"remote_url {url!r}: {exc}") from exc


# -- the LMCache adapter (LMCache imported on first access) --------------------------------------


def __getattr__(name: str) -> Any:
    """``PdserveConnectorAdapter`` subclasses LMCache's ``ConnectorAdapter``, so it is built on
    first access; importing this module never loads LMCache."""
    if name == "PdserveConnectorAdapter":
        cls = _adapter_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _adapter_class() -> type:
    try:
        from lmcache.v1.storage_backend.connector import ConnectorAdapter
    except ImportError as exc:
        raise ImportError(
            f"PdserveConnectorAdapter needs LMCache ({exc}); install it as docs/lmcache.md says"
        ) from exc
    from pdserve.integrations import lmcache as plug

    class PdserveConnectorAdapter(ConnectorAdapter):
        """Builds a :class:`~pdserve.integrations.lmcache.PdserveConnector` for a
        ``pdserve://HOST:PORT`` remote URL."""

        def __init__(self) -> None:
            super().__init__(SCHEME)

        def create_connector(self, context: Any) -> Any:
            return plug.PdserveConnector(
                context.loop,
                context.local_cpu_backend,
                context.config,
                plugin_name="remote_url",
                settings=settings_from_url(context.url),
            )

    PdserveConnectorAdapter.__qualname__ = "PdserveConnectorAdapter"
    return PdserveConnectorAdapter


# -- registration -------------------------------------------------------------------------------


def connector_dir() -> Path:
    """The installed LMCache's connector package, where its adapters live."""
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        raise errors.NotFound("LMCache is not installed here (docs/lmcache.md: Install)")
    path = Path(next(iter(spec.submodule_search_locations))) / "v1/storage_backend/connector"
    if not (path / "__init__.py").is_file():
        raise errors.NotFound(f"{path} is not LMCache's connector package (LMCache 0.5.6 has it)")
    return path


def registered(directory: Path) -> bool:
    return (directory / SHIM_NAME).is_file() and (directory / SHIM_NAME).read_text() == SHIM


def register(directory: Path) -> bool:
    """Writes the adapter module into ``directory``; False when it was already there."""
    if registered(directory):
        return False
    (directory / SHIM_NAME).write_text(SHIM)
    return True


def unregister(directory: Path) -> bool:
    """Removes the adapter module; False when there was none."""
    target = directory / SHIM_NAME
    if not target.exists():
        return False
    target.unlink()
    return True


def _run(args: argparse.Namespace) -> int:
    try:
        directory = Path(args.lmcache_dir) if args.lmcache_dir else connector_dir()
    except errors.PdserveError as exc:
        print(f"pdserve lmcache: {exc}", file=sys.stderr)
        return 1
    shim = directory / SHIM_NAME
    if args.action == "status":
        ok = registered(directory)
        print(f"pdserve:// adapter {'registered' if ok else 'not registered'} ({shim})")
        return 0 if ok else 1
    try:
        changed = register(directory) if args.action == "register" else unregister(directory)
    except OSError as exc:
        print(f"pdserve lmcache: cannot write {shim}: {exc}", file=sys.stderr)
        return 1
    verb = {"register": ("wrote", "already there:"), "unregister": ("removed", "none at")}
    print(f"pdserve lmcache {args.action}: {verb[args.action][0 if changed else 1]} {shim}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "lmcache",
        help="register pdserve's remote_url scheme (pdserve://) with the installed LMCache",
        description=(
            "LMCache finds its remote-store adapters as modules named *_adapter in "
            "lmcache.v1.storage_backend.connector. 'register' writes pdserve_adapter.py there "
            "(a re-export of pdserve.integrations.lmcache_url.PdserveConnectorAdapter), so an "
            "LMCache configured with only remote_url: pdserve://HOST:PORT uses pdserve's KV "
            "store; 'unregister' removes it; 'status' exits 0 when it is in place. make setup "
            "registers it. See docs/lmcache.md."
        ),
    )
    p.add_argument("action", choices=("register", "unregister", "status"))
    p.add_argument(
        "--lmcache-dir",
        help="LMCache's connector package folder (default: the installed LMCache's)",
    )
    p.set_defaults(func=_run)
