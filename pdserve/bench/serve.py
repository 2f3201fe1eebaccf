"""``pdserve bench serve``: an online serving benchmark like ``vllm bench serve``, optionally
side by side with a colocated vLLM baseline.

A streaming OpenAI client (``POST /v1/completions``, prompts as token ids, ``temperature 0``,
``ignore_eos``) sends a seeded workload open loop at its arrival times (multi-round
conversations send each round when the previous one finished) and reports TTFT, TPOT, ITL and
end-to-end latency, throughput and goodput with vLLM's definitions (see
:mod:`pdserve.bench.serve_metrics`). Against pdserve it also reports the router's prompt
tokens by source and mean time per request phase from its ``/metrics``.

Systems: ``--target URL`` (a running ``pdserve up``, or any OpenAI-compatible server; its API
key from ``$PDSERVE_API_KEY`` or ``--api-key``), or ``--start-pdserve "ARGS"`` (the benchmark
starts ``pdserve up ARGS`` on free ports, sends the key that ``up`` writes to its run dir, and
stops it). ``--compare colocated`` then runs the same workload against two plain ``vllm serve``
engines, one per core, behind a round-robin proxy, and prints both side by side.

``pdserve bench serve gen-trace --out FILE`` writes a conversation-like Mooncake trace for
``--workload trace --trace FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.procs import ServiceProcess, free_ports

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench.serve_metrics import RequestRecord, RouterFigures, ServeMetrics
    from pdserve.bench.workloads import Request

DEFAULT_TARGET = "http://127.0.0.1:8000"
WORKLOADS = ("random", "prefix-repetition", "multi-round", "trace")
#: Exit code when the target cannot be reached (or does not serve the model).
EXIT_UNREACHABLE = 2
#: Flags of the colocated baseline engines (ENVIRONMENT.md's baseline; the last flag only adds
#: ``cached_tokens`` to the usage vLLM reports).
BASELINE_VLLM_FLAGS = (
    "--dtype bfloat16 --max-model-len 4096 --block-size 32 --enforce-eager "
    "--enable-prefix-caching --enable-prompt-tokens-details"
)
MAX_ERRORS_SHOWN = 5


class BenchError(Exception):
    """A benchmark that cannot go on; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _say(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


# --- command line ---------------------------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive (or inf)")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve bench serve`` (and its ``gen-trace`` subcommand)."""
    d = "(default: %(default)s)"
    # NOTE: abbreviations would let this parser claim gen-trace's --out as --output-len.
    parser.allow_abbrev = False
    sysg = parser.add_argument_group("systems")
    sysg.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"OpenAI-compatible base URL of the system under test, e.g. a running 'pdserve up' {d}",
    )
    sysg.add_argument(
        "--api-key",
        default="",
        help="the target's API key, sent as 'Authorization: Bearer KEY' (default: "
        "$PDSERVE_API_KEY, which unlike a flag does not show in ps; --start-pdserve reads the "
        "key from its run dir)",
    )
    sysg.add_argument("--model", default="smollm2", help=f"model name sent in requests {d}")
    sysg.add_argument(
        "--label", default="pdserve", help=f"name of the system under test in the output {d}"
    )
    sysg.add_argument(
        "--start-pdserve",
        metavar="ARGS",
        help="start 'pdserve up ARGS' on free ports for the run and stop it after (replaces "
        "--target; --model is passed to it unless ARGS has --model; do not pass ports or "
        "--run-dir) (default: use --target)",
    )
    sysg.add_argument(
        "--compare",
        choices=["none", "colocated"],
        default="none",
        help="also run the workload against a colocated vLLM baseline: two 'vllm serve' "
        "engines, one per core (VLLM_CPU_OMP_THREADS_BIND=0/1, VLLM_CPU_KVCACHE_SPACE), behind "
        f"a round-robin proxy, started after the system under test is done {d}",
    )
    sysg.add_argument(
        "--baseline-engines", type=int, default=2, help=f"colocated vLLM engines, one per core {d}"
    )
    sysg.add_argument(
        "--baseline-kv-cache-gib",
        type=float,
        default=2.0,
        help=f"VLLM_CPU_KVCACHE_SPACE of each baseline engine {d}",
    )
    sysg.add_argument(
        "--baseline-args",
        default=BASELINE_VLLM_FLAGS,
        metavar="ARGS",
        help=f"flags of each baseline 'vllm serve' {d}",
    )
    sysg.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help=f"seconds a started system may take to become ready {d}",
    )
    sysg.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the logs of started systems (a temporary folder, printed) even on success",
    )

    wl = parser.add_argument_group("workload")
    wl.add_argument("--workload", choices=WORKLOADS, default="random", help=f"workload kind {d}")
    wl.add_argument("--seed", type=int, default=0, help=f"seed of every random choice {d}")
    wl.add_argument(
        "--vocab-size",
        type=int,
        help="token ids are drawn from [100, vocab size) (default: the model folder's "
        "config.json vocab_size when it is prepared here, else 49152)",
    )
    wl.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="Poisson arrival rate in requests/s of random and prefix-repetition workloads, "
        f"conversation starts/s of multi-round; inf sends everything at once {d}",
    )
    wl.add_argument("--num-prompts", type=int, default=100, help=f"requests (random, prefix) {d}")
    wl.add_argument("--input-len", type=int, default=256, help=f"random: prompt tokens {d}")
    wl.add_argument(
        "--output-len",
        type=int,
        default=16,
        help=f"random, prefix-repetition, multi-round: max_tokens (ignore_eos) {d}",
    )
    wl.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help=f"random: lengths uniform in [len*(1-r), len*(1+r)] {d}",
    )
    wl.add_argument("--num-prefixes", type=int, default=4, help=f"prefix-repetition: prefixes {d}")
    wl.add_argument("--prefix-len", type=int, default=256, help=f"prefix-repetition: tokens {d}")
    wl.add_argument("--suffix-len", type=int, default=32, help=f"prefix-repetition: tokens {d}")
    wl.add_argument(
        "--num-conversations", type=int, default=8, help=f"multi-round: conversations {d}"
    )
    wl.add_argument("--rounds", type=int, default=4, help=f"multi-round: rounds each {d}")
    wl.add_argument(
        "--turn-len", type=int, default=64, help=f"multi-round: new user tokens per round {d}"
    )
    wl.add_argument("--trace", metavar="FILE", help="trace: Mooncake JSONL trace to replay")
    wl.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="trace: tokens per hash block (the trace's are 512; input lengths scale by "
        f"N/512) {d}",
    )
    wl.add_argument(
        "--time-scale", type=float, default=1.0, help=f"trace: multiply arrival times by X {d}"
    )
    wl.add_argument(
        "--output-scale",
        type=float,
        help="trace: multiply output lengths by X (default: block-tokens/512, as the input)",
    )
    wl.add_argument("--min-output", type=int, default=1, help=f"trace: clamp max_tokens below {d}")
    wl.add_argument(
        "--max-output", type=int, default=0, help=f"trace: clamp max_tokens above (0 = none) {d}"
    )
    wl.add_argument("--max-rows", type=int, default=0, help=f"trace: first N rows (0 = all) {d}")

    run = parser.add_argument_group("run and output")
    run.add_argument(
        "--max-concurrency",
        type=int,
        help="most requests in flight; later arrivals wait for a slot (default: unlimited)",
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured requests before each run, one after the other (random prompts of the "
        "first request's length, so no workload prefix gets cached; 2 reach both engines of "
        f"the round-robin baseline) {d}",
    )
    run.add_argument(
        "--request-timeout", type=float, default=600.0, help=f"seconds per request {d}"
    )
    run.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 [e2el:3000]: completed requests/s that "
        "meet all of them (default: no goodput)",
    )
    run.add_argument("--json", metavar="FILE", help="write every number and per-request record")
    run.add_argument(
        "--plot-dir",
        metavar="DIR",
        help="write ttft_cdf.png, tpot_cdf.png, throughput.png and inflight.png",
    )
    run.add_argument(
        "--window-s", type=float, default=5.0, help=f"throughput plot window in seconds {d}"
    )
    run.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_cli)

    sub = parser.add_subparsers(dest="serve_command", metavar="{gen-trace}")
    gen = sub.add_parser(
        "gen-trace",
        help="write a conversation-like Mooncake trace (JSONL) for --workload trace",
        description=(
            "Writes a Mooncake JSONL trace: rows {timestamp ms, input_length, output_length, "
            "hash_ids} at Poisson arrivals, floored to --arrival-step-ms. Every row starts "
            "with the shared system block 0; a row is a new session (system block + new "
            "blocks) or the next turn of an earlier session (its previous blocks + new ones). "
            "Prints the reuse fraction (share of "
            "blocks whose id appeared in an earlier row) and the replayed sizes. With "
            "--block-tokens 16, '--reuse light' gives a mean input near 220 tokens, output "
            "2-16, about 17% reused blocks; '--reuse heavy' about 300 tokens and 45%."
        ),
    )
    add_gen_trace_arguments(gen)


def _pair(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO:HI") from None
    if pair[0] < 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= LO <= HI")
    return pair


def add_gen_trace_arguments(p: argparse.ArgumentParser) -> None:
    d = "(default: %(default)s)"
    p.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    p.add_argument("--rows", type=int, default=500, help=f"requests {d}")
    p.add_argument("--rate", type=_rate, default=1.0, help=f"Poisson arrivals per second {d}")
    p.add_argument("--seed", type=int, default=0, help=f"seed {d}")
    p.add_argument(
        "--arrival-step-ms",
        type=_non_negative,
        default=3000.0,
        help="floor each arrival to a multiple of this, so requests come in bursts as in the "
        f"Mooncake conversation trace, which logs arrivals in 3,000 ms steps (0 = Poisson) {d}",
    )
    p.add_argument(
        "--reuse", choices=["light", "heavy"], default="light", help=f"parameter preset {d}"
    )
    p.add_argument(
        "--first-blocks",
        type=_pair,
        metavar="LO:HI",
        help="new blocks of a session's first turn (default: preset)",
    )
    p.add_argument(
        "--turn-blocks",
        type=_pair,
        metavar="LO:HI",
        help="new blocks of a later turn (default: preset)",
    )
    p.add_argument(
        "--follow-up", type=float, help="probability a row continues a session (default: preset)"
    )
    p.add_argument("--max-turns", type=int, help="turns per session (default: preset)")
    p.add_argument("--output-tokens", type=_pair, metavar="LO:HI", help="output_length range in trace tokens (default: 64:512, i.e. 2-16 at --block-tokens 16)")  # fmt: skip
    p.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help=f"block size for the printed replay sizes only {d}",
    )
    p.set_defaults(func=gen_trace_cli)


def gen_trace_cli(args: argparse.Namespace) -> int:
    from pdserve.bench import workloads as wl

    kw: dict[str, Any] = dict(wl.REUSE_PRESETS[args.reuse])
    for name in ("first_blocks", "turn_blocks", "follow_up", "max_turns", "output_tokens"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    cfg = wl.TraceGenConfig(
        rows=args.rows,
        rate=args.rate,
        seed=args.seed,
        arrival_step_ms=args.arrival_step_ms,
        **kw,
    )
    rows = wl.generate_trace(cfg)
    wl.write_trace(args.out, rows)
    stats = wl.workload_stats(wl.trace_workload(rows, block=args.block_tokens))
    print(
        f"wrote {len(rows)} rows to {args.out}: span {stats.span_s:.1f} s, reuse fraction "
        f"{wl.reuse_fraction(rows):.3f}; replayed at --block-tokens {args.block_tokens}: mean "
        f"input {stats.mean_input:.1f} tokens, output {stats.min_output}-{stats.max_output} "
        f"(mean {stats.mean_output:.1f})"
    )
    return 0


# --- workloads ------------------------------------------------------------------------------


def model_vocab_size(model: str) -> int | None:
    """``vocab_size`` from the config.json of a model prepared here (None if unknown)."""
    from pdserve.model.prepare import known_model_dir

    try:
        cfg = json.loads((known_model_dir(model) / "config.json").read_text())
    except (ValueError, OSError):
        return None
    size = cfg.get("vocab_size")
    return int(size) if isinstance(size, int) else None


def vocab_size(args: argparse.Namespace) -> int:
    """``--vocab-size``, else the prepared model's, else SmolLM2's 49152."""
    from pdserve.bench.workloads import DEFAULT_VOCAB

    return args.vocab_size or model_vocab_size(args.model) or DEFAULT_VOCAB


def build_workload(args: argparse.Namespace) -> tuple[Request, ...]:
    """The requests ``args`` describe (prints the trace's reuse fraction when loading one)."""
    from pdserve.bench import workloads as wl

    common = {"seed": args.seed, "vocab_size": vocab_size(args)}
    if args.workload == "random":
        return wl.random_workload(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.request_rate,
            **common,
        )
    if args.workload == "prefix-repetition":
        return wl.prefix_repetition_workload(
            args.num_prompts,
            args.num_prefixes,
            args.prefix_len,
            args.suffix_len,
            args.output_len,
            args.request_rate,
            **common,
        )
    if args.workload == "multi-round":
        return wl.multi_round_workload(
            args.num_conversations,
            args.rounds,
            args.turn_len,
            args.output_len,
            args.request_rate,
            **common,
        )
    if not args.trace:
        raise BenchError("--workload trace needs --trace FILE (make one with 'gen-trace')")
    rows = wl.read_trace(args.trace, args.max_rows)
    _say(f"trace {args.trace}: {len(rows)} rows, reuse fraction {wl.reuse_fraction(rows):.3f}")
    return wl.trace_workload(
        rows,
        block=args.block_tokens,
        time_scale=args.time_scale,
        output_scale=args.output_scale,
        min_output=args.min_output,
        max_output=args.max_output,
        **common,
    )


# --- HTTP helpers (blocking, stdlib) -----------------------------------------------------------


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
    from pdserve.bench.serve_metrics import parse_prometheus

    try:
        status, body = http_get(f"{base.rstrip('/')}/metrics", key=key)
        return parse_prometheus(body) if status == 200 else None
    except (OSError, ValueError):
        return None


# --- started systems ------------------------------------------------------------------------


def spawn(
    name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> ServiceProcess:
    """Starts ``argv`` in its own session (process group), output to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        popen = subprocess.Popen(
            list(argv),
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
    return ServiceProcess(name, popen, log)


def read_key(path: Path) -> str:
    """The API key in ``path`` (its first line; "" when there is none yet)."""
    try:
        return path.read_text().partition("\n")[0].strip()
    except OSError:
        return ""


def wait_http_ready(
    proc: ServiceProcess,
    base: str,
    model: str,
    timeout: float,
    marker: str | None = None,
    key_file: Path | None = None,
) -> None:
    """Waits until ``base/health`` is 200 and ``base/v1/models`` lists ``model`` (asked with
    the key in ``key_file`` once it is there) and, if given, ``marker`` appears in the log.

    Raises:
        BenchError: the process exited or the time ran out (with the log's tail).
    """
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise BenchError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was ready "
                f"(log {proc.log_path}):\n{proc.log_tail()}"
            )
        # HTTPException: something else answers on the port (a port race): not ready yet
        with contextlib.suppress(OSError, BenchError, http.client.HTTPException):
            key = read_key(key_file) if key_file else ""
            ready = http_get(f"{base}/health", 2.0)[0] == 200 and model in served_models(base, key)
            if ready and (marker is None or marker in proc.log_path.read_text(errors="replace")):
                return
        if time.monotonic() > deadline:
            raise BenchError(
                f"{proc.name} not ready within {timeout:.0f}s (log {proc.log_path}):\n{proc.log_tail()}"
            )
        time.sleep(0.5)


@contextlib.contextmanager
def logs_dir(keep: bool) -> Iterator[Path]:
    """A temporary folder for logs and run state, removed on success unless ``keep``."""
    import shutil

    path = Path(tempfile.mkdtemp(prefix="pdserve-bench-serve-"))
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep:
            shutil.rmtree(path, ignore_errors=True)
        else:
            _say(f"logs kept in {path}")


def pdserve_up_argv(args_text: str, model: str, run_dir: Path) -> tuple[list[str], str]:
    """The ``pdserve up`` command line on free ports and its HTTP base URL."""
    user = shlex.split(args_text)
    http = free_ports(1)[0]
    ports = {
        "--http-port": http,
        "--router-port": free_ports(1)[0],
        "--meta-port": free_ports(1)[0],
        "--meta-http-port": free_ports(1)[0],
        "--master-port": free_ports(1)[0],
    }
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--run-dir", str(run_dir)]
    argv += ["--host", "127.0.0.1", *(x for kv in ports.items() for x in map(str, kv))]
    if "--model" not in user and not any(a.startswith("--model=") for a in user):
        argv += ["--model", model]
    return argv + user, f"http://127.0.0.1:{http}"


@contextlib.contextmanager
def started_pdserve(
    args_text: str, model: str, work: Path, timeout: float
) -> Iterator[tuple[str, str]]:
    """Runs ``pdserve up`` for the duration of the block; yields its HTTP base URL and its
    API key ("" when ARGS turn auth off)."""
    from pdserve.up import API_KEY_FILE

    run_dir = work / "pdserve-run"
    argv, base = pdserve_up_argv(args_text, model, run_dir)
    _say(f"starting: {shlex.join(argv[1:])}")
    t0 = time.monotonic()
    proc = spawn("pdserve up", argv, work / "pdserve-up.log")
    key_file = run_dir / API_KEY_FILE
    try:
        wait_http_ready(proc, base, model, timeout, marker="pdserve is up.", key_file=key_file)
        _say(f"pdserve up ready in {time.monotonic() - t0:.1f}s at {base}")
        yield base, read_key(key_file)
    finally:
        _say("stopping pdserve up")
        t1 = time.monotonic()
        proc.stop(120.0)
        _say(f"pdserve up stopped in {time.monotonic() - t1:.1f}s (exit {proc.popen.returncode})")


def baseline_env(core: int, kv_gib: float, tmp: Path) -> dict[str, str]:
    """Environment of the colocated baseline engine pinned to ``core``."""
    for sub in ("tmp", "vllm-cache", "inductor"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        "TMPDIR": str(tmp / "tmp"),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
        "VLLM_NO_USAGE_STATS": "1",
    }


@contextlib.contextmanager
def started_colocated(args: argparse.Namespace, work: Path) -> Iterator[str]:
    """Runs the colocated vLLM baseline (engines + round-robin proxy); yields the proxy URL."""
    from pdserve.model.prepare import resolve_model

    model_dir = resolve_model(args.model)
    cores = os.cpu_count() or 1
    procs: list[ServiceProcess] = []
    try:
        bases = []
        t0 = time.monotonic()
        for i in range(args.baseline_engines):
            port = free_ports(1)[0]
            argv = [sys.executable, "-m", "pdserve.vllm_cli", "serve", str(model_dir)]
            argv += ["--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port)]
            argv += shlex.split(args.baseline_args)
            env = baseline_env(i % cores, args.baseline_kv_cache_gib, work / f"vllm-{i}")
            _say(f"starting vllm-{i} on core {i % cores}: {shlex.join(argv[1:])}")
            procs.append(spawn(f"vllm-{i}", argv, work / f"vllm-{i}.log", env))
            bases.append(f"http://127.0.0.1:{port}")
        for proc, base in zip(procs, bases, strict=True):
            wait_http_ready(proc, base, args.model, args.start_timeout)
        port = free_ports(1)[0]
        argv = [sys.executable, "-m", "pdserve.bench.serve", "proxy", str(port), *bases]
        procs.append(spawn("proxy", argv, work / "proxy.log"))
        proxy = f"http://127.0.0.1:{port}"
        wait_http_ready(procs[-1], proxy, args.model, 60.0)
        _say(f"colocated baseline ready in {time.monotonic() - t0:.1f}s at {proxy} -> {bases}")
        yield proxy
    finally:
        t1 = time.monotonic()
        for proc in reversed(procs):
            _say(f"stopping {proc.name}")
            proc.stop(60.0)
        _say(f"colocated baseline stopped in {time.monotonic() - t1:.1f}s")


# --- round-robin proxy (its own process) ----------------------------------------------------


def proxy_main(port: int, backends: Sequence[str]) -> None:
    """Serves ``127.0.0.1:port``: each POST goes to the next backend in turn, every other
    request to the first; responses (SSE included) are streamed through unchanged."""
    import aiohttp
    from aiohttp import web

    turn = itertools.cycle(range(len(backends)))
    hop = {"content-length", "transfer-encoding", "connection", "content-encoding"}

    async def forward(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        backend = backends[next(turn)] if request.method == "POST" else backends[0]
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        async with session.request(
            request.method, backend + request.path_qs, data=await request.read(), headers=headers
        ) as up:
            resp = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in hop},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def on_startup(app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None)
        connector = aiohttp.TCPConnector(limit=0)
        app["session"] = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", forward)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- the client -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Client:
    """Streams completions from ``base`` (one aiohttp session for the whole run)."""

    session: aiohttp.ClientSession
    base: str
    model: str
    t0: float

    def payload(self, req: Request) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(req.prompt_token_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, index: int, req: Request) -> RequestRecord:
        """One request; never raises for HTTP or stream errors (they go in the record).
        Times are seconds since ``t0``."""
        import aiohttp

        from pdserve.bench.serve_metrics import RequestRecord

        chunks: list[float] = []
        state: dict[str, Any] = {"last": None, "usage": None, "error": None}
        send_s = time.perf_counter() - self.t0
        try:
            async with self.session.post(
                f"{self.base}/v1/completions", json=self.payload(req)
            ) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    state["error"] = f"HTTP {resp.status}: {body}"
                else:
                    await self._read_stream(resp, chunks, state)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            state["error"] = f"{type(exc).__name__}: {exc}"
        end_s = time.perf_counter() - self.t0
        usage = state["usage"] or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        error = state["error"]
        if error is None and not chunks:
            error = "the stream carried no generated text"
        return RequestRecord(
            index=index,
            send_s=send_s,
            end_s=end_s,
            chunk_s=tuple(chunks),
            last_chunk_s=state["last"],
            prompt_tokens=int(usage.get("prompt_tokens") or len(req.prompt_token_ids)),
            output_tokens=int(usage.get("completion_tokens") or len(chunks)),
            cached_tokens=int(cached) if isinstance(cached, int) else None,
            error=error,
        )

    async def _read_stream(
        self, resp: aiohttp.ClientResponse, chunks: list[float], state: dict[str, Any]
    ) -> None:
        """Records the arrival of each SSE event with generated text (``chunks``), the last
        event with choices (``state["last"]``), the usage and an in-stream error."""
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter() - self.t0
            event = json.loads(data)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                err = event["error"]
                state["error"] = (
                    f"in stream: {err.get('message') if isinstance(err, dict) else err}"
                )
                break
            if choices := event.get("choices"):
                state["last"] = now
                choice = choices[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    chunks.append(now)
            if event.get("usage"):
                state["usage"] = event["usage"]


async def run_requests(
    client: Client,
    requests: Sequence[Request],
    max_concurrency: int | None,
    bar: tqdm | None,
) -> list[RequestRecord]:
    """Sends ``requests`` at their times (see :mod:`pdserve.bench.workloads`): open-loop ones
    at ``t0 + t_s``, dependent ones ``t_s`` after their parent finished. With
    ``max_concurrency`` a request waits for a slot before it is sent (its send time is taken
    when it goes out, as in vLLM)."""
    children: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.after is not None:
            children.setdefault(r.after, []).append(i)
    records: list[RequestRecord | None] = [None] * len(requests)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int, at: float) -> None:
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem if sem is not None else contextlib.nullcontext():
            records[i] = await client.send(i, requests[i])
        if bar is not None:
            bar.update(1)
        now = time.perf_counter()
        await asyncio.gather(*(one(j, now + requests[j].t_s) for j in children.get(i, [])))

    roots = [one(i, client.t0 + r.t_s) for i, r in enumerate(requests) if r.after is None]
    await asyncio.gather(*roots)
    return [r for r in records if r is not None]


async def _run_async(
    base: str,
    model: str,
    requests: Sequence[Request],
    args: argparse.Namespace,
    label: str,
    before_measuring: Callable[[], None],
    key: str = "",
) -> list[RequestRecord]:
    """Warm-up requests, then ``before_measuring()``, then the measured workload (every
    request with API key ``key``)."""
    import aiohttp
    from tqdm import tqdm

    from pdserve.bench import workloads as wl

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector, headers=auth_headers(key))
    async with session:
        if args.warmup > 0 and requests:
            import numpy as np

            rng = np.random.default_rng([args.seed, 999])
            vocab, n = vocab_size(args), len(requests[0].prompt_token_ids)
            warm = Client(session, base, model, time.perf_counter())
            for k in range(args.warmup):
                ids = tuple(int(t) for t in rng.integers(wl.TOKEN_LOW, vocab, n))
                rec = await warm.send(-1 - k, wl.Request(0.0, ids, min(4, requests[0].max_tokens)))
                if rec.error:
                    _say(f"warm-up request failed: {rec.error}")
        before_measuring()
        client = Client(session, base, model, time.perf_counter())
        with tqdm(total=len(requests), desc=label, disable=args.disable_tqdm) as bar:
            return await run_requests(client, requests, args.max_concurrency, bar)


# --- one system -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SystemResult:
    """One system's run: its metrics, router figures (pdserve only) and records."""

    name: str
    url: str
    metrics: ServeMetrics
    router: RouterFigures | None
    records: tuple[RequestRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "metrics": self.metrics.to_json(),
            "router": self.router.to_json() if self.router else None,
            "records": [r.to_json() for r in self.records],
        }


def bench_system(
    name: str,
    base: str,
    requests: Sequence[Request],
    args: argparse.Namespace,
    slos: dict[str, float],
    router_metrics: bool,
    key: str = "",
) -> SystemResult:
    """Runs the workload against ``base`` (with API key ``key``) and computes its numbers
    (exit 2 if unreachable)."""
    from pdserve.bench.serve_metrics import compute_metrics, router_figures

    check_target(base, args.model, key)
    scraped: dict[str, Any] = {}

    def before_measuring() -> None:
        scraped["before"] = scrape(base, key) if router_metrics else None
        scraped["t0"] = time.monotonic()

    records = asyncio.run(_run_async(base, args.model, requests, args, name, before_measuring, key))
    _say(f"{name}: {len(records)} requests in {time.monotonic() - scraped['t0']:.1f}s")
    before = scraped["before"]
    after = scrape(base, key) if before is not None else None
    router = router_figures(before, after) if before is not None and after is not None else None
    if router is not None and not (router.prompt_tokens or router.phase_count):
        router = None
    _print_errors(name, records)
    return SystemResult(name, base, compute_metrics(records, slos), router, tuple(records))


def _print_errors(name: str, records: Sequence[RequestRecord]) -> None:
    errors = [r for r in records if r.error]
    if not errors:
        return
    _say(f"{name}: {len(errors)} of {len(records)} requests failed; first errors:")
    for r in errors[:MAX_ERRORS_SHOWN]:
        _say(f"  request {r.index}: {r.error}")


# --- output ---------------------------------------------------------------------------------


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<48}{value}"


def format_result(res: SystemResult) -> str:
    """vllm bench serve's result table, plus the prefix-cache and router figures."""
    m = res.metrics
    out = [f"{' Serving Benchmark Result: ' + res.name + ' ':=^58}"]
    out += [
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Benchmark duration (s):", m.duration_s),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in m.slos_ms.items())
        out.append(_line("Request goodput (req/s):", m.goodput))
        out.append(_line("  SLOs met by:", f"{m.good_requests} requests ({slos})"))
    out += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for title, short, dist in (
        ("Time to First Token", "TTFT", m.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
        ("Inter-token Latency", "ITL", m.itl_ms),
        ("End-to-end Latency", "E2EL", m.e2el_ms),
    ):
        out.append(f"{title:-^58}")
        for stat in ("mean", "median", "p90", "p99", "std"):
            out.append(_line(f"{stat.capitalize()} {short} (ms):", float(getattr(dist, stat))))
    out.append(f"{'Prefix cache':-^58}")
    cached = "n/a (not reported)" if m.cached_tokens is None else m.cached_tokens
    out.append(_line("Prompt tokens served from cache (usage):", cached))
    if m.cached_tokens is not None and m.total_input_tokens:
        out.append(_line("  share of prompt tokens:", m.cached_tokens / m.total_input_tokens))
    if res.router is not None:
        out.append(f"{'pdserve router (/metrics deltas)':-^58}")
        for source, n in res.router.prompt_tokens.items():
            out.append(_line(f"Prompt tokens, source={source}:", int(n)))
        for phase, mean in res.router.phase_mean_s.items():
            count = int(res.router.phase_count[phase])
            out.append(_line(f"Mean {phase} time (ms, n={count}):", mean * 1000.0))
    out.append("=" * 58)
    return "\n".join(out)


#: (label, getter, higher is better) rows of the comparison.
_COMPARE_ROWS: tuple[tuple[str, str, bool], ...] = (
    ("goodput (req/s)", "goodput", True),
    ("request throughput (req/s)", "request_throughput", True),
    ("output throughput (tok/s)", "output_throughput", True),
    ("TTFT p50 (ms)", "ttft_ms.median", False),
    ("TTFT p99 (ms)", "ttft_ms.p99", False),
    ("TPOT p50 (ms)", "tpot_ms.median", False),
    ("TPOT p99 (ms)", "tpot_ms.p99", False),
    ("E2EL p50 (ms)", "e2el_ms.median", False),
)


def _get(m: ServeMetrics, path: str) -> float | None:
    value: Any = m
    for part in path.split("."):
        value = getattr(value, part)
    return None if value is None else float(value)


def comparison(a: SystemResult, b: SystemResult) -> list[dict[str, Any]]:
    """Rows ``{metric, a, b, ratio}`` with ratio = a / b (None when undefined)."""
    rows = []
    for label, path, higher in _COMPARE_ROWS:
        va, vb = _get(a.metrics, path), _get(b.metrics, path)
        if va is None or vb is None:
            continue
        ratio = va / vb if vb else None
        rows.append(
            {"metric": label, a.name: va, b.name: vb, "ratio": ratio, "higher_is_better": higher}
        )
    return rows


def format_comparison(a: SystemResult, b: SystemResult) -> str:
    head = f"{a.name} vs {b.name}: ratio = {a.name} / {b.name}"
    out = [f"{' ' + head + ' ':=^74}"]
    out.append(f"{'metric':<30}{a.name:>12}{b.name:>12}{'ratio':>9}  better")
    for row in comparison(a, b):
        ratio = row["ratio"]
        better = "higher" if row["higher_is_better"] else "lower"
        rtext = "n/a" if ratio is None else f"{ratio:.2f}x"
        out.append(
            f"{row['metric']:<30}{row[a.name]:>12.2f}{row[b.name]:>12.2f}{rtext:>9}  {better}"
        )
    ca, cb = a.metrics.cached_tokens, b.metrics.cached_tokens
    out.append(f"{'prompt tokens from cache':<30}{_opt(ca):>12}{_opt(cb):>12}")
    out.append("=" * 74)
    return "\n".join(out)


def _opt(v: int | None) -> str:
    return "n/a" if v is None else str(v)


def write_json(
    path: str, args: argparse.Namespace, requests: Sequence[Request], results: list[SystemResult]
) -> None:
    from dataclasses import asdict

    from pdserve.bench.workloads import workload_stats

    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = str(args.request_rate)
    doc: dict[str, Any] = {
        "config": config,
        "workload": asdict(workload_stats(requests)),
        "systems": [r.to_json() for r in results],
    }
    if len(results) == 2:
        doc["comparison"] = comparison(results[0], results[1])
    Path(path).write_text(json.dumps(doc, indent=1))


# --- main -----------------------------------------------------------------------------------


def _sigterm_as_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_cli(args: argparse.Namespace) -> int:
    """``pdserve bench serve``: exit 0, 1 (failed start / bad input) or 2 (unreachable)."""
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    t0 = time.monotonic()
    try:
        results = run(args)
    except BenchError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return exc.code
    except ValueError as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench serve: interrupted", file=sys.stderr)
        return 130
    _say(f"total wall time {time.monotonic() - t0:.1f}s")
    return 0 if all(r.metrics.completed for r in results) else 1


def run(args: argparse.Namespace) -> list[SystemResult]:
    """Runs every system of ``args`` in turn, prints and writes the results."""
    from pdserve.bench.serve_metrics import parse_goodput
    from pdserve.bench.workloads import workload_stats

    slos = parse_goodput(args.goodput or [])
    requests = build_workload(args)
    if not requests:
        raise BenchError("the workload has no requests")
    st = workload_stats(requests)
    _say(
        f"workload {args.workload}: {st.requests} requests, mean input {st.mean_input:.1f} "
        f"tokens, output {st.min_output}-{st.max_output} (mean {st.mean_output:.1f}), "
        f"arrivals over {st.span_s:.1f}s"
    )
    if args.compare == "colocated" and args.start_pdserve is None:
        _say("note: --target stays up while the baseline runs; make sure it is idle")
    results: list[SystemResult] = []
    starts = args.start_pdserve is not None or args.compare == "colocated"
    with logs_dir(args.keep_logs) if starts else contextlib.nullcontext(Path()) as work:
        if args.start_pdserve is not None:
            started = started_pdserve(args.start_pdserve, args.model, work, args.start_timeout)
            with started as (base, key):
                results.append(bench_system(args.label, base, requests, args, slos, True, key))
        else:
            key = args.api_key or os.environ.get("PDSERVE_API_KEY", "")
            results.append(bench_system(args.label, args.target, requests, args, slos, True, key))
        print(format_result(results[-1]), flush=True)
        if args.compare == "colocated":
            with started_colocated(args, work) as base:
                results.append(bench_system("colocated", base, requests, args, slos, False))
            print(format_result(results[-1]), flush=True)
            print(format_comparison(results[0], results[1]), flush=True)
    if args.json:
        write_json(args.json, args, requests, results)
        _say(f"wrote {args.json}")
    if args.plot_dir:
        from pdserve.bench.plots import write_plots

        paths = write_plots(args.plot_dir, {r.name: r.records for r in results}, args.window_s)
        _say(f"wrote {', '.join(str(p) for p in paths)}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["proxy"]:
        proxy_main(int(argv[1]), argv[2:])
        return 0
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
