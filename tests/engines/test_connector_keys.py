"""The vLLM connector's scheduler half keys a request's chunks by everything that shapes its
KV besides the tokens (pdserve/engines/connector_keys.py): one prompt under the base model,
adapter a, adapter b, a salt, and the salt with adapter a lives in five disjoint chains (looked
up and saved under them, each save tagged with its chain's root), so a chunk stored by one is
never loaded by another. Requests with multimodal inputs, prompt embeddings, an unreadable
adapter or ``bypass_store`` are neither looked up, loaded nor saved, and are counted and logged
once per reason. No engine: the scheduler is driven as vLLM drives it, with plain objects for
vLLM's requests and scheduler output (LoRA requests are vLLM's own ``LoRARequest``)."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from lora_adapter import make_lora_adapter
from vllm.lora.request import LoRARequest

from pdserve import hashing
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import PARAMS_KEY, ConnectorSettings
from pdserve.engines.connector_scheduler import ConnectorScheduler
from pdserve.model.fingerprint import adapter_identity
from pdserve.telemetry import REGISTRY

L, H, D, BS, CHUNK = 2, 2, 8, 4, 8
FP = hashing.ModelFingerprint(model_id="m", revision="r", kv_dtype="float32", chunk_size=CHUNK)
TOKENS = list(range(10, 10 + 3 * CHUNK + 5))  # 3 full chunks and a tail of 5
BASE_KEYS = hashing.chunk_keys(FP, TOKENS)


class _Recording:
    """The store, with every key the scheduler looked up, in order."""

    def __init__(self, store) -> None:
        self.store = store
        self.looked_up: list[str] = []

    def longest_prefix(self, keys):
        self.looked_up.extend(keys)
        return self.store.longest_prefix(keys)

    def exists(self, keys):
        return self.store.exists(keys)

    def close(self) -> None:
        pass


@pytest.fixture
def adapters(tmp_path):
    """Two adapters for one small Llama config: a, b (other bytes), and a copy of a."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 2}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    a = make_lora_adapter(model, tmp_path / "a", seed=1)
    b = make_lora_adapter(model, tmp_path / "b", seed=2)
    a_copy = shutil.copytree(a, tmp_path / "a-copy")
    return SimpleNamespace(a=a, b=b, a_copy=a_copy)


def _scheduler(store) -> tuple[ConnectorScheduler, _Recording]:
    recording = _Recording(store)
    settings = ConnectorSettings(master_address="", fingerprint=FP, tail_ttl_ms=1000)
    return ConnectorScheduler(settings, BS, ChunkIO(recording, FP)), recording


def _request(req_id: str, *, salt=None, lora=None, params=None, **inputs) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=TOKENS,
        cache_salt=salt,
        lora_request=lora,
        kv_transfer_params=params,
        mm_features=inputs.get("mm_features", []),
        prompt_embeds=inputs.get("prompt_embeds"),
    )


def _step(req: SimpleNamespace, computed: int = 0) -> SimpleNamespace:
    """A scheduler output that schedules all of ``req``'s prompt after ``computed`` tokens."""
    blocks = list(range(len(TOKENS) // BS + 1))
    new = SimpleNamespace(
        req_id=req.request_id,
        block_ids=[blocks],
        prompt_token_ids=TOKENS,
        num_computed_tokens=computed,
        lora_request=req.lora_request,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    return SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=[],
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: len(TOKENS) - computed},
    )


def _serve(sched: ConnectorScheduler, req: SimpleNamespace):
    """vLLM's calls for one request: arrival, lookup, its whole prompt in one step, its end.
    Returns (tokens the lookup matched, the step's saves, request_finished's params)."""
    sched.on_new_request(req)
    matched, _ = sched.get_num_new_matched_tokens(req, 0)
    meta = sched.build_connector_meta(_step(req))
    assert not meta.loads or matched
    _, params = sched.request_finished(req)
    return matched, meta.saves, params[PARAMS_KEY]


def _store_chunks(store, keys: list[str]) -> None:
    for i, key in enumerate(keys):
        torch.manual_seed(i)
        store.put_chunk(key, torch.randn(L, 2, H, CHUNK, D), FP.digest())


def test_base_adapters_and_salts_key_one_prompt_in_disjoint_chains(memory_store, adapters):
    sched, recording = _scheduler(memory_store)
    a = LoRARequest("a", 1, str(adapters.a))
    b = LoRARequest("b", 2, str(adapters.b))
    ida, idb = adapter_identity("a", str(adapters.a)), adapter_identity("b", str(adapters.b))
    cases = {  # name -> (request, the (salt, adapter) its chain must be)
        "base": (_request("base"), ("", "")),
        "a": (_request("a", lora=a), ("", ida)),
        "b": (_request("b", lora=b), ("", idb)),
        "salt": (_request("salt", salt="s"), ("s", "")),
        "salt+a": (_request("salt+a", salt="s", lora=a), ("s", ida)),
    }
    saved: dict[str, list[str]] = {}
    for name, (req, (salt, adapter)) in cases.items():
        recording.looked_up.clear()
        matched, saves, params = _serve(sched, req)
        expected = hashing.chunk_keys(FP, TOKENS, salt, adapter)
        assert (matched, params["loaded_tokens"]) == (0, 0), name
        assert recording.looked_up == expected, name  # looked up in its own chain only
        assert [s.key for s in saves] == expected, name  # and saved there
        root = hashing.chain_root(FP, salt, adapter).hex()
        assert {s.root for s in saves} == {root}, name
        saved[name] = expected
    assert saved["base"] == BASE_KEYS  # a request without adapter or salt: the keys it had
    for x, y in itertools.combinations(saved, 2):
        assert not set(saved[x]) & set(saved[y]), (x, y)
    assert len({hashing.chain_root(FP, *chain).hex() for _, chain in cases.values()}) == 5


def test_a_chunk_the_base_model_stored_is_never_loaded_through_an_adapter(memory_store, adapters):
    """The store holds the base model's chunks of the prompt: the base request loads them,
    the same prompt through an adapter finds none; the adapter's own chunks, once stored,
    load for that adapter (under another int id and path too: its identity is its name and
    bytes) and not for an adapter of the same name with other bytes."""
    sched, _ = _scheduler(memory_store)
    _store_chunks(memory_store, BASE_KEYS)
    assert _serve(sched, _request("base"))[0] == 3 * CHUNK
    a = LoRARequest("a", 1, str(adapters.a))
    matched, saves, _ = _serve(sched, _request("a", lora=a))
    assert matched == 0 and len(saves) == 3
    _store_chunks(memory_store, [s.key for s in saves])
    assert _serve(sched, _request("a2", lora=a))[0] == 3 * CHUNK
    same = LoRARequest("a", 7, str(adapters.a_copy))  # same name and bytes, another id/path
    assert _serve(sched, _request("a3", lora=same))[0] == 3 * CHUNK
    impostor = LoRARequest("a", 8, str(adapters.b))  # the name a, b's bytes
    assert _serve(sched, _request("a4", lora=impostor))[0] == 0


def test_an_adapter_reloaded_in_place_is_hashed_again(memory_store, adapters, tmp_path):
    sched, _ = _scheduler(memory_store)
    path = shutil.copytree(adapters.a, tmp_path / "live")
    before = sched._keys.adapter(LoRARequest("live", 3, str(path)))
    shutil.copy(adapters.b / "adapter_model.safetensors", path / "adapter_model.safetensors")
    assert sched._keys.adapter(LoRARequest("live", 3, str(path))) == before  # cached
    reload = LoRARequest("live", 3, str(path), load_inplace=True)
    assert sched._keys.adapter(reload) == adapter_identity("live", str(path)) != before
    assert sched._keys.adapter(LoRARequest("live", 3, str(path))) != before


def test_the_tail_of_a_stock_prefill_through_an_adapter_is_the_adapters(memory_store, adapters):
    sched, _ = _scheduler(memory_store)
    a = LoRARequest("a", 1, str(adapters.a))
    req = _request("p", lora=a, params={"do_remote_decode": True})
    _, saves, params = _serve(sched, req)
    ida = adapter_identity("a", str(adapters.a))
    tail = hashing.tail_key(FP, TOKENS, "p", "", ida)
    assert params["load_tail_key"] == tail != hashing.tail_key(FP, TOKENS, "p")
    assert saves[-1].key == tail and saves[-1].root == hashing.chain_root(FP, "", ida).hex()


def test_a_handed_tail_loads_only_in_the_chain_it_was_derived_in(memory_store, adapters):
    """A stock proxy hands the decode engine what the prefill engine answered: a tail derived
    in the base chain must not load into a request through an adapter (its chunks, stored in
    the adapter's own chain, still load), and a tail without its request id proves no chain."""
    sched, _ = _scheduler(memory_store)
    a = LoRARequest("a", 1, str(adapters.a))
    ida = adapter_identity("a", str(adapters.a))
    _store_chunks(memory_store, BASE_KEYS)
    _store_chunks(memory_store, hashing.chunk_keys(FP, TOKENS, "", ida))
    _, _, handed = _serve(sched, _request("p", params={"do_remote_decode": True}))
    assert handed["load_tail_rid"] == "p"
    tail = handed["load_tail_key"]
    memory_store.put_chunk(tail, torch.randn(L, 2, H, len(TOKENS) - 3 * CHUNK, D), FP.digest())
    params = {PARAMS_KEY: {k: v for k, v in handed.items() if k.startswith("load_tail")}}
    no_rid = {PARAMS_KEY: {k: v for k, v in params[PARAMS_KEY].items() if k != "load_tail_rid"}}
    matched = {
        name: sched.get_num_new_matched_tokens(req, 0)[0]
        for name, req in {
            "base": _request("d1", params=params),
            "a": _request("d2", lora=a, params=params),
            "a, no id": _request("d3", lora=a, params=no_rid),
            "base, no id": _request("d4", params=no_rid),
        }.items()
    }
    whole = len(TOKENS) - 1  # the last prompt token is always computed
    assert matched == {"base": whole, "a": 3 * CHUNK, "a, no id": 3 * CHUNK, "base, no id": whole}


def _bypassed(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "pdserve_kv_store_bypassed_requests_total", {"reason": reason}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("reason", "kw"),
    [
        ("multimodal", {"mm_features": [object()]}),
        ("prompt_embeds", {"prompt_embeds": torch.zeros(len(TOKENS), 16)}),
        ("requested", {"params": {PARAMS_KEY: {"bypass_store": True}}}),
        ("adapter_unreadable", {"lora": LoRARequest("gone", 9, "/nonexistent/adapter")}),
    ],
)
def test_a_request_the_chain_cannot_name_bypasses_the_store(memory_store, caplog, reason, kw):
    """Even with every chunk of its tokens stored: no lookup, no load, no save; counted, and
    logged once per reason."""
    sched, recording = _scheduler(memory_store)
    _store_chunks(memory_store, BASE_KEYS)
    before = _bypassed(reason)
    with caplog.at_level(logging.WARNING, logger="pdserve.engines.vllm_connector"):
        for i in range(2):
            req = _request(f"r{i}", **kw)
            matched, saves, params = _serve(sched, req)
            assert (matched, saves, params["loaded_tokens"]) == (0, [], 0)
            assert params["bypassed"] == reason
    assert recording.looked_up == []
    assert _bypassed(reason) == before + 2
    said = [r for r in caplog.records if "bypasses the store" in r.getMessage()]
    assert len(said) == 1, said
    # the request after them, with none of these inputs, loads as before
    assert _serve(sched, _request("plain"))[0] == 3 * CHUNK
