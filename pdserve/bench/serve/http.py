"""Blocking HTTP checks of a system under test (stdlib only): is it up, does it serve the
model, what does its ``/metrics`` say. Every call presents the API key it is given."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from pdserve.bench.serve.status import EXIT_UNREACHABLE, BenchError


def auth_headers(key: str) -> dict[str, str]:
    """The HTTP headers that present API key ``key`` (none when it is empty)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_get(url: str, timeout: float = 5.0, key: str = "") -> tuple[int, str]:
    """``(status, body)`` of a GET (with API key ``key``); raises OSError when nothing answers."""
    try:
        req = urllib.request.Request(url, headers=auth_headers(key))
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def served_models(base: str, key: str = "") -> list[str]:
    """Model ids of ``GET base/v1/models`` (with API key ``key``).

    Raises:
        BenchError: (exit 2) nothing answers, or not with a model list.
    """
    url = f"{base.rstrip('/')}/v1/models"
    try:
        status, body = http_get(url, key=key)
        if status != 200:
            hint = " (set PDSERVE_API_KEY or pass --api-key)" if status == 401 else ""
            raise BenchError(f"{url} answered HTTP {status}{hint}: {body[:300]}", EXIT_UNREACHABLE)
        return [m["id"] for m in json.loads(body)["data"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot reach {url}: {exc}", EXIT_UNREACHABLE) from None


def check_target(base: str, model: str, key: str = "") -> None:
    """Raises BenchError (exit 2) unless ``base`` answers and serves ``model``."""
    models = served_models(base, key)
    if model not in models:
        raise BenchError(
            f"{base} does not serve model {model!r} (it serves {models}); pass --model",
            EXIT_UNREACHABLE,
        )


def scrape(base: str, key: str = "") -> dict | None:
    """The samples of ``base/metrics``, or None when it has none."""
    from pdserve.bench.serve.metrics import parse_prometheus

    try:
        status, body = http_get(f"{base.rstrip('/')}/metrics", key=key)
        return parse_prometheus(body) if status == 200 else None
    except (OSError, ValueError):
        return None
