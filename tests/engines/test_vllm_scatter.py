"""The vLLM connector's batched scatter writes exactly what the per-block path writes, from
chunks read into the arena (a strided view, no copy) and from scattered tensors (stacked), in
the GPU backends' content layout and in the CPU ISAs' layouts (``amx`` interleaves tokens and
dims, so a block written in part is patched whole)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from pdserve import kvformat
from pdserve.engines import kv_layout
from pdserve.engines.chunk_io import ChunkIO
from pdserve.engines.connector_data import ChunkLoad
from pdserve.engines.connector_worker import ConnectorWorker
from pdserve.hashing import ModelFingerprint

L, H = 3, 2
#: (block size, head_dim, layout): the content layout at a toy size, and vLLM's CPU ISAs
LAYOUTS = {
    "content": lambda: kv_layout.content_layout(4, 8),
    "cpu-vec": lambda: kv_layout.cpu_layout(torch.bfloat16, 32, 32, "vec"),
    "cpu-amx": lambda: kv_layout.cpu_layout(torch.bfloat16, 32, 32, "amx"),
}


def _connector(layout: kv_layout.BlockLayout) -> ConnectorWorker:
    # The worker half alone, over plain tensors: no vLLM engine, no store behind it.
    fp = ModelFingerprint("m", kv_dtype="bfloat16", chunk_size=2 * layout.block_size)
    conn = ConnectorWorker(None, fp, fp, layout.block_size, ChunkIO(None, fp))
    conn._layout = layout
    conn._caches = [
        torch.zeros(16, H, layout.block_size, 2 * layout.head_dim, dtype=torch.bfloat16)
        for _ in range(L)
    ]
    return conn


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("in_arena", [True, False])
def test_batched_scatter_matches_per_block(in_arena: bool, name: str) -> None:
    if name == "cpu-amx" and not kv_layout.cpu_isa_runs("amx"):
        pytest.skip("this CPU's vLLM build does not run isa 'amx' (no AMX/AVX-512)")
    layout = LAYOUTS[name]()
    BS, D = layout.block_size, layout.head_dim
    CHUNK = 2 * BS
    fp = bytes(32)
    torch.manual_seed(0)
    kvs = [torch.randn(L, 2, H, CHUNK, D).to(torch.bfloat16) for _ in range(4)]
    # chunk 0 overlaps the local cache up to token 5 (inside a block); chunk 3 stops before the
    # last token; chunk 4 is a request's tail of 5 tokens, written whole.
    chunks = [
        ChunkLoad(f"k{i}", i * CHUNK, CHUNK, 5 if i == 0 else 0, (i + 1) * CHUNK - (i == 3))
        for i in range(4)
    ]
    kvs.append(torch.randn(L, 2, H, 5, D).to(torch.bfloat16))
    chunks.append(ChunkLoad("tail", 4 * CHUNK, 5, 0, 4 * CHUNK + 5))
    block_ids = [3, 9, 1, 14, 7, 2, 11, 5, 8, 4]
    fast = _connector(layout)
    if in_arena:  # laid out as StoreClient.batch_get_chunks reads them: back to back
        blobs = [kvformat.encode(kv, fp, f"k{i}") for i, kv in enumerate(kvs)]
        fast._arena = bytearray(b"".join(blobs))
        fast._arena_tensor = torch.frombuffer(fast._arena, dtype=torch.uint8)
        view, got, off = memoryview(fast._arena), [], 0
        for b in blobs:
            got.append(kvformat.decode(view[off : off + len(b)], fp)[1])
            off += len(b)
        stacked = fast._stacked(got[1:3])
        assert stacked.data_ptr() == got[1].data_ptr()  # a view of the arena, not a copy
        assert torch.equal(stacked, torch.stack(got[1:3]))
    else:
        got = [kv.clone() for kv in kvs]
    fast._scatter_all(list(zip(chunks, got, strict=True)), block_ids)
    slow = _connector(layout)
    for chunk, kv in zip(chunks, kvs, strict=True):
        slow._scatter(kv, chunk, block_ids)
    for a, b in zip(fast._caches, slow._caches, strict=True):
        assert torch.equal(a, b)
    # and what landed, read back through the layout token by token, is each chunk's KV at
    # the positions it wrote, zero elsewhere
    ids = torch.tensor(block_ids)
    tokens = torch.stack(  # [L, 2, H, tokens, D]
        [layout.gather(c, ids).permute(1, 2, 0, 3, 4).flatten(2, 3) for c in fast._caches]
    )
    want = torch.zeros_like(tokens)
    for chunk, kv in zip(chunks, kvs, strict=True):
        lo, hi = max(chunk.start, chunk.skip_before), chunk.stop
        want[:, :, :, lo:hi] = kv[:, :, :, lo - chunk.start : hi - chunk.start]
    assert torch.equal(tokens, want)
