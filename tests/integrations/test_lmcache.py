"""pdserve's store as an LMCache remote store (pdserve.integrations.lmcache, docs/lmcache.md).

The codec tests need neither LMCache nor processes. The store tests start a real KV master and
storage node; those that drive LMCache's own StorageManager (CPU path: LocalCPUBackend as the
allocator, RemoteBackend around the plugin) are skipped where ``lmcache`` does not import."""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve import errors
from pdserve.integrations import lmcache as plug

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _meta(key: str = "m@1@0@abc@bfloat16", shape=(2, 2, 16, 8)) -> plug.ChunkMeta:
    n = 1
    for d in shape:
        n *= d
    return plug.ChunkMeta(key, (tuple(shape),), ("bfloat16",), "KV_2LTD", 2 * n)


# -- codec ---------------------------------------------------------------------------------------


def test_store_key_is_stable_and_bounded():
    k = plug.store_key("lmcache", MODEL, f"{MODEL}@1@0@1f@bfloat16")
    # a fixed value: the key never depends on the process (PYTHONHASHSEED) or the run
    assert k == plug.store_key("lmcache", MODEL, f"{MODEL}@1@0@1f@bfloat16")
    assert k.startswith(f"lmcache/{MODEL}/") and len(k.rsplit("/", 1)[1]) == 64
    assert k != plug.store_key("lmcache", MODEL, f"{MODEL}@1@1@1f@bfloat16")
    assert k != plug.store_key("other", MODEL, f"{MODEL}@1@0@1f@bfloat16")
    long = plug.store_key("lmcache", "x" * 1000, "x" * 5000)
    assert len(long.encode()) <= 256 and long.split("/")[1].startswith("h-")
    with pytest.raises(errors.InvalidArgument):
        plug.store_key("a/b", MODEL, "k")


def test_codec_round_trip_and_rejections():
    meta = _meta()
    payload = bytes(range(256)) * (meta.nbytes // 256)
    blob = plug.encode_object(meta, payload)
    assert blob[:4] == b"PDLC"
    got_meta, got = plug.decode_object(blob, meta.key)
    assert got_meta == meta and bytes(got) == payload
    # JSON header, no pickle: the description is readable as is
    (n,) = struct.unpack_from("<I", blob, 8)
    assert json.loads(blob[12 : 12 + n])["shapes"] == [[2, 2, 16, 8]]
    assert plug.decode_object(blob, "another@key") is None  # foreign chunk: a miss
    assert plug.decode_object(blob[:-1], meta.key) is None  # truncated
    assert plug.decode_object(b"XXXX" + blob[4:], meta.key) is None  # not ours
    assert plug.decode_object(blob[:10]) is None
    bad = plug.ChunkMeta(meta.key, meta.shapes, meta.dtypes, meta.fmt, meta.nbytes - 2)
    with pytest.raises(errors.InvalidArgument):
        plug.encode_object(bad, payload)  # payload and meta disagree
    # a header whose shapes do not add up to the payload is rejected on read
    lying = plug.encode_object(
        plug.ChunkMeta(meta.key, ((4, 4),), ("bfloat16",), "KV_2LTD", meta.nbytes), payload
    )
    assert plug.decode_object(lying, meta.key) is None


def test_settings_from_extra_config():
    extra = {
        "remote_storage_plugin.pd.master_address": "127.0.0.1:1",
        "remote_storage_plugin.pd.replicas": "2",
        "remote_storage_plugin.pd.soft_pin": "true",
        "remote_storage_plugin.pd.namespace": "lmc",
    }
    s = plug.PluginSettings.from_extra_config(extra, "pd")
    assert (s.master_address, s.replicas, s.soft_pin, s.namespace) == (
        "127.0.0.1:1",
        2,
        True,
        "lmc",
    )
    assert s.options().replicas == 2
    with pytest.raises(errors.InvalidArgument, match="master_address"):
        plug.PluginSettings.from_extra_config({}, "pd")
    with pytest.raises(errors.InvalidArgument):
        plug.PluginSettings.from_extra_config(
            {**extra, "remote_storage_plugin.pd.replicas": 0}, "pd"
        )
    # strict: a typo in the plugin's keys is named (another plugin's keys are not ours)
    typo = {**extra, "remote_storage_plugin.pd.replica": "2", "remote_storage_plugin.x.y": 1}
    with pytest.raises(
        errors.InvalidArgument, match=r"did you mean remote_storage_plugin\.pd\.replicas"
    ):
        plug.PluginSettings.from_extra_config(typo, "pd")


def test_plugin_name_is_found_from_the_config():
    fake = type("PdserveConnector", (), {"__module__": "pdserve.integrations.lmcache"})

    def config(*names: str) -> SimpleNamespace:
        extra = {}
        for n in names:
            extra[f"remote_storage_plugin.{n}.module_path"] = "pdserve.integrations.lmcache"
            extra[f"remote_storage_plugin.{n}.class_name"] = "PdserveConnector"
        return SimpleNamespace(remote_storage_plugins=["fs", *names], extra_config=extra)

    assert plug.plugin_name_for(config("pd"), fake) == "pd"
    with pytest.raises(errors.InvalidArgument, match="no remote_storage_plugins"):
        plug.plugin_name_for(config(), fake)
    with pytest.raises(errors.InvalidArgument, match="its own class"):
        plug.plugin_name_for(config("a", "b"), fake)


@pytest.mark.slow
def test_module_imports_without_lmcache():
    """The codec stays usable where LMCache is not installed."""
    code = (
        "import sys; sys.modules['lmcache'] = None\n"
        "import pdserve.integrations.lmcache as p\n"
        "print(p.store_key('lmcache', 'm', 'k'))\n"
        "try:\n"
        "    p.PdserveConnector\n"
        "except ImportError as exc:\n"
        "    assert 'docs/lmcache.md' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('PdserveConnector without LMCache')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == plug.store_key("lmcache", "m", "k")


# -- a real store ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store_master(tmp_path_factory):
    from pdserve.procs import local_store

    with local_store(tmp_path_factory.mktemp("lmcache-store"), segment_size="64MiB") as (m, _n):
        yield m.info["grpc"]


@pytest.fixture
def client(store_master):
    from pdserve.store import open_store

    with open_store(store_master) as c:
        yield c


@pytest.mark.slow
def test_codec_through_the_real_store(client):
    """Without LMCache: what the plugin writes survives the store processes byte for byte."""
    meta = _meta("codec@1@0@7@bfloat16")
    payload = bytes((i * 7) % 251 for i in range(meta.nbytes))
    key = plug.store_key("lmcache", "codec-model", meta.key)
    assert client.put(key, plug.encode_object(meta, payload))
    got = plug.decode_object(client.get(key), meta.key)
    assert got is not None and bytes(got[1]) == payload


# -- LMCache's own storage manager -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lmc():
    """LMCache's classes, imported only when a test needs them (a skip where it is absent)."""
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager
    except ImportError as exc:  # depends on the machine
        pytest.skip(f"lmcache does not import here ({exc}); install it as docs/lmcache.md says")
    return SimpleNamespace(
        torch=torch,
        CacheEngineKey=CacheEngineKey,
        LMCacheEngineConfig=LMCacheEngineConfig,
        EventManager=EventManager,
        LMCacheMetadata=LMCacheMetadata,
        StorageManager=StorageManager,
    )


BACKEND = "RemoteBackend-pdserve"
CHUNK = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8
SHAPE = (2, LAYERS, CHUNK, KV_HEADS * HEAD_DIM)  # LMCache's KV_2LTD chunk


def _lmcache_yaml(instance: str) -> str:
    """LMCache's own settings of every test instance (its CPU buffer, test sizes)."""
    return (
        f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.05\n"
        f"lmcache_instance_id: {instance}\n"
    )


def _config_yaml(master: str, instance: str) -> str:
    """The configuration docs/lmcache.md shows (plus test sizes)."""
    return (
        _lmcache_yaml(instance)
        + f"""\
remote_storage_plugins: ["pdserve"]
extra_config:
  remote_storage_plugin.pdserve.module_path: pdserve.integrations.lmcache
  remote_storage_plugin.pdserve.class_name: PdserveConnector
  remote_storage_plugin.pdserve.master_address: "{master}"
  remote_storage_plugin.pdserve.namespace: lmcache-test
"""
    )


def _url_config_yaml(master: str, instance: str) -> str:
    """LMCache configured with nothing of pdserve's but its remote_url."""
    return _lmcache_yaml(instance) + f"remote_url: pdserve://{master}?namespace=lmcache-url\n"


def _manager(lmc, tmp_path: Path, master: str, instance: str, yaml=_config_yaml):
    torch = lmc.torch
    path = tmp_path / f"{instance}.yaml"
    path.write_text(yaml(master, instance))
    config = lmc.LMCacheEngineConfig.from_file(str(path))
    metadata = lmc.LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
        role="worker",
    )
    return lmc.StorageManager(config, metadata, lmc.EventManager())


def _keys(lmc, base: int, n: int) -> list:
    return [lmc.CacheEngineKey(MODEL, 1, 0, base + i, lmc.torch.bfloat16) for i in range(n)]


def _filled(sm, seed: int, shape=SHAPE):
    import torch

    obj = sm.allocate(torch.Size(shape), torch.bfloat16)
    assert obj is not None
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
    return obj


def _wait_contains(sm, keys, timeout: float = 20.0, backend: str = BACKEND) -> int:
    deadline = time.monotonic() + timeout
    while True:
        hit, _ = sm.batched_contains(keys, search_range=[backend])
        if hit == len(keys) or time.monotonic() > deadline:
            return hit
        time.sleep(0.05)


def _connector(sm):
    conn = sm.storage_backends[BACKEND].connection.getWrappedConnector()
    assert isinstance(conn, plug.PdserveConnector)
    return conn


@pytest.fixture
def managers(lmc, tmp_path, store_master):
    made: list = []

    def make(instance: str, yaml=_config_yaml):
        made.append(_manager(lmc, tmp_path, store_master, instance, yaml))
        return made[-1]

    yield make
    for sm in made:
        sm.close()


@pytest.mark.slow
def test_storage_manager_put_contains_get(lmc, managers, client):
    torch = lmc.torch
    writer = managers("writer")
    assert BACKEND in writer.storage_backends  # the plugin loaded from the YAML config
    keys = _keys(lmc, 0x1000, 4)
    objs = [_filled(writer, i) for i in range(len(keys))]
    expected = [bytes(o.byte_array) for o in objs]
    assert all(len(e) == 2 * LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2 for e in expected)

    writer.batched_put(keys, objs, location=BACKEND)  # only the pdserve store
    assert _wait_contains(writer, keys) == len(keys)
    for key, want in zip(keys, expected, strict=True):
        got = writer.get(key, location=BACKEND)
        assert got is not None and bytes(got.byte_array) == want
        assert got.get_shapes() == [torch.Size(SHAPE)] and got.get_dtypes() == [torch.bfloat16]
        got.ref_count_down()

    # the bytes are in pdserve's store under the documented key, in the documented format
    conn = _connector(writer)
    skey = plug.store_key("lmcache-test", MODEL, keys[0].to_string())
    assert conn.store_key(keys[0]) == skey
    meta, payload = plug.decode_object(client.get(skey), keys[0].to_string())
    assert bytes(payload) == expected[0] and meta.fmt == "KV_2LTD"

    # a second LMCache instance (empty local CPU cache) finds and reads them from the store
    reader = managers("reader")
    hit, mapping = reader.batched_contains(keys)
    assert hit == len(keys) and list(mapping) == [BACKEND]
    for key, want in zip(keys, expected, strict=True):
        got = reader.get(key)  # LocalCPUBackend misses, the pdserve store hits
        assert got is not None and bytes(got.byte_array) == want
        got.ref_count_down()
    got = reader.storage_backends[BACKEND].batched_get_blocking(keys)
    assert [bytes(o.byte_array) for o in got] == expected

    # prefix semantics: a missing chunk in the middle stops the hit count there
    gap = [*keys[:2], _keys(lmc, 0x9000, 1)[0], *keys[2:]]
    assert reader.batched_contains(gap, search_range=[BACKEND])[0] == 2


@pytest.mark.slow
def test_partial_chunk_miss_list_remove(lmc, managers, client):
    torch = lmc.torch
    sm = managers("partial")
    conn = _connector(sm)
    short = (2, LAYERS, 5, KV_HEADS * HEAD_DIM)  # a last chunk of 5 tokens
    key = _keys(lmc, 0x2000, 1)[0]
    obj = _filled(sm, 99, short)
    want = bytes(obj.byte_array)
    sm.batched_put([key], [obj], location=BACKEND)
    assert _wait_contains(sm, [key]) == 1
    got = sm.storage_backends[BACKEND].get_blocking(key)
    assert got is not None and bytes(got.byte_array) == want
    assert got.get_shapes() == [torch.Size(short)]
    got.ref_count_down()

    loop = sm.loop
    listed = asyncio.run_coroutine_threadsafe(conn.list(), loop).result(10)
    assert key.to_string() in listed

    absent = _keys(lmc, 0x3000, 1)[0]
    assert sm.storage_backends[BACKEND].get_blocking(absent) is None
    assert not conn.exists_sync(absent)

    # a foreign object at a chunk's store key reads as a miss, never as KV
    foreign = _keys(lmc, 0x4000, 1)[0]
    client.put(conn.store_key(foreign), b"not an LMCache chunk")
    assert conn.exists_sync(foreign)
    assert sm.storage_backends[BACKEND].get_blocking(foreign) is None

    assert conn.remove_sync(key)
    assert not conn.exists_sync(key)
    listed = asyncio.run_coroutine_threadsafe(conn.list(), loop).result(10)
    assert key.to_string() not in listed


@pytest.mark.slow
def test_remote_url_alone_reaches_the_store(lmc, managers, client):
    """`remote_url: pdserve://...` and nothing else: LMCache finds pdserve's adapter among its
    own (make setup registers it), and a second instance reads what the first stored."""
    from pdserve.integrations import lmcache_url

    assert lmcache_url.registered(lmcache_url.connector_dir()), (
        "pdserve's LMCache adapter is not registered: run `pdserve lmcache register`"
    )
    writer = managers("url-writer", _url_config_yaml)
    assert "RemoteBackend" in writer.storage_backends
    keys = _keys(lmc, 0x5000, 3)
    objs = [_filled(writer, 50 + i) for i in range(len(keys))]
    expected = [bytes(o.byte_array) for o in objs]
    writer.batched_put(keys, objs, location="RemoteBackend")
    assert _wait_contains(writer, keys, backend="RemoteBackend") == len(keys)
    conn = writer.storage_backends["RemoteBackend"].connection.getWrappedConnector()
    assert isinstance(conn, plug.PdserveConnector) and conn.settings.namespace == "lmcache-url"
    skey = plug.store_key("lmcache-url", MODEL, keys[0].to_string())
    assert bytes(plug.decode_object(client.get(skey), keys[0].to_string())[1]) == expected[0]

    reader = managers("url-reader", _url_config_yaml)
    hit, mapping = reader.batched_contains(keys)
    assert hit == len(keys) and list(mapping) == ["RemoteBackend"]
    for key, want in zip(keys, expected, strict=True):
        got = reader.get(key)  # its local CPU cache is empty: the bytes come from the store
        assert got is not None and bytes(got.byte_array) == want
        got.ref_count_down()


def test_register_writes_and_removes_the_adapter_module(tmp_path):
    """What `pdserve lmcache register` puts where LMCache looks: a module named *_adapter that
    re-exports the adapter class; register is idempotent, unregister removes only it."""
    from pdserve.integrations import lmcache_url

    (tmp_path / "redis_adapter.py").write_text("# LMCache's own\n")
    assert lmcache_url.register(tmp_path) and not lmcache_url.register(tmp_path)
    shim = tmp_path / lmcache_url.SHIM_NAME
    assert shim.name.endswith("_adapter.py") and lmcache_url.registered(tmp_path)
    assert "import PdserveConnectorAdapter" in shim.read_text()
    assert lmcache_url.unregister(tmp_path) and not lmcache_url.unregister(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["redis_adapter.py"]


@pytest.mark.parametrize(
    "url, message",
    [
        ("pdserve://h", "pdserve://HOST:PORT"),
        ("pdserve://h:1/path", "pdserve://HOST:PORT"),
        ("pdserve://h:1?replica=2", "did you mean 'replicas'"),
        ("pdserve://h:1?replicas=1&replicas=2", "given 2 times"),
        ("pdserve://h:1?replicas=two", "invalid literal"),
        ("redis://h:1", "not a pdserve:// URL"),
    ],
)
def test_remote_url_errors(url, message):
    from pdserve.integrations.lmcache_url import settings_from_url

    with pytest.raises(errors.InvalidArgument, match=message):
        settings_from_url(url)


def test_remote_url_settings():
    from pdserve.integrations.lmcache_url import settings_from_url

    s = settings_from_url("pdserve://10.0.0.5:50051?namespace=a&replicas=2&soft_pin=true")
    assert (s.master_address, s.namespace, s.replicas, s.soft_pin) == (
        "10.0.0.5:50051",
        "a",
        2,
        True,
    )
    assert settings_from_url("pdserve://h:7").namespace == "lmcache"
