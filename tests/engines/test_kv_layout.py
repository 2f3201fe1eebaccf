"""Every KV cache layout vLLM can hand the connector, converted to the canonical chunk and back,
checked against vLLM's own code on any machine:

- CPU: vLLM's cache-write op takes the attention ISA as an argument, so K/V it writes in each
  ISA this CPU's build runs (``amx``, ``vec``, ``vec16``; ``neon`` on ARM) are read back
  through the derived layout token-exact, and the layout writes byte-identical blocks. Chunks
  written in one ISA's layout read back identical in another's.
- GPU: the per-layer views vLLM's allocator makes (``create_kv_cache_views``) for every
  ``KVCacheLayout`` stride order, block sizes 16/32/64, written through the backends' own
  K/V split (``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in FlashAttention,
  FlashInfer and Triton).
- A layout that no strided view reproduces is refused (LayoutError), and the connector then
  serves without the store instead of failing.
"""

from __future__ import annotations

import platform

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from pdserve.engines import kv_layout

H = 3  # SmolLM2's KV heads: not a power of two
ARM = platform.machine().lower() in ("aarch64", "arm64")
#: the ISAs whose layouts vLLM's CPU builds write (its op has neon only on ARM); ``amx`` only
#: where the CPU runs it (AMX/AVX-512): elsewhere vLLM never picks it, and its op refuses it
CPU_ISAS = ["amx", "vec", "vec16", *(["neon"] if ARM else [])]


def _runs_here(*isas: str) -> None:
    for isa in isas:
        if not kv_layout.cpu_isa_runs(isa):
            pytest.skip(f"this CPU's vLLM build does not run isa {isa!r} (no AMX/AVX-512)")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _known(n: int, dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(n, H, dim, generator=g).to(dtype)
    return key, torch.randn(n, H, dim, generator=g).to(dtype)


def _op_write(isa: str, cache: torch.Tensor, key, value, slots) -> None:
    nb, heads, bs, width = cache.shape
    kc, vc = cache.view(nb, heads, 2 * bs, width // 2).chunk(2, dim=2)
    kv_layout.vllm_cpu_writer(isa)(key, value, kc, vc, slots)


def _canonical(key, value, slots, nb: int, bs: int) -> torch.Tensor:
    """``[nb, 2, H, bs, D]`` holding key/value at their slots, zero elsewhere."""
    out = torch.zeros(nb * bs, 2, H, key.shape[-1], dtype=key.dtype)
    out[slots, 0], out[slots, 1] = key, value
    return out.view(nb, bs, 2, H, -1).permute(0, 2, 3, 1, 4)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bs", [32, 64, 128])
@pytest.mark.parametrize("dim", [32, 64, 80, 128])
def test_cpu_isa_layouts_round_trip_against_vllms_op(isa, dtype, bs, dim) -> None:
    _runs_here(isa)
    layout = kv_layout.cpu_layout(dtype, bs, dim, isa)
    nb = 4
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(bs + dim))[: 2 * bs]
    key, value = _known(len(slots), dim, dtype, seed=dim)
    written = torch.zeros(nb, H, bs, 2 * dim, dtype=dtype)
    _op_write(isa, written, key, value, slots)
    ids = torch.arange(nb)
    # what vLLM wrote, read through the layout: the canonical K/V, token for token
    assert torch.equal(layout.gather(written, ids), _canonical(key, value, slots, nb, bs))
    # what the layout writes: the very bytes vLLM's op writes
    ours = torch.zeros_like(written)
    layout.scatter(ours, ids, _canonical(key, value, slots, nb, bs))
    assert torch.equal(ours.view(torch.uint8), written.view(torch.uint8))


def test_isa_layouts_differ_where_vllm_says_they_do() -> None:
    """The derivation is not a no-op: bfloat16 ``amx`` pairs neighbouring dims of K and
    neighbouring tokens of V for its tiles; ``vec`` keeps K transposed, V row-major."""
    _runs_here("amx")
    amx = kv_layout.cpu_layout(torch.bfloat16, 32, 64, "amx")
    vec = kv_layout.cpu_layout(torch.bfloat16, 32, 64, "vec")
    assert (amx.parts[0].d_lo, amx.parts[1].t_lo) == (2, 2)
    assert vec.parts[0].strides[0] == 1 and vec.parts[1].strides[2] == 1  # K^T, V
    assert amx.parts != vec.parts


@pytest.mark.parametrize("src_isa,dst_isa", [("amx", "vec"), ("vec", "amx"), ("vec16", "amx")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_chunks_move_between_isa_layouts(src_isa, dst_isa, dtype) -> None:
    """A chunk gathered from an engine in one layout and scattered into an engine in another
    is, in the second, exactly what vLLM's op would have written there itself."""
    _runs_here(src_isa, dst_isa)
    bs, dim, nb = 32, 64, 3
    src, dst = (kv_layout.cpu_layout(dtype, bs, dim, isa) for isa in (src_isa, dst_isa))
    slots = torch.arange(nb * bs)
    key, value = _known(len(slots), dim, dtype, seed=7)
    a = torch.zeros(nb, H, bs, 2 * dim, dtype=dtype)
    _op_write(src_isa, a, key, value, slots)
    b = torch.zeros_like(a)
    dst.scatter(b, torch.arange(nb), src.gather(a, torch.arange(nb)))
    want = torch.zeros_like(a)
    _op_write(dst_isa, want, key, value, slots)
    assert torch.equal(b.view(torch.uint8), want.view(torch.uint8))


def _gpu_caches(layout, bs: int, dim: int, dtype: torch.dtype, nb: int, layers: int = 2):
    """Per-layer caches exactly as vLLM's allocator views them for ``layout``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    spec = FullAttentionSpec(block_size=bs, num_kv_heads=H, head_size=dim, dtype=dtype)
    block = spec.page_size_bytes * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, nb, layers, layout, fixed_strides=(None, block, None, None, None)
    )
    size = spec.page_size_bytes * nb * layers
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, nb, layout, tensor)


def _kv_cache_layouts():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


@pytest.mark.parametrize("layout_name", [x.name for x in _kv_cache_layouts()])
@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_stride_orders_round_trip_through_the_backends_split(layout_name, bs, dtype) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    dim, nb = 64, 5
    caches = _gpu_caches(KVCacheLayout[layout_name], bs, dim, dtype, nb)
    layout = kv_layout.content_layout(bs, dim)
    ids = torch.tensor([4, 0, 2])
    for i, cache in enumerate(caches):
        slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(i))[: 3 * bs]
        key, value = _known(len(slots), dim, dtype, seed=i)
        # the backends' own view of a layer's cache: (B, H, N, 2D) -> 2 x (B, N, H, D)
        key_cache, value_cache = cache.transpose(1, 2).split(dim, dim=-1)
        key_cache[slots // bs, slots % bs] = key
        value_cache[slots // bs, slots % bs] = value
        want = _canonical(key, value, slots, nb, bs)
        assert torch.equal(layout.gather(cache, torch.arange(nb)), want)
        before = [c.clone() for c in caches]
        cache.zero_()
        layout.scatter(cache, ids, want[ids])
        for j, c in enumerate(caches):  # wrote exactly those blocks of this layer
            if j != i:
                assert torch.equal(c, before[j])
        assert torch.equal(layout.gather(cache, ids), want[ids])
        rest = torch.tensor([b for b in range(nb) if b not in ids.tolist()])
        assert not layout.gather(cache, rest).any()


def test_a_layout_no_strided_view_reproduces_is_refused() -> None:
    """A kernel that places K in an order no two-level split of tokens and dims describes
    (here: shuffled within each head) is refused, not stored wrong."""

    def scrambled(key, value, key_cache, value_cache, slots) -> None:
        kv_layout.vllm_cpu_writer("vec")(key, value, key_cache, value_cache, slots)
        per_head = key_cache.flatten(2)  # [1, heads, bs * D]
        perm = torch.randperm(per_head.shape[-1], generator=torch.Generator().manual_seed(0))
        key_cache.copy_(per_head[..., perm].view_as(key_cache))

    with pytest.raises(kv_layout.LayoutError, match="no strided view"):
        kv_layout.cpu_layout(torch.bfloat16, 32, 64, "vec", write=scrambled)


def test_quantized_kv_and_refused_isas_are_layout_errors() -> None:
    with pytest.raises(kv_layout.LayoutError, match="quantized"):
        kv_layout.cpu_layout(torch.bfloat16, 32, 64, "vec", kv_cache_dtype="fp8")
    if not ARM:
        with pytest.raises(kv_layout.LayoutError, match="refuses isa 'neon'"):
            kv_layout.cpu_layout(torch.bfloat16, 32, 64, "neon")


def test_the_isa_vllm_picks_here_is_one_the_connector_converts() -> None:
    """What an engine on this machine runs (the default: bfloat16, block 32, SmolLM2's head
    size 64; and float32): vLLM's own choice of ISA derives."""
    for dtype in (torch.bfloat16, torch.float32):
        isa = kv_layout.vllm_cpu_isa(dtype, 32, 64, "auto")
        assert kv_layout.cpu_layout(dtype, 32, 64, isa).name == f"cpu:{isa}"


def test_the_amx_kernels_run_where_the_cpu_has_avx512_or_amx() -> None:
    """What the skips above rest on: vLLM's build runs ``vec`` everywhere, ``amx`` exactly on
    CPUs with AVX-512 or AMX (and refuses it elsewhere, where it never picks it)."""
    from pdserve.devices import cpu_flags

    assert kv_layout.cpu_isa_runs("vec") and kv_layout.cpu_isa_runs("vec16")
    assert kv_layout.cpu_isa_runs("amx") == bool(cpu_flags() & {"avx512f", "amx_tile"})
