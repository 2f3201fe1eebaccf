"""vLLM engine end to end: prefill in one process -> real KV store (master + node processes)
-> decode in another process equals Hugging Face greedy output (float32, in the test's
process) token for token; a corrupted chunk is recomputed; the load path is real; a
second request for a stored prompt (no handle, fresh process) loads all but its last token;
cache salts keep tenants apart in the store and in vLLM's own prefix cache.

Two vLLM engine processes run one after the other (2 cores): a prefill engine and a decode
engine, each through tests/engines/vllm_runner.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_runner import VLLM_ENGINE_MARKS, run_engine

pytestmark = VLLM_ENGINE_MARKS

CHUNK = 64
MAX_TOKENS = 8
# < 1 chunk, exact multiples of the chunk size, and in between
LENGTHS = [5, 40, 63, 64, 65, 100, 128, 129, 150, 192]
CORRUPT_LEN = 160  # 2 full chunks + tail; its second chunk gets flipped bytes
# prompts the decode engine asks again without a handle (stored by prefill, not by decode):
# exact multiples load the first chunk_size - 1 tokens of their last chunk
REUSE_LENGTHS = [128, 192, 129, 150]
REUSE_CORRUPT_LEN = 128  # re-asked like the above, but its partially loaded last chunk is flipped
SALTED_LEN = 150  # asked by tenants with different cache salts, never without one


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1234)
    # distinct random prompts, so no prompt reuses another's chunks
    out = {f"len{n}": [rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS}
    out["corrupt"] = [rng.randrange(3, 500) for _ in range(CORRUPT_LEN)]
    out.update({f"reuse{n}": [rng.randrange(3, 500) for _ in range(n)] for n in REUSE_LENGTHS})
    out["reuse_corrupt"] = [rng.randrange(3, 500) for _ in range(REUSE_CORRUPT_LEN)]
    return out


def _salted_prompt() -> list[int]:
    return [random.Random(99).randrange(3, 500) for _ in range(SALTED_LEN)]


def _salted(mode: str, name: str, salt: str, **kw: Any) -> dict[str, Any]:
    """A job on the salted prompt (kept out of ``_prompts``: nothing stores it unsalted)."""
    return {"mode": mode, "id": f"salted-{name}", "prompt": _salted_prompt(),
            "max_tokens": MAX_TOKENS, "cache_salt": salt, **kw}  # fmt: skip


def _flip_chunk_bytes(master: str, key: str) -> None:
    """Replaces a stored chunk by a copy with flipped payload bytes (objects are immutable:
    remove, then put the corrupted bytes under the same key)."""
    from pdserve.kvformat import HEADER_SIZE
    from pdserve.store import open_store

    client = open_store(master)
    try:
        data = client.get(key)
        assert data is not None, f"chunk {key} is not in the store"
        bad = bytearray(data)
        for off in (HEADER_SIZE + 17, HEADER_SIZE + len(bad) // 3, len(bad) - 5):
            bad[off] ^= 0xFF
        assert client.remove([key]) == 1
        assert client.put(key, bytes(bad))
        assert client.get(key) == bytes(bad)
    finally:
        client.close()


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from pdserve.model.prepare import build_tiny_model
    from pdserve.procs import local_store

    build_tiny_model()
    tmp = tmp_path_factory.mktemp("vllm_pd")
    with local_store(tmp / "logs", segment_size="64MiB") as (master, _node):
        prompts = _prompts()
        base = {
            "model": "tiny",
            "chunk_size": CHUNK,
            "vllm_block_size": 32,
            "kv_dtype": "float32",  # token-exact against the torch engine and HF
            "max_model_len": 512,
            "max_num_seqs": 4,
            "vllm_kv_cache_gib": 1,
            # decode starts in a fresh process (tens of seconds): keep the tails alive
            "tail_ttl_ms": 900_000,
        }
        stored = {**base, "store_master": master.info["grpc"]}

        def jobs(mode: str, extra: dict[str, dict] | None = None) -> list[dict]:
            return [
                {"mode": mode, "id": f"{mode}-{k}", "prompt": p, "max_tokens": MAX_TOKENS,
                 **(extra or {}).get(k, {})}
                for k, p in prompts.items()
            ]  # fmt: skip

        n = len(prompts)
        # tenant A stores the salted prompt; B, then A again, ask for it in the same process
        salted_prefill = [
            _salted("prefill", "a", "tenant-a"),
            _salted("single", "b", "tenant-b"),
            _salted("single", "a-again", "tenant-a"),
        ]
        prefill = run_engine(tmp, "prefill", stored, [*jobs("prefill"), *salted_prefill])
        by_key = dict(zip(prompts, prefill[:n], strict=True))
        salted = {r["id"][len("salted-") :]: r for r in prefill[n:]}
        _flip_chunk_bytes(master.info["grpc"], by_key["corrupt"]["kv"]["chunk_keys"][1])
        _flip_chunk_bytes(master.info["grpc"], by_key["reuse_corrupt"]["kv"]["chunk_keys"][-1])
        handles = {k: {"kv": r["kv"], "first": r["first"]} for k, r in by_key.items()}
        # reuse prompts: a plain generate (no handle) that finds the prompt's chunks by key
        decode_jobs = [
            {**j, "mode": "single", "id": f"reuse-{k}"} if k.startswith("reuse") else j
            for k, j in zip(prompts, jobs("decode", handles), strict=True)
        ]
        # a fresh process: A decodes with its handle, then tenant C and no salt ask plainly
        handle_a = {"kv": salted["a"]["kv"], "first": salted["a"]["first"]}
        salted_decode = [
            _salted("decode", "decode-a", "tenant-a", **handle_a),
            _salted("single", "c", "tenant-c"),
            _salted("single", "none", ""),
        ]
        decode = run_engine(tmp, "decode", stored, [*decode_jobs, *salted_decode])
        salted.update({r["id"][len("salted-") :]: r for r in decode[n:]})
        yield {
            "prompts": prompts,
            # the ground truth: Hugging Face greedy decoding in float32, in this process
            "want": _hf_greedy({**prompts, "salted": _salted_prompt()}),
            "prefill": by_key,
            "decode": dict(zip(prompts, decode[:n], strict=True)),
            "salted": salted,
            "runs": {"prefill": prefill, "decode": decode},
        }


def _hf_greedy(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.model.prepare import build_tiny_model

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for k, p in prompts.items():
            ids = torch.tensor([p])
            gen = model.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS
            )
            out[k] = gen[0, len(p) :].tolist()
    return out


def test_prefill_store_decode_is_token_exact(pd_run: dict[str, Any]) -> None:
    for k in pd_run["prompts"]:
        want = pd_run["want"][k]
        assert len(want) == MAX_TOKENS
        assert pd_run["prefill"][k]["first"] == want[0], k
        assert pd_run["decode"][k]["tokens"] == want, k


def test_decode_loads_the_whole_prompt_and_computes_one_token(pd_run: dict[str, Any]) -> None:
    """Control: the load path is real. Each prompt is distinct, so the decode engine has
    nothing in vLLM's local prefix cache: every prompt token it did not compute came from
    the store (full chunks + the request's tail), and it computed only the first token's
    position."""
    for k, prompt in pd_run["prompts"].items():
        if k == "corrupt" or k.startswith("reuse"):
            continue
        pre, dec = pd_run["prefill"][k], pd_run["decode"][k]
        assert pre["cached"] == 0 and pre["computed"] == len(prompt), (k, pre)
        assert len(pre["kv"]["chunk_keys"]) == len(prompt) // CHUNK
        assert bool(pre["kv"]["tail_key"]) == (len(prompt) % CHUNK != 0)
        assert dec["loaded"] == len(prompt), (k, dec)
        assert dec["recomputed"] == 0, (k, dec)


def test_corrupted_chunk_is_recomputed_token_exact(pd_run: dict[str, Any]) -> None:
    dec = pd_run["decode"]["corrupt"]
    assert dec["tokens"] == pd_run["want"]["corrupt"]
    # chunk 0 loaded; from the flipped chunk 1 on (incl. the tail) vLLM recomputed
    assert dec["loaded"] == CHUNK, dec
    assert dec["recomputed"] == CORRUPT_LEN - CHUNK, dec


def test_stored_prompt_loads_all_but_its_last_token(pd_run: dict[str, Any]) -> None:
    """A fresh engine process asked for a prompt the prefill engine stored (no handle, nothing
    in its local prefix cache) loads every stored chunk by key, the one holding the last
    prompt token only up to that token: a chunk-multiple prompt (and one a token past it)
    computes 1 token; any other length computes its partial tail."""
    for n in REUSE_LENGTHS:
        k = f"reuse{n}"
        pre, again = pd_run["prefill"][k], pd_run["decode"][k]
        assert pre["cached"] == 0 and len(pre["kv"]["chunk_keys"]) == n // CHUNK, (k, pre)
        want = n - 1 if n % CHUNK in (0, 1) else n - n % CHUNK
        assert again["loaded"] == want, (k, again)
        assert again["recomputed"] == n - want, (k, again)  # what it computed: the rest
        assert again["tokens"] == pd_run["want"][k], k


def test_corrupted_partially_loaded_chunk_is_recomputed_token_exact(
    pd_run: dict[str, Any],
) -> None:
    again = pd_run["decode"]["reuse_corrupt"]
    assert again["tokens"] == pd_run["want"]["reuse_corrupt"]
    # chunk 0 loaded; the flipped last chunk (planned up to the last prompt token) and the
    # last prompt token computed
    assert again["loaded"] == CHUNK, again
    assert again["recomputed"] == REUSE_CORRUPT_LEN - CHUNK, again


def test_cache_salt_isolates_the_store_and_vllms_own_prefix_cache(pd_run: dict[str, Any]) -> None:
    s = pd_run["salted"]
    want = pd_run["want"]["salted"]
    n = SALTED_LEN
    assert s["a"]["first"] == want[0] and s["a"]["cached"] == 0
    # B, in the process that just computed A's prompt: neither A's stored chunks nor A's
    # blocks in vLLM's own cache are B's; it computes everything
    assert s["b"]["tokens"] == want
    assert (s["b"]["loaded"], s["b"]["prefix_cached"], s["b"]["recomputed"]) == (0, 0, n)
    # A again: its own entries (vLLM's local cache holds A's first 4 blocks of 32 tokens)
    assert s["a-again"]["tokens"] == want
    assert s["a-again"]["loaded"] + s["a-again"]["prefix_cached"] == 2 * CHUNK, s["a-again"]
    # a fresh process: A's handle loads A's whole prompt (salted keys, salted tail) ...
    assert s["decode-a"]["tokens"] == want
    assert (s["decode-a"]["loaded"], s["decode-a"]["recomputed"]) == (n, 0), s["decode-a"]
    # ... while tenant C and an unsalted request find nothing (A's and B's keys are not theirs)
    for name in ("c", "none"):
        assert s[name]["tokens"] == want, name
        assert (s[name]["loaded"], s[name]["prefix_cached"], s[name]["recomputed"]) == (0, 0, n)


def test_the_connectors_store_metrics_reach_the_workers_process(pd_run: dict[str, Any]) -> None:
    """The connector saves and loads in vLLM's engine-core process, whose registry nobody
    serves: its store metrics are relayed to the worker's process, which serves /metrics."""
    runs = pd_run["runs"]
    prefill, decode = (runs[k][-1]["store_metrics"] for k in ("prefill", "decode"))
    stored_chunks = sum(len(r["kv"]["chunk_keys"]) for r in pd_run["prefill"].values())
    assert prefill["chunks_written"] >= stored_chunks > 0, prefill
    assert prefill["save_ops"] > 0 and prefill["lookup_ops"] > 0, prefill
    assert decode["load_ops"] > 0 and decode["lookup_ops"] > 0, decode
    assert prefill["errors"] == decode["errors"] == 0
