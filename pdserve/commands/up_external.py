"""``pdserve up --external-engine URL``: pdserve's meta, KV store and router in front of stock
``vllm serve`` engines that ``up`` does not start (docs/vllm-connector.md, "pdserve up in front
of your engines").

``up`` starts meta and the store, then writes ``<run_dir>/external-engines.json`` and prints the
``--kv-transfer-config`` each engine needs to reach that store (pdserve's connector, the
master's address, the chunk size and, with TLS, a certificate of the engine's own from
``<run_dir>/certs``), waits until every engine answers ``GET /health`` (they may still be loading,
or not be started yet: they need the store first), asks the first one's ``GET /v1/models``
which model it serves, and starts the router with the engines as static workers
(``--decode URL`` for each ``--external-engine``, ``--prefill URL`` for each
``--external-prefill``) and the KV settings it cannot learn from stock engines
(``--kv-dtype``, ``--chunk-size``). ``up`` supervises only what it started: the engines are
never restarted by it; the router's circuit breaker takes one that fails out of rotation and
its health probe puts it back.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.commands.up_settings import UpSettings, tls_files
from pdserve.config import ConfigError

#: What ``up`` writes for the engines' operators (and tests), in the run dir.
EXTERNAL_FILE = "external-engines.json"
#: The KV dtype of the engines when ``kv_dtype`` is auto: what the stock connector derives
#: (``connector_stock._kv_dtype``: ``--kv-cache-dtype``, else the model's dtype) for vLLM's
#: default ``--dtype auto`` with a float32 or bfloat16 checkpoint, SmolLM2 included: vLLM
#: downcasts float32 to the platform's first dtype, bfloat16 on CPUs and bf16 GPUs.
DEFAULT_KV_DTYPE = "bfloat16"
CONNECTOR = {
    "kv_connector": "PdserveConnector",
    "kv_connector_module_path": "pdserve.engines.vllm_connector",
}
#: Seconds between "still waiting for the engines" messages.
PROGRESS_EVERY_S = 15.0


@dataclass(frozen=True)
class Engine:
    """One external engine: its base URL, the router role it gets, its certificate's name."""

    url: str
    role: str  # "decode" (prefills too: kv_both) or "prefill"
    cert: str


def check_url(flag: str, url: str) -> str:
    """``url`` without a trailing slash; ConfigError naming ``flag`` unless it is
    ``http(s)://host:port``."""
    parts = urllib.parse.urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise ConfigError(
            f"--{flag} {url!r}: expected the base URL of an OpenAI-compatible vllm serve, "
            "http://HOST:PORT or https://HOST:PORT (a port, no path)"
        )
    return f"{parts.scheme}://{parts.netloc}"


def validate(cfg: UpSettings) -> None:
    """The external-engine fields of ``cfg`` (normalized in place), and what they exclude."""
    from pdserve.hashing import KV_DTYPES

    if cfg.kv_dtype not in ("auto", *KV_DTYPES):
        raise ConfigError(f"kv_dtype must be auto or one of {KV_DTYPES}, got {cfg.kv_dtype!r}")
    cfg.external_engine = [check_url("external-engine", u) for u in cfg.external_engine if u]
    cfg.external_prefill = [check_url("external-prefill", u) for u in cfg.external_prefill if u]
    urls = cfg.external_engine + cfg.external_prefill
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise ConfigError(
            f"external engine URL(s) {', '.join(dup)} given twice: each engine is either an "
            "--external-engine (prefills and decodes) or an --external-prefill, once"
        )
    if cfg.external_prefill and not cfg.external_engine:
        raise ConfigError(
            "--external-prefill needs at least one --external-engine: those decode what the "
            "prefill engines computed"
        )
    if cfg.engine_kv_events and not cfg.external_engine:
        raise ConfigError("--engine-kv-events applies to --external-engine / --external-prefill")
    events = []
    for item in cfg.engine_kv_events:
        url, sep, endpoints = item.partition("=")
        parts = endpoints.split("+") if sep else []
        if not 1 <= len(parts) <= 2 or not all(e.startswith(("tcp://", "ipc://")) for e in parts):
            raise ConfigError(
                f"--engine-kv-events {item!r}: expected URL=ENDPOINT[+REPLAY_ENDPOINT], the "
                "engine's URL and the tcp:// or ipc:// endpoints of its vLLM --kv-events-config "
                "publisher (e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557)"
            )
        url = check_url("engine-kv-events", url)
        if url not in urls:
            raise ConfigError(
                f"--engine-kv-events {item!r}: {url} is not one of the external engines "
                f"({', '.join(urls) or 'none'})"
            )
        events.append(f"{url}={endpoints}")  # the router matches the URL as up passes it
    cfg.engine_kv_events = events
    if not cfg.external_engine:
        return
    if cfg.prefill_workers > 0 or cfg.decode_workers > 0:
        raise ConfigError(
            "--external-engine runs no pdserve workers: leave prefill_workers and "
            f"decode_workers at their auto values (got {cfg.prefill_workers} and "
            f"{cfg.decode_workers}): up runs either its own workers or external engines"
        )
    if cfg.store_backend != "pdserve":
        raise ConfigError(
            f"--external-engine needs store_backend pdserve (got {cfg.store_backend!r}): the "
            "pdserve connector in a stock vllm serve talks to pdserve's own store; for a "
            "Mooncake Store run vLLM's MooncakeStoreConnector instead"
        )


def engines(cfg: UpSettings) -> list[Engine]:
    """The external engines, decode (``--external-engine``) first."""
    return [
        Engine(u, "decode", f"external-decode-{i}") for i, u in enumerate(cfg.external_engine)
    ] + [Engine(u, "prefill", f"external-prefill-{i}") for i, u in enumerate(cfg.external_prefill)]


def kv_dtype(cfg: UpSettings) -> str:
    return DEFAULT_KV_DTYPE if cfg.kv_dtype == "auto" else cfg.kv_dtype


def kv_transfer_config(cfg: UpSettings, engine: Engine) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that points ``engine`` at up's store (connector_stock.py:
    master_address, chunk_size, kv_compression, tls_* files). Every engine is kv_both: the
    router's local plan runs a whole request on a decode engine, which then stores what it
    computed, and a prefill engine loads the prefix others stored."""
    extra: dict[str, Any] = {
        "master_address": ",".join(cfg.master_addresses()),  # HA: every master's
        "chunk_size": cfg.chunk_size,
    }
    if cfg.kv_compression != "none":
        extra["kv_compression"] = cfg.kv_compression
    if cfg.tls:
        extra.update(tls_files(cfg.run_dir, engine.cert))
    return {
        **CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def write_file(cfg: UpSettings) -> Path:
    """``<run_dir>/external-engines.json``: each engine's URL, role and kv_transfer_config."""
    path = Path(cfg.run_dir) / EXTERNAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"url": e.url, "role": e.role, "kv_transfer_config": kv_transfer_config(cfg, e)}
        for e in engines(cfg)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"engines": rows}, indent=2))
    tmp.replace(path)
    return path


def instructions(cfg: UpSettings) -> str:
    """What each engine needs, ready to paste (banner and start-up message)."""
    lines = []
    for e in engines(cfg):
        what = "prefill" if e.role == "prefill" else "prefill + decode"
        config = json.dumps(kv_transfer_config(cfg, e), separators=(",", ":"))
        lines.append(f"    {e.url} ({what}): --block-size 32 --kv-transfer-config '{config}'")
    dtype = kv_dtype(cfg)
    note = (
        f"  (KV dtype {dtype}: the router keys prompts with it; engines must compute KV in "
        f"{dtype}, vLLM's default for a float32/bfloat16 model, else set up's kv_dtype; the "
        f"block size must divide chunk_size {cfg.chunk_size})"
    )
    return "\n".join(lines) + "\n" + note


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    """(status, body) of ``GET url``; status 0 when nothing answers."""
    ctx = ssl.create_default_context() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (OSError, ValueError):
        return 0, b""


def wait_healthy(cfg: UpSettings, progress) -> None:
    """Waits until every engine's ``GET /health`` answers 200 (ready_timeout_s); RuntimeError
    naming those that never did."""
    t0 = time.monotonic()
    deadline = t0 + cfg.ready_timeout_s
    waiting = [e.url for e in engines(cfg)]
    last = 0.0
    while True:
        waiting = [u for u in waiting if http_get(f"{u}/health", 2.0)[0] != 200]
        if not waiting:
            return
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(
                f"external engine(s) {', '.join(waiting)} did not answer GET /health with 200 "
                f"within ready_timeout_s {cfg.ready_timeout_s:.0f}s: start each as `pdserve vllm "
                f"serve MODEL --kv-transfer-config ...` with its config from "
                f"{Path(cfg.run_dir) / EXTERNAL_FILE}"
            )
        if now - last >= PROGRESS_EVERY_S:
            last = now
            progress(
                f"waiting for external engine(s) {', '.join(waiting)} to answer GET /health "
                f"({deadline - now:.0f}s left of ready_timeout_s; they may still be loading)"
            )
        time.sleep(0.5)


def served_model(url: str, timeout: float = 10.0) -> tuple[str, str]:
    """(root, id) of the first model ``url``'s ``GET /v1/models`` lists: the model vLLM loaded
    (its folder or Hugging Face id) and the name it serves it as."""
    status, body = http_get(f"{url}/v1/models", timeout)
    try:
        card = json.loads(body)["data"][0]
        name = str(card["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(
            f"external engine {url}: GET /v1/models answered {status} without a model "
            "(an engine behind an API key is not supported; set --model)"
        ) from None
    return str(card.get("root") or name), name


def router_model(cfg: UpSettings, explicit: bool, progress) -> tuple[str, str]:
    """(the router's --model, its --served-name): the engines' served name always (the name
    requests use and part of the chunk keys); the model folder for the tokenizer from --model
    when the user set it, else from the first engine (which must then be readable here)."""
    from pdserve.model.prepare import resolve_model

    first = cfg.external_engine[0]
    root, name = served_model(first)
    folder = cfg.model if explicit else root
    try:
        resolve_model(folder)
    except ValueError as exc:
        raise RuntimeError(
            f"external engine {first} serves {name!r} from {root!r}, which is no model folder "
            f"on this machine ({exc}); set --model to a local copy of it"
        ) from None
    progress(f"external engines serve {name!r} (model {folder})")
    return folder, name


def model_explicit(args: argparse.Namespace) -> bool:
    """Whether the user chose ``up``'s model (flag, PDSERVE_UP_MODEL or the config file's up
    section) rather than leaving the default."""
    from pdserve.config import read_config

    if getattr(args, "model", None) is not None or "PDSERVE_UP_MODEL" in os.environ:
        return True
    path = getattr(args, "config", None)
    if not path:
        return False
    section = read_config(path).get("up") or {}
    return isinstance(section, dict) and "model" in section


def router_flags(cfg: UpSettings) -> dict[str, object]:
    """The router flags of the external engines (static workers, their KV settings)."""
    flags: dict[str, object] = {
        "decode": ",".join(cfg.external_engine),
        "prefill": ",".join(cfg.external_prefill) or None,
        "kv_dtype": kv_dtype(cfg),
    }
    if cfg.kv_compression != "none":
        flags["kv_compression"] = cfg.kv_compression
    if cfg.engine_kv_events:  # only then: routers without the option refuse the flag
        flags["engine_kv_events"] = ",".join(cfg.engine_kv_events)
    return flags


def await_engines(cfg: UpSettings, explicit_model: bool, progress) -> tuple[dict[str, object], str]:
    """With the store up: says what the engines need to reach it (and writes it to the run
    dir), waits until each answers /health, learns their model. Returns the router's flags for
    them and the name requests use."""
    path = write_file(cfg)
    progress(
        f"the store is up; start the external engines with pdserve's connector (also in "
        f"{path}):\n{instructions(cfg)}"
    )
    wait_healthy(cfg, progress)
    model, name = router_model(cfg, explicit_model, progress)
    flags = {**router_flags(cfg), "model": model, "served_name": name, "chunk_size": cfg.chunk_size}
    return flags, name
