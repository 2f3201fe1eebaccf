"""The router's view of stock engines' own prefix caches from vLLM's KV events
(services/router/engine_events.py): batches built with vLLM's own event classes and encoder,
published by vLLM's own ``ZmqEventPublisher`` (with its replay socket), and placement that
follows the view."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdserve.procs import free_ports
from pdserve.services.router.engine_events import (
    EngineCache,
    EngineCaches,
    parse_engine_events,
)
from pdserve.services.router.policies import CacheAware, ColocatedPlacement, RouteContext
from pdserve.services.router.workers import DECODE, Worker

kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed")
msgspec = pytest.importorskip("msgspec")

BS = 16


def stored(hashes, parent, tokens, **extra) -> kv.BlockStored:
    return kv.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=extra.pop("lora_id", None),
        medium=extra.pop("medium", "GPU"),
        lora_name=extra.pop("lora_name", None),
        **extra,
    )


def wire(events) -> list:
    """A batch as the router gets it: vLLM's encoder, then an untyped msgpack decode."""
    batch = kv.KVEventBatch(ts=time.time(), events=events)
    return msgspec.msgpack.decode(msgspec.msgpack.Encoder().encode(batch))


def chain(tokens, start=b"", n_hash=0):
    """vLLM-like opaque hashes of each block of ``tokens`` (any distinct bytes will do: the
    view never recomputes them)."""
    return [bytes([n_hash]) + i.to_bytes(4, "big") + start for i in range(len(tokens) // BS)]


def test_stored_blocks_count_as_the_prompt_prefix_in_whole_blocks() -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(5 * BS + 3)]
    hashes = chain(prompt[: 4 * BS])
    cache = EngineCache("e")
    # two events: the first two blocks, then two more chained on the second
    cache.apply_batch(0, wire([stored(hashes[:2], None, prompt[: 2 * BS])]))
    cache.apply_batch(1, wire([stored(hashes[2:], hashes[1], prompt[2 * BS : 4 * BS])]))
    assert cache.cached_tokens(prompt) == 4 * BS
    assert cache.cached_tokens(prompt[:BS] + [7] * 4 * BS) == BS  # diverges in block 2
    assert cache.cached_tokens(prompt, cache_salt="tenant") == 0  # another tenant's chain
    cache.apply_batch(2, wire([kv.BlockRemoved(block_hashes=[hashes[2]], medium="GPU")]))
    assert cache.cached_tokens(prompt) == 2 * BS  # the evicted block ends the prefix
    cache.apply_batch(3, wire([kv.AllBlocksCleared()]))
    assert cache.cached_tokens(prompt) == 0 and len(cache) == 0


def test_what_the_view_cannot_place_it_leaves_out() -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(50_000) for _ in range(3 * BS)]
    hashes = chain(prompt)
    cache = EngineCache("e")
    # a block whose parent was never seen (subscribed late), a LoRA's, another medium's
    cache.apply_batch(0, wire([stored(hashes[1:], b"unseen", prompt[BS:])]))
    cache.apply_batch(1, wire([stored(hashes[:1], None, prompt[:BS], lora_name="adapter")]))
    cache.apply_batch(2, wire([stored(hashes[:1], None, prompt[:BS], medium="CPU")]))
    mm = [("img-digest", 0)]
    cache.apply_batch(3, wire([stored(hashes[:1], None, prompt[:BS], extra_keys=[tuple(mm)])]))
    assert len(cache) == 0 and cache.cached_tokens(prompt) == 0
    # a salted prompt: the salt is the first block's only extra key
    cache.apply_batch(4, wire([stored(hashes, None, prompt, extra_keys=[("t1",), None, None])]))
    assert cache.cached_tokens(prompt, cache_salt="t1") == 3 * BS
    assert cache.cached_tokens(prompt) == 0 and cache.cached_tokens(prompt, "t2") == 0


def test_sequence_numbers_report_gaps_and_a_restart_clears() -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(2 * BS)]
    hashes = chain(prompt)
    cache = EngineCache("e")
    assert cache.apply_batch(5, wire([stored(hashes, None, prompt)])) == 0
    assert cache.apply_batch(8, wire([])) == 2  # 6 and 7 never came
    assert cache.cached_tokens(prompt) == 2 * BS
    assert cache.apply_batch(0, wire([])) == 0  # numbering restarted: a fresh engine
    assert cache.cached_tokens(prompt) == 0


def test_engine_event_specs_are_checked() -> None:
    assert parse_engine_events(["http://h:8000=tcp://h:5557+tcp://h:5558"]) == {
        "http://h:8000": ("tcp://h:5557", "tcp://h:5558")
    }
    assert parse_engine_events(["http://h:8000=tcp://h:5557"])["http://h:8000"][1] == ""
    for bad, why in [
        ("h:8000=tcp://h:5557", "expected URL=ENDPOINT"),
        ("http://h:8000", "expected URL=ENDPOINT"),
        ("http://h:8000=h:5557", "not a tcp://"),
        ("http://h:8000=tcp://a+tcp://b+tcp://c", "expected URL=ENDPOINT"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_engine_events([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_engine_events(["http://h:1=tcp://a", "http://h:1=tcp://b"])


def test_router_config_refuses_events_of_an_engine_it_does_not_route_to() -> None:
    from pdserve.config import ConfigError
    from pdserve.services.router.config import RouterConfig

    cfg = RouterConfig(decode=["http://h:1"], engine_kv_events=["http://h:2=tcp://h:5557"])
    with pytest.raises(ConfigError, match="no --prefill or --decode address"):
        cfg.validate()


def _views(prompt: list[int], held_by: str, other: str) -> EngineCaches:
    engines = EngineCaches({held_by: ("tcp://x:1", ""), other: ("tcp://x:2", "")})
    engines.caches[held_by].apply_batch(0, wire([stored(chain(prompt), None, prompt)]))
    engines.caches[other].apply_batch(0, wire([]))
    return engines


def test_placement_goes_to_the_engine_whose_own_cache_holds_the_prefix() -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(50_000) for _ in range(20 * BS)]
    a, b = Worker("a", "http://a:1", DECODE), Worker("b", "http://b:1", DECODE)
    for holder in (a, b):
        other = b if holder is a else a
        engines = _views(prompt[: 16 * BS], holder.address, other.address)
        ctx = RouteContext(len(prompt), 0, prompt)
        assert ColocatedPlacement(engines=engines).choose([a, b], ctx, [], 0) is holder
        assert CacheAware(engines=engines).choose([a, b], ctx) is holder
        # busy enough, the holder loses: the prefix is worth 256 tokens, its queue more
        holder.inflight_tokens = 1000
        assert ColocatedPlacement(engines=engines).choose([a, b], ctx, [], 0) is other
        holder.inflight_tokens = 0
    # a view that has heard nothing yet falls back to the router's own picks
    engines = EngineCaches({a.address: ("tcp://x:1", "")})
    placement = ColocatedPlacement(engines=engines)
    placement.affinity.record("b", ["k1", "k2"])
    ctx = RouteContext(len(prompt), 0, prompt)
    assert placement.choose([a, b], ctx, ["k1", "k2"], BS) is b


def test_follower_reads_vllms_own_publisher_and_replays_what_came_before() -> None:
    """vLLM's ZmqEventPublisher publishes two batches before the router subscribes (the
    replay socket gives them) and more after (the live socket)."""
    pub_port, replay_port = free_ports(2)
    publisher = kv.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}"
    )
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(6 * BS)]
    hashes = chain(prompt)
    url = "http://engine:8000"

    def publish(events) -> None:
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))

    async def main() -> None:
        publish([stored(hashes[:2], None, prompt[: 2 * BS])])
        publish([stored(hashes[2:4], hashes[1], prompt[2 * BS : 4 * BS])])
        await asyncio.sleep(0.3)  # published (and buffered) before anyone listens
        engines = EngineCaches(
            parse_engine_events([f"{url}=tcp://127.0.0.1:{pub_port}+tcp://127.0.0.1:{replay_port}"])
        )
        cache = engines.caches[url]
        engines.start()
        try:
            await _until(lambda: cache.cached_tokens(prompt) == 4 * BS, "the replay")
            await asyncio.sleep(0.3)  # the subscription is live (ZMQ joins late)
            publish([stored(hashes[4:], hashes[3], prompt[4 * BS :])])
            await _until(lambda: cache.cached_tokens(prompt) == 6 * BS, "a live batch")
            publish([kv.BlockRemoved(block_hashes=hashes[3:], medium="GPU")])
            await _until(lambda: cache.cached_tokens(prompt) == 3 * BS, "a removal")
            assert cache.seq == 3
        finally:
            await engines.aclose()

    try:
        asyncio.run(main())
    finally:
        publisher.shutdown()


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_request_the_engine_holds_counts_only_its_uncached_work_on_it() -> None:
    """What a request costs its engine until its first token (the queued work placement sees
    next) is what that engine computes: the prefix it holds is free there."""
    from pdserve.services.router.place import Placer
    from pdserve.services.router.policies import DecodeChoice, LeastLoad
    from pdserve.services.router.workers import WorkerPool

    rng = random.Random(6)
    prompt = [rng.randrange(50_000) for _ in range(20 * BS)]
    a, b = Worker("a", "http://a:1", DECODE), Worker("b", "http://b:1", DECODE)
    engines = _views(prompt[: 16 * BS], a.address, b.address)
    placer = Placer(WorkerPool(), LeastLoad(), DecodeChoice(), ColocatedPlacement(engines=engines))
    ctx = RouteContext(len(prompt), 0, prompt)
    assert placer.prompt_work(a, ctx, [], 0) == 4 * BS
    assert placer.prompt_work(b, ctx, [], 0) == 20 * BS
    # without views: the prompt's tokens the store does not hold, on any worker
    plain = Placer(WorkerPool(), LeastLoad(), DecodeChoice(), ColocatedPlacement())
    assert plain.prompt_work(a, RouteContext(len(prompt), 3 * BS, prompt), [], 0) == 17 * BS


def test_new_prefixes_spread_over_idle_workers() -> None:
    """Ties (idle workers, a prompt none holds) go to the worker picked longest ago, not
    always to the first: otherwise every new prefix starts on the same engine."""
    workers = [Worker(n, f"http://{n}:1", DECODE) for n in ("a", "b", "c")]
    placement = ColocatedPlacement()
    picks = []
    for i in range(6):
        ctx = RouteContext(100, 0, [i] * 100)
        w = placement.choose(workers, ctx, [], 0)
        placement.record(w.id, [])
        picks.append(w.id)
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"], picks
