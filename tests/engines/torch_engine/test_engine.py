"""The torch reference engine on the tiny model with an in-memory store (chunk_size 16)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import hashing
from pdserve.engines.torch_engine.engine import TorchEngine
from pdserve.errors import InvalidArgument
from pdserve.requests import Finish, KVRef, Sampling
from pdserve.telemetry import REGISTRY

CS = 16
GREEDY = Sampling(max_tokens=12, temperature=0.0)
#: shorter than a chunk, exact multiples, and in between
LENGTHS = [1, 5, 15, 16, 17, 31, 32, 33, 48, 50]


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 500 + 5 for i in range(n)]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def collect(agen) -> tuple[list[int], str, list]:
    events = [ev async for ev in agen]
    return [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events), events


def split_run(
    eng: TorchEngine,
    toks: list[int],
    sampling: Sampling = GREEDY,
    rid: str = "r",
    cache_salt: str = "",
):
    async def go():
        out = await eng.prefill(rid, toks, sampling, cache_salt=cache_salt)
        ids, text, events = await collect(
            eng.generate(
                rid,
                toks,
                sampling,
                kv=out.kv,
                first_token_id=out.first_token_id,
                cache_salt=cache_salt,
            )
        )
        return out, ids, text, events

    return asyncio.run(go())


def local_run(eng: TorchEngine, toks: list[int], sampling: Sampling = GREEDY, cache_salt=""):
    return asyncio.run(collect(eng.generate("local", toks, sampling, cache_salt=cache_salt)))


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_store_decode_is_token_exact(eng, memory_store, hf_greedy, n: int) -> None:
    toks = prompt(n)
    expected = hf_greedy(toks, GREEDY.max_tokens)
    out, ids, _text, events = split_run(eng, toks)
    assert ids == expected
    assert out.first_token_id == expected[0]
    assert (out.cached_tokens, out.computed_tokens) == (0, n)
    assert len(out.kv.chunk_keys) == n // CS
    assert bool(out.kv.tail_key) == bool(n % CS)
    assert (events[-1].loaded_tokens, events[-1].recomputed_tokens) == (n, 0)
    assert set(memory_store.objects) == {*out.kv.chunk_keys, *([out.kv.tail_key] * bool(n % CS))}
    # and local prefill on the decode side gives the same tokens
    assert local_run(eng, toks)[0] == expected


def test_reuse_loads_exactly_the_shared_chunks(eng, memory_store, hf_greedy) -> None:
    first = prompt(3 * CS + 5)
    second = first[: 2 * CS] + prompt(CS + 7, salt=11)
    out1, _, _, _ = split_run(eng, first, rid="a")
    memory_store.reads.clear()
    memory_store.writes.clear()
    out2, ids, _, events = split_run(eng, second, rid="b")
    assert out2.kv.chunk_keys[:2] == out1.kv.chunk_keys[:2]
    assert out2.kv.chunk_keys[2] != out1.kv.chunk_keys[2]
    assert (out2.cached_tokens, out2.computed_tokens) == (2 * CS, len(second) - 2 * CS)
    prefill_reads = memory_store.reads[:2]
    assert prefill_reads == list(out1.kv.chunk_keys[:2])
    # prefill wrote only the new chunk and the tail; decode read everything once
    assert memory_store.writes == [out2.kv.chunk_keys[2], out2.kv.tail_key]
    assert memory_store.reads[2:] == [*out2.kv.chunk_keys, out2.kv.tail_key]
    assert events[-1].loaded_tokens == len(second)
    assert ids == hf_greedy(second, GREEDY.max_tokens)


def test_cache_salts_keep_tenants_chunks_apart_and_tokens_identical(
    eng, memory_store, hf_greedy
) -> None:
    toks = prompt(2 * CS + 7, salt=5)
    expected = hf_greedy(toks, GREEDY.max_tokens)
    a1, ids_a1, _, _ = split_run(eng, toks, rid="a1", cache_salt="tenant-a")
    b, ids_b, _, ev_b = split_run(eng, toks, rid="b", cache_salt="tenant-b")
    a2, ids_a2, _, _ = split_run(eng, toks, rid="a2", cache_salt="tenant-a")
    assert ids_a1 == ids_b == ids_a2 == expected
    # B found none of A's chunks (its own keys), computed everything and stored its own
    assert (a1.cached_tokens, b.cached_tokens, a2.cached_tokens) == (0, 0, 2 * CS)
    assert b.computed_tokens == len(toks) and ev_b[-1].loaded_tokens == len(toks)
    assert not set(b.kv.chunk_keys) & set(a1.kv.chunk_keys)
    assert a2.kv.chunk_keys == a1.kv.chunk_keys
    assert set(b.kv.chunk_keys) <= set(memory_store.objects)
    # no salt: the shared chain, where neither tenant's chunks are
    ids, _, events = local_run(eng, toks)
    assert ids == expected and events[-1].loaded_tokens == 0
    assert local_run(eng, toks, cache_salt="tenant-b")[2][-1].loaded_tokens == 2 * CS

    # A's handle presented with B's salt does not match B's keys: ignored, recomputed
    async def stolen():
        return await collect(
            eng.generate(
                "s", toks, GREEDY, kv=a1.kv, first_token_id=a1.first_token_id, cache_salt="c"
            )
        )

    ids, _, events = asyncio.run(stolen())
    assert ids == expected
    assert (events[-1].loaded_tokens, events[-1].recomputed_tokens) == (0, len(toks))


def test_fully_cached_multiple_of_chunk_computes_only_last_token(eng, hf_greedy) -> None:
    toks = prompt(2 * CS)
    split_run(eng, toks, rid="x")
    out, ids, _, _ = split_run(eng, toks, rid="y")
    assert (out.cached_tokens, out.computed_tokens) == (2 * CS - 1, 1)
    assert ids == hf_greedy(toks, GREEDY.max_tokens)


def test_corrupt_chunk_is_recomputed_token_exact(eng, memory_store, hf_greedy) -> None:
    toks = prompt(3 * CS + 4)
    expected = hf_greedy(toks, GREEDY.max_tokens)

    async def go():
        out = await eng.prefill("c", toks, GREEDY)
        memory_store.corrupt(out.kv.chunk_keys[1])
        return await collect(
            eng.generate("c", toks, GREEDY, kv=out.kv, first_token_id=out.first_token_id)
        )

    before = metric("pdserve_kv_chunk_misses_total", kind="chunk")
    ids, _, events = asyncio.run(go())
    assert ids == expected
    assert memory_store.corrupt_reads == 1
    assert (events[-1].loaded_tokens, events[-1].recomputed_tokens) == (CS, len(toks) - CS)
    assert metric("pdserve_kv_chunk_misses_total", kind="chunk") == before + 1


def test_missing_tail_and_foreign_handle_are_recomputed(eng, memory_store, hf_greedy) -> None:
    toks = prompt(2 * CS + 9)
    other = prompt(2 * CS + 9, salt=3)
    expected = hf_greedy(toks, GREEDY.max_tokens)

    async def go():
        out = await eng.prefill("t", toks, GREEDY)
        del memory_store.objects[out.kv.tail_key]
        missing_tail = await collect(
            eng.generate("t", toks, GREEDY, kv=out.kv, first_token_id=out.first_token_id)
        )
        foreign = await eng.prefill("o", other, GREEDY)
        mismatched = await collect(
            eng.generate("t", toks, GREEDY, kv=foreign.kv, first_token_id=out.first_token_id)
        )
        return missing_tail, mismatched

    (ids1, _, ev1), (ids2, _, ev2) = asyncio.run(go())
    assert ids1 == expected and ids2 == expected
    assert (ev1[-1].loaded_tokens, ev1[-1].recomputed_tokens) == (2 * CS, 9)
    assert (ev2[-1].loaded_tokens, ev2[-1].recomputed_tokens) == (0, len(toks))


def test_store_unavailable_recomputes_and_counts(eng, memory_store, hf_greedy) -> None:
    toks = prompt(2 * CS + 3)
    memory_store.down = True

    def errors() -> float:
        return sum(
            metric("pdserve_kv_store_errors_total", op=op) for op in ("lookup", "load", "save")
        )

    before = errors()
    out, ids, _, events = split_run(eng, toks)
    assert ids == hf_greedy(toks, GREEDY.max_tokens)
    assert (out.cached_tokens, out.computed_tokens) == (0, len(toks))
    assert events[-1].recomputed_tokens == len(toks)
    # one failed call, then the store is paused (no timeout per operation or request)
    assert errors() - before == 1
    assert eng.chunks is not None and not eng.chunks.available()


@pytest.mark.parametrize(
    ("toks", "sampling", "field"),
    [
        ([], GREEDY, "prompt"),
        ([1, 2, 512], GREEDY, "vocabulary"),
        (prompt(250), Sampling(max_tokens=10), "context"),
        ([1, 2], Sampling(max_tokens=0), "max_tokens"),
        ([1, 2], Sampling(top_p=0.0), "top_p"),
    ],
)
def test_bad_input_is_invalid_argument(eng, toks, sampling, field) -> None:
    with pytest.raises(InvalidArgument, match=field):
        asyncio.run(eng.prefill("bad", toks, sampling))

    async def gen():
        return [ev async for ev in eng.generate("bad", toks, sampling)]

    with pytest.raises(InvalidArgument, match=field):
        asyncio.run(gen())


def test_seeded_sampling_is_reproducible_across_split(eng) -> None:
    toks = prompt(CS + 6)
    s = Sampling(max_tokens=10, temperature=1.5, top_p=0.9, top_k=50, seed=1234)
    _, split_ids, _, _ = split_run(eng, toks, s)
    local_ids = local_run(eng, toks, s)[0]
    assert split_ids == local_ids
    other = local_run(eng, toks, Sampling(max_tokens=10, temperature=1.5, seed=99))[0]
    assert other != local_ids  # the seed matters (hot temperature on random weights)
    # top_k=1 sampling is greedy whatever the temperature
    assert (
        local_run(eng, toks, Sampling(max_tokens=10, temperature=2.0, top_k=1, seed=5))[0]
        == local_run(eng, toks, Sampling(max_tokens=10, temperature=0.0))[0]
    )


def test_max_tokens_stop_strings_and_eos(eng) -> None:
    toks = prompt(20)
    ids, text, events = local_run(
        eng, toks, Sampling(max_tokens=7, temperature=0.0, ignore_eos=True)
    )
    assert len(ids) == 7 and events[-1].finish == Finish.LENGTH
    assert all(ev.finish is None for ev in events[:-1])
    assert text == eng.decode_text(ids)
    times = [t for ev in events for t in ev.times_ms]
    assert len(times) == 7 and times == sorted(times)
    # a stop string taken from the middle of the greedy text ends generation before it
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.index(stop)
    ids2, text2, events2 = local_run(
        eng, toks, Sampling(max_tokens=7, temperature=0.0, ignore_eos=True, stop=(stop,))
    )
    assert text2 == text[:cut] and events2[-1].finish == Finish.STOP
    assert ids2 == ids[: len(ids2)]

    # EOS as the first token (forced through a prefill handle) ends at once
    async def eos_first():
        out = await eng.prefill("e", toks, GREEDY)
        return await collect(
            eng.generate("e", toks, GREEDY, kv=out.kv, first_token_id=eng.eos_token_id)
        )

    ids3, text3, events3 = asyncio.run(eos_first())
    assert ids3 == [eng.eos_token_id] and events3[-1].finish == Finish.EOS and text3 == ""


def test_cancel_frees_the_slot(eng) -> None:
    toks = prompt(10)

    async def go():
        agen = eng.generate(
            "long", toks, Sampling(max_tokens=200, temperature=0.0, ignore_eos=True)
        )
        got = [await agen.__anext__(), await agen.__anext__()]
        await agen.aclose()
        for _ in range(200):
            if eng.load().running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return got, eng.load()

    got, load = asyncio.run(go())
    assert len(got) == 2 and load.running_requests == 0 and load.queue_length == 0


def test_concurrent_generations_interleave_and_stay_exact(eng, hf_greedy) -> None:
    prompts = [prompt(n, salt=n) for n in (4, 20, 37)]

    async def go():
        return await asyncio.gather(
            *(collect(eng.generate(f"c{i}", p, GREEDY)) for i, p in enumerate(prompts))
        )

    results = asyncio.run(go())
    for p, (ids, _, _) in zip(prompts, results, strict=True):
        assert ids == hf_greedy(p, GREEDY.max_tokens)


def test_kvref_for_other_chunk_size_is_ignored(eng, hf_greedy) -> None:
    toks = prompt(CS + 3)
    out, _, _, _ = split_run(eng, toks)
    bogus = KVRef(out.kv.chunk_keys, out.kv.tail_key, out.kv.num_tokens, 32, out.kv.fingerprint)

    async def go():
        return await collect(
            eng.generate("k", toks, GREEDY, kv=bogus, first_token_id=out.first_token_id)
        )

    ids, _, events = asyncio.run(go())
    assert ids == hf_greedy(toks, GREEDY.max_tokens)
    assert events[-1].loaded_tokens == 0


def test_write_mode_prefix_handle_without_first_token(eng, hf_greedy) -> None:
    """The router's write mode: decode gets the keys of the first (n - 1) // chunk_size chunks
    and no first token; it loads those and computes the rest itself."""
    toks = prompt(2 * CS + 6)
    exact = prompt(2 * CS, salt=1)

    async def go(p: list[int]):
        out = await eng.prefill("w", p, GREEDY, publish_incrementally=True)
        k = (len(p) - 1) // CS
        handle = KVRef(out.kv.chunk_keys[:k], "", k * CS, CS, out.kv.fingerprint)
        return await collect(eng.generate("w", p, GREEDY, kv=handle, chunk_wait_ms=50))

    for p in (toks, exact):
        ids, _, events = asyncio.run(go(p))
        k = (len(p) - 1) // CS
        assert ids == hf_greedy(p, GREEDY.max_tokens)
        assert (events[-1].loaded_tokens, events[-1].recomputed_tokens) == (k * CS, len(p) - k * CS)


def test_write_mode_wait_keeps_other_streams_decoding(eng, memory_store, hf_greedy) -> None:
    """A write-mode generation whose chunks are not published yet waits off the model's
    thread: a stream already running decodes to its end meanwhile, and only then are the
    chunks published (by a prefill on the same engine, which the wait must not block either);
    the waiting generation loads them and is token-exact. Ordering only, no timing: were the
    wait on the model's thread, the running stream would stall until the wait expired, and
    the waiting generation would then recompute (loaded 0) before that stream's end."""
    running = prompt(9, salt=5)
    toks = prompt(3 * CS + 5, salt=6)
    k = (len(toks) - 1) // CS
    keys = hashing.chunk_keys(eng.fingerprint, toks)
    handle = KVRef(tuple(keys[:k]), "", k * CS, CS, eng.fingerprint.digest())
    long = Sampling(max_tokens=30, temperature=0.0)
    order: list[str] = []

    async def go():
        stream = eng.generate("running", running, long)
        first = await stream.__anext__()
        order.append("running")
        waiting = asyncio.ensure_future(
            collect(eng.generate("w", toks, GREEDY, kv=handle, chunk_wait_ms=30_000))
        )
        rest = [ev async for ev in stream]
        order.extend("running" for ev in rest if ev.token_ids)
        assert not waiting.done() and not memory_store.exists(keys[:1])[0]
        await eng.prefill("p", toks, GREEDY, publish_incrementally=True)
        ids, _, events = await waiting
        order.extend("waiting" for ev in events if ev.token_ids)
        return [t for ev in [first, *rest] for t in ev.token_ids], ids, events

    running_ids, ids, events = asyncio.run(go())
    assert running_ids == hf_greedy(running, long.max_tokens) and len(running_ids) > 1
    assert order == ["running"] * len(running_ids) + ["waiting"] * len(ids)
    assert ids == hf_greedy(toks, GREEDY.max_tokens)
    assert (events[-1].loaded_tokens, events[-1].recomputed_tokens) == (k * CS, len(toks) - k * CS)


def test_prompt_counts_come_with_the_last_event_only(eng) -> None:
    """TokenEvent's contract (DecodeResponse in engine.proto): loaded, recomputed and prefix
    cached tokens are on the event with ``finish`` and 0 on every other; they add up to the
    prompt's length, from a handle and in a local prefill alike."""
    toks = prompt(40, salt=77)
    _out, _ids, _text, with_handle = split_run(eng, toks, rid="counts")
    _ids, _text, local = local_run(eng, toks)  # finds 2 of its chunks stored by the prefill
    for events, loaded in ((with_handle, 40), (local, 2 * CS)):
        assert len(events) == GREEDY.max_tokens and events[-1].finish is not None
        assert all(
            (e.loaded_tokens, e.recomputed_tokens, e.prefix_cached_tokens) == (0, 0, 0)
            for e in events[:-1]
        )
        last = events[-1]
        assert (last.loaded_tokens, last.recomputed_tokens) == (loaded, 40 - loaded)
        assert last.loaded_tokens + last.recomputed_tokens + last.prefix_cached_tokens == 40


def test_kv_usage_is_the_kv_bytes_held_over_the_capacity(eng) -> None:
    """Load.kv_usage on the torch engine: the bytes of KV its running generations hold
    (prompt + output so far, float32 K and V of every layer) over max_num_seqs contexts of
    max_model_len tokens (8 x 256 here); 0 once they end."""
    conf = eng.model.hf.config
    token_bytes = 2 * conf.num_hidden_layers * conf.num_key_value_heads * eng.model.head_dim * 4
    capacity = 8 * 256 * token_bytes
    toks = prompt(30)
    # many more tokens than are read, so the model's thread (which runs ahead of this
    # consumer) is very unlikely to have ended the job by the 18th read
    sampling = Sampling(max_tokens=120, temperature=0.0, ignore_eos=True)
    reads = 18

    async def go():
        held = []  # (tokens the usage stands for, running requests) at the first reads
        async for ev in eng.generate("usage", toks, sampling):
            if ev.finish is None and len(held) < reads:
                load = eng.load()
                held.append((load.kv_usage * capacity / token_bytes, load.running_requests))
        for _ in range(200):
            if eng.load().running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return held[1:], eng.load().kv_usage  # at the 1st the job may not run yet

    readings, after = asyncio.run(go())
    assert after == 0.0 and len(readings) == reads - 1
    # a reading of 0 is only right once the job has ended in the model's thread
    for tokens, running in readings:
        assert tokens > 0 or running == 0, readings
    during = [tokens for tokens, _ in readings if tokens > 0]
    assert during, readings
    # at the k-th token the context holds the prompt and at least k outputs (the model's
    # thread may have produced more already): a whole number of tokens' bytes
    for k, tokens in enumerate(during, start=2):
        assert abs(tokens - round(tokens)) < 1e-6, tokens
        assert len(toks) + k <= round(tokens) <= len(toks) + sampling.max_tokens, (k, tokens)
    assert during == sorted(during)
