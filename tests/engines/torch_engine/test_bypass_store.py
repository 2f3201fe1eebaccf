"""``bypass_store`` on the torch engine (engine.proto; the router's cold recompute of its KV
check): a request that bypasses the store reads nothing from it, writes nothing to it, and
still answers the tokens of a plain run, whatever the store holds and whatever handle it got."""

from __future__ import annotations

import asyncio

from pdserve.engines.torch_engine.engine import TorchEngine
from pdserve.requests import Sampling

CS = 16
GREEDY = Sampling(max_tokens=6, temperature=0.0)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + 9 + salt) % 500 + 5 for i in range(n)]


async def tokens(agen) -> tuple[list[int], tuple[int, int]]:
    events = [ev async for ev in agen]
    return [t for ev in events for t in ev.token_ids], (
        events[-1].loaded_tokens,
        events[-1].recomputed_tokens,
    )


def test_a_bypassing_request_neither_reads_nor_writes(eng: TorchEngine, memory_store, hf_greedy):
    toks = prompt(3 * CS + 5)
    expected = hf_greedy(toks, GREEDY.max_tokens)

    async def main() -> None:
        # a fresh prompt: computed, nothing written
        out = await eng.prefill("p1", toks, GREEDY, bypass_store=True)
        assert (out.cached_tokens, out.computed_tokens) == (0, len(toks))
        assert out.first_token_id == expected[0]
        got, counts = await tokens(eng.generate("g1", toks, GREEDY, bypass_store=True))
        assert (got, counts) == (expected, (0, len(toks)))
        assert memory_store.objects == {} and memory_store.reads == []

        # the store holds the prompt: a bypassing prefill and generation still read nothing
        stored = await eng.prefill("p2", toks, GREEDY)
        assert set(memory_store.objects) == {*stored.kv.chunk_keys, stored.kv.tail_key}
        memory_store.reads.clear()
        memory_store.writes.clear()
        out = await eng.prefill("p3", toks, GREEDY, bypass_store=True)
        assert (out.cached_tokens, out.first_token_id) == (0, expected[0])
        got, counts = await tokens(eng.generate("g2", toks, GREEDY, bypass_store=True))
        assert (got, counts) == (expected, (0, len(toks)))
        # a handle is not loaded either (read mode: prefill's first token still comes first)
        got, counts = await tokens(
            eng.generate(
                "g3",
                toks,
                GREEDY,
                kv=stored.kv,
                first_token_id=stored.first_token_id,
                bypass_store=True,
            )
        )
        assert (got, counts) == (expected, (0, len(toks)))
        assert memory_store.reads == [] and memory_store.writes == []

        # the control: without the flag the same generation loads the stored chunks
        got, counts = await tokens(eng.generate("g4", toks, GREEDY))
        assert (got, counts) == (expected, (3 * CS, 5))

    asyncio.run(main())
