"""The keys users bring from Mooncake and LMCache (pdserve.compat): accepted with their meaning
from the files those tools read (MOONCAKE_CONFIG_PATH JSON, LMCACHE_CONFIG_FILE YAML) or
``--config``; refused, with the reason, where pdserve cannot honour them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdserve import compat, compat_transport, compat_upstream, config
from pdserve.commands.up import UpConfig
from pdserve.config import ConfigError
from pdserve.engines.connector_data import ConnectorSettings, extra_config
from pdserve.hashing import ModelFingerprint
from pdserve.services.decode.config import DecodeConfig
from pdserve.services.kvstore.node.config import NodeConfig
from pdserve.services.prefill.config import PrefillConfig
from pdserve.services.router.config import RouterConfig
from pdserve.sizes import parse_size

ROOT = Path(__file__).resolve().parents[1]

#: A Mooncake store client's JSON, as vLLM's MooncakeStoreConnector reads it.
MOONCAKE = {
    "local_hostname": "10.0.0.7",
    "metadata_server": "P2PHANDSHAKE",
    "protocol": "tcp",
    "device_name": "",
    "master_server_address": "10.0.0.5:50051",
    "global_segment_size": "512MB",
    "local_buffer_size": 134217728,
}

#: LMCache's YAML for a Mooncake Store remote (its documented example).
LMCACHE = """\
chunk_size: 64
local_cpu: False
max_local_cpu_size: 5
remote_url: "mooncakestore://10.0.0.5:50051/"
remote_serde: "naive"
extra_config:
  local_hostname: "10.0.0.7"
  metadata_server: "http://10.0.0.5:8080/metadata"
  protocol: "tcp"
  device_name: ""
  master_server_address: "10.0.0.5:50051"
  global_segment_size: 3355443200
  local_buffer_size: 1073741824
  transfer_timeout: 1
"""

ROUTER = {"meta": "127.0.0.1:1"}  # the router needs a way to find workers


def mooncake_file(tmp_path: Path, **changes: object) -> Path:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**MOONCAKE, **changes}))
    return path


def lmcache_file(tmp_path: Path, text: str = LMCACHE) -> Path:
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("via", ["--config", "MOONCAKE_CONFIG_PATH"])
def test_mooncake_json_configures_workers_router_and_nodes(tmp_path, via):
    path = mooncake_file(tmp_path)
    kw = {"yaml_path": path, "env": {}} if via == "--config" else {"env": {via: str(path)}}
    for cls, section in ((PrefillConfig, "prefill"), (DecodeConfig, "decode")):
        cfg = config.load(cls, section, **kw)
        assert (cfg.store_backend, cfg.store_master) == ("mooncake", "10.0.0.5:50051")
        assert cfg.store_segment_size == str(512 * 1024**2)  # Mooncake's MB is binary
        assert cfg.store_buffer_size == str(128 * 1024**2)
        assert (cfg.store_protocol, cfg.store_device) == ("tcp", "")
        assert cfg.store_metadata_server == "P2PHANDSHAKE"
        assert cfg.advertise_host == "10.0.0.7"
        opts = cfg.mooncake_options(cfg.store_segment_size)
        assert opts == {
            "segment_bytes": 512 * 1024**2,
            "buffer_bytes": 128 * 1024**2,
            "host": "10.0.0.7",
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "device_name": "",
        }
    router = config.load(RouterConfig, "router", overrides=ROUTER, **kw)
    assert (router.store_backend, router.store_master) == ("mooncake", "10.0.0.5:50051")
    assert router.mooncake_options()["segment_bytes"] == 0  # the router only looks up
    node = config.load(NodeConfig, "kvstore_node", **kw)
    assert node.segment_sizes == [str(512 * 1024**2)] and node.advertise_host == "10.0.0.7"


def test_lmcache_yaml_with_mooncake_extra_config(tmp_path):
    path = lmcache_file(tmp_path)
    for kw in ({"yaml_path": path, "env": {}}, {"env": {"LMCACHE_CONFIG_FILE": str(path)}}):
        cfg = config.load(PrefillConfig, "prefill", **kw)
        assert cfg.chunk_size == 64
        assert (cfg.store_backend, cfg.store_master) == ("mooncake", "10.0.0.5:50051")
        assert cfg.store_metadata_server == "http://10.0.0.5:8080/metadata"
        assert cfg.store_segment_size == "3355443200" and cfg.store_timeout_s == 1.0
        router = config.load(RouterConfig, "router", overrides=ROUTER, **kw)
        assert router.chunk_size == 64 and router.store_backend == "mooncake"


def test_lmcache_pdserve_remote_url(tmp_path):
    path = lmcache_file(tmp_path, "chunk_size: 32\nlocal_cpu: false\nremote_url: pdserve://m:7\n")
    cfg = config.load(DecodeConfig, "decode", yaml_path=path, env={})
    assert (cfg.store_backend, cfg.store_master, cfg.chunk_size) == ("pdserve", "m:7", 32)
    assert config.load(NodeConfig, "kvstore_node", yaml_path=path, env={}).master_address == "m:7"
    assert config.load(UpConfig, "up", yaml_path=lmcache_file(tmp_path, "chunk_size: 64\n"),
                       env={}).chunk_size == 64  # fmt: skip


def test_familiar_keys_beside_sections_and_precedence(tmp_path):
    """defaults < MOONCAKE_CONFIG_PATH < LMCACHE_CONFIG_FILE < --config's familiar keys <
    its section < PDSERVE_* < flags."""
    mc = mooncake_file(tmp_path, local_buffer_size="1GB")
    lm = lmcache_file(tmp_path, "chunk_size: 48\nlocal_cpu: false\n")
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(yaml.safe_dump({"chunk_size": 96, "prefill": {"store_timeout_s": 9}}))
    env = {"MOONCAKE_CONFIG_PATH": str(mc), "LMCACHE_CONFIG_FILE": str(lm)}
    cfg = config.load(PrefillConfig, "prefill", yaml_path=mixed, env=env)
    assert cfg.store_backend == "mooncake" and cfg.store_buffer_size == str(1024**3)
    assert cfg.chunk_size == 96 and cfg.store_timeout_s == 9.0
    assert config.load(PrefillConfig, "prefill", env=env).chunk_size == 48
    env["PDSERVE_PREFILL_CHUNK_SIZE"] = "112"
    assert config.load(PrefillConfig, "prefill", yaml_path=mixed, env=env).chunk_size == 112
    cfg = config.load(
        PrefillConfig, "prefill", yaml_path=mixed, env=env, overrides={"store_backend": "pdserve",
        "store_master": "x:1", "store_segment_size": "0"},
    )  # fmt: skip
    assert cfg.store_backend == "pdserve" and cfg.store_master == "x:1"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"master_server_adress": "h:1"}, r"'master_server_adress' \(did you mean 'master_server_address'\?\)"),
        ({"protocol": "ib"}, "protocol must be 'tcp' or 'rdma'"),
        ({"device_name": "mlx5_0"}, "names RDMA devices, which protocol 'tcp' does not use"),
        ({"protocol": "rdma", "device_name": "mlx5_0"}, "'rdma' needs an RDMA device and this machine has none"),
        ({"metadata_server": "zk://h:1"}, "must be P2PHANDSHAKE or a URL"),
        ({"global_segment_size": "lots"}, "global_segment_size: invalid size 'lots'"),
    ],
)  # fmt: skip
def test_mooncake_keys_pdserve_cannot_honour(tmp_path, monkeypatch, changes, message):
    monkeypatch.setattr(compat_transport, "RDMA_SYS", tmp_path / "no-infiniband")
    path = mooncake_file(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as exc:
        config.load(PrefillConfig, "prefill", yaml_path=path, env={})
    assert str(path) in str(exc.value)
    with pytest.raises(ConfigError, match=message) as exc:
        config.load(PrefillConfig, "prefill", env={"MOONCAKE_CONFIG_PATH": str(path)})
    assert "the file MOONCAKE_CONFIG_PATH names" in str(exc.value)


def test_rdma_devices_are_checked_by_name(tmp_path, monkeypatch):
    sys_dir = tmp_path / "infiniband"
    (sys_dir / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(compat_transport, "RDMA_SYS", sys_dir)
    ok = mooncake_file(tmp_path, protocol="rdma", device_name="mlx5_0")
    cfg = config.load(PrefillConfig, "prefill", yaml_path=ok, env={})
    assert (cfg.store_protocol, cfg.store_device) == ("rdma", "mlx5_0")
    bad = mooncake_file(tmp_path, protocol="rdma", device_name="mlx5_0,mlx5_1")
    with pytest.raises(ConfigError, match="mlx5_1: no such RDMA device here"):
        config.load(PrefillConfig, "prefill", yaml_path=bad, env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("remote_serde: cachegen\n", "remote_serde 'cachegen': pdserve stores KV chunks as raw"),
        ("local_cpu: true\n", "local_cpu True: pdserve has no per-process CPU cache tier"),
        ("remote_url: lm://h:65432\n", "remote_url must be pdserve://MASTER_HOST:PORT or"),
        ("remote_url: pdserve://h\n", "must name the KV store master as pdserve://HOST:PORT"),
        ("max_local_cpu_size: -1\n", "max_local_cpu_size must be a number of GB >= 0"),
        ("local_disk: file:///tmp/\n", "local_disk is LMCache.s own setting .pdserve.s disk tier belongs to its storage nodes"),
        ("extra_config:\n  use_ascend_direct: true\n", "unknown key extra_config.use_ascend_direct"),
        ("remote_url: pdserve://h:1\nmaster_server_address: h:2\n", "keep one"),
    ],
)  # fmt: skip
def test_lmcache_keys_pdserve_cannot_honour(tmp_path, text, message):
    path = lmcache_file(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        config.load(PrefillConfig, "prefill", yaml_path=path, env={})


def test_unknown_key_in_lmcache_env_file(tmp_path):
    path = lmcache_file(tmp_path, "chunk_size: 16\nchunksize: 16\n")
    with pytest.raises(ConfigError, match=r"'chunksize' \(did you mean 'chunk_size'\?\)") as exc:
        config.load(DecodeConfig, "decode", env={"LMCACHE_CONFIG_FILE": str(path)})
    assert "LMCACHE_CONFIG_FILE" in str(exc.value)


@pytest.mark.parametrize("key", ["master_server_address", "remote_url"])
def test_up_refuses_an_external_store(tmp_path, capsys, key):
    path = mooncake_file(tmp_path) if key == "master_server_address" else lmcache_file(tmp_path)
    with pytest.raises(ConfigError, match="pdserve up starts its own"):
        config.load(UpConfig, "up", yaml_path=path, env={})
    from pdserve.commands import cli

    assert cli.main(["up", "--config", str(path)]) == 2
    assert "pdserve up starts its own" in capsys.readouterr().err


def test_up_takes_segment_size_and_host(tmp_path):
    path = tmp_path / "up.json"
    path.write_text(json.dumps({"global_segment_size": "1GB", "local_hostname": "127.0.0.2"}))
    cfg = config.load(UpConfig, "up", yaml_path=path, env={})
    assert (cfg.segment_size, cfg.host) == (str(1024**3), "127.0.0.2")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"store_backend": "redis"}, "store_backend must be one of pdserve, mooncake"),
        ({"store_metadata_server": "http://h:1/metadata"}, "applies to store_backend mooncake"),
        ({"store_protocol": "rdma"}, "store_protocol 'rdma' applies to store_backend mooncake"),
        ({"store_segment_size": "1GiB"}, "store_segment_size '1GiB' applies to store_backend"),
        ({"store_backend": "mooncake", "store_buffer_size": "big"}, "invalid size 'big'"),
    ],
)  # fmt: skip
def test_store_backend_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        config.load(PrefillConfig, "prefill", env={}, overrides=flags)
    if "store_segment_size" not in flags:  # the router contributes no memory
        with pytest.raises(ConfigError, match=message):
            config.load(RouterConfig, "router", env={}, overrides={**ROUTER, **flags})


@pytest.mark.parametrize(
    ("value", "size"),
    [(4096, 4096), ("512MB", 512 * 1024**2), ("4GB", 4 * 1024**3), ("1.5 gb", 3 * 1024**3 // 2),
     ("64MiB", 64 * 1024**2), ("0", 0), ("3355443200", 3355443200)],
)  # fmt: skip
def test_sizes_as_mooncake_reads_them(value, size):
    assert parse_size(value, what="x", minimum=0) == size


def test_vllm_connector_carries_the_backend_choice():
    fp = ModelFingerprint(model_id="tiny", revision="r", kv_dtype="bfloat16", chunk_size=32)
    opts = PrefillConfig(store_backend="mooncake").mooncake_options("64MiB")
    extra = json.loads(
        json.dumps(extra_config("h:1", fp, backend="mooncake", backend_options=opts))
    )
    settings = ConnectorSettings.from_extra(extra)
    assert settings.backend == "mooncake" and settings.backend_options == opts
    plain = ConnectorSettings.from_extra(json.loads(json.dumps(extra_config("h:1", fp))))
    assert plain.backend == "pdserve" and plain.backend_options == {}


def test_docs_carry_the_key_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert compat.markdown_table() in doc
    assert compat_upstream.markdown_table() in doc
    for key in compat.KEYS:
        assert f"`{key.name}`" in doc


def test_the_lmcache_file_of_docs_lmcache_md_configures_pdserve_too(tmp_path):
    """One LMCACHE_CONFIG_FILE for both: LMCache's own keys (remote_storage_plugins,
    pre_caching_hash_algorithm, the plugin's extra_config) are LMCache's to read; pdserve's
    services take the keys they share (chunk_size) and still refuse a typo."""
    doc = (Path(__file__).parents[1] / "docs" / "lmcache.md").read_text()
    block = doc.split("## Configure LMCache", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert "remote_storage_plugins" in block and "remote_storage_plugin.pdserve" in block
    path = lmcache_file(tmp_path, block)
    env = {"LMCACHE_CONFIG_FILE": str(path)}
    assert config.load(PrefillConfig, "prefill", env=env).chunk_size == 256
    typo = lmcache_file(tmp_path, block + "local_cpux: true\n")
    with pytest.raises(ConfigError, match=r"'local_cpux' \(did you mean 'local_cpu'\?\)"):
        config.load(PrefillConfig, "prefill", env={"LMCACHE_CONFIG_FILE": str(typo)})


def test_lmcache_own_keys_are_the_installed_lmcaches():
    lm = pytest.importorskip("lmcache.v1.config")
    upstream = set(lm._CONFIG_DEFINITIONS) | set(lm._CONFIG_ALIASES)
    assert upstream - set(compat.BY_NAME) == compat_upstream.LMCACHE_OWN


def test_mooncakes_environment_only_configuration_is_read(tmp_path):
    """As MooncakeConfig.load_from_env: MOONCAKE_MASTER and its siblings, when no
    MOONCAKE_CONFIG_PATH is set; what pdserve cannot honour is refused with its reason."""
    env = {
        "MOONCAKE_MASTER": "10.0.0.5:50051",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "512MB",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
    }
    cfg = config.load(PrefillConfig, "prefill", env=env)
    assert (cfg.store_backend, cfg.store_master) == ("mooncake", "10.0.0.5:50051")
    assert cfg.store_segment_size == str(512 * 1024**2) and cfg.advertise_host == "10.0.0.7"
    # a config file wins, as in Mooncake: the variables are not read at all then
    path = mooncake_file(tmp_path, master_server_address="10.0.0.9:50051")
    with_file = config.load(
        PrefillConfig, "prefill", env={**env, "MOONCAKE_CONFIG_PATH": str(path)}
    )
    assert with_file.store_master == "10.0.0.9:50051"
    with pytest.raises(ConfigError, match=r"MOONCAKE_TENANT_ID .*: tenant_id 't1' is not supp"):
        config.load(PrefillConfig, "prefill", env={**env, "MOONCAKE_TENANT_ID": "t1"})
    with pytest.raises(ConfigError, match=r"Mooncake's environment \(MOONCAKE_\*\): metadata"):
        config.load(PrefillConfig, "prefill", env={**env, "MOONCAKE_TE_META_DATA_SERVER": "x"})
    # without MOONCAKE_MASTER, Mooncake reads no variable either
    assert (
        config.load(PrefillConfig, "prefill", env={"MOONCAKE_PROTOCOL": "rdma"}).store_master == ""
    )


@pytest.mark.parametrize("via", ["--config", "MOONCAKE_CONFIG_PATH"])
@pytest.mark.parametrize(
    ("key", "default", "other", "why"),
    [
        ("mode", "embedded", "standalone-store", "embedded clients"),
        ("tenant_id", "default", "team-a", "cache_salt"),
        ("enable_offload", False, True, "disk tier belongs to its storage nodes"),
        ("ssd_offload_path", "", "/mnt/ssd", "disk tier belongs to its storage nodes"),
        ("enable_client_http_server", "false", "true", "HTTP server is not implemented"),
    ],
)  # fmt: skip
def test_mooncake_keys_pdserve_does_not_honour_name_their_reason(
    tmp_path, via, key, default, other, why
):
    """vLLM's and Mooncake's own JSON keys: at their default they change nothing and pass; any
    other value is refused with the reason, never as an unknown key."""
    kw = lambda p: {"yaml_path": p, "env": {}} if via == "--config" else {"env": {via: str(p)}}  # noqa: E731
    ok = config.load(PrefillConfig, "prefill", **kw(mooncake_file(tmp_path, **{key: default})))
    assert ok.store_master == MOONCAKE["master_server_address"]
    with pytest.raises(ConfigError, match=f"{key} {other!r} is not supported by pdserve.*{why}"):
        config.load(PrefillConfig, "prefill", **kw(mooncake_file(tmp_path, **{key: other})))


def test_lmcache_mooncake_extra_config_takes_the_prefixed_keys(tmp_path):
    """LMCache's mooncakestore:// extra_config: ``mooncake_<key>`` is Mooncake's ``<key>``;
    LMCache's own knobs pdserve does not have are refused with the reason."""
    text = (
        "remote_url: mooncakestore://10.0.0.5:50051/\n"
        "extra_config:\n"
        "  mooncake_protocol: tcp\n"
        "  mooncake_global_segment_size: 256MB\n"
        "  mooncake_transfer_timeout: 3\n"
        "  mooncake_prefer_local_alloc: false\n"
    )
    cfg = config.load(
        PrefillConfig, "prefill", env={"LMCACHE_CONFIG_FILE": str(lmcache_file(tmp_path, text))}
    )
    assert (cfg.store_master, cfg.store_protocol) == ("10.0.0.5:50051", "tcp")
    assert (cfg.store_segment_size, cfg.store_timeout_s) == (str(256 * 1024**2), 3)
    bad = lmcache_file(tmp_path, text.replace("alloc: false", "alloc: true"))
    with pytest.raises(
        ConfigError, match=r"prefer_local_alloc True is not supported .*places every"
    ):
        config.load(PrefillConfig, "prefill", env={"LMCACHE_CONFIG_FILE": str(bad)})
    typo = lmcache_file(tmp_path, text + "  mooncake_protocl: tcp\n")
    with pytest.raises(ConfigError, match=r"unknown key extra_config.mooncake_protocl"):
        config.load(PrefillConfig, "prefill", env={"LMCACHE_CONFIG_FILE": str(typo)})


def test_lmcache_engine_keys_in_pdserves_own_file_say_where_they_belong(tmp_path):
    path = lmcache_file(tmp_path, "chunk_size: 16\nsave_decode_cache: true\n")
    with pytest.raises(
        ConfigError, match=r"save_decode_cache is LMCache's own setting .*LMCACHE_CONFIG_FILE"
    ):
        config.load(PrefillConfig, "prefill", yaml_path=path, env={})
    # the same file through LMCACHE_CONFIG_FILE: LMCache's setting, passed over
    cfg = config.load(PrefillConfig, "prefill", env={"LMCACHE_CONFIG_FILE": str(path)})
    assert cfg.chunk_size == 16
