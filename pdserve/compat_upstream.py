"""Upstream settings pdserve does not take, each with its reason: LMCache's own engine settings
(:data:`LMCACHE_OWN`) and the Mooncake / LMCache keys and ``MOONCAKE_*`` variables whose
non-default values pdserve cannot honour (:data:`REFUSED`). :func:`check` is the one front door:
a key at its upstream default passes (it changes nothing), any other value is a ConfigError that
says why. The keys pdserve honours are :data:`pdserve.compat.KEYS`."""

from __future__ import annotations

from typing import Any

from pdserve.config_fields import ConfigError

#: LMCache's own settings (LMCache 0.5.6's ``lmcache.v1.config`` definitions and aliases, less
#: the keys of :data:`pdserve.compat.KEYS`): they configure the LMCache engine, not pdserve, so in the file
#: ``LMCACHE_CONFIG_FILE`` names pdserve's services leave them to LMCache (one file serves
#: both; tests/test_compat.py keeps this list in step with the installed LMCache).
LMCACHE_OWN = frozenset(
    """
    app_id audit_actual_remote_url blend_check_layers blend_min_tokens
    blend_recompute_ratios blend_special_str blend_thresholds blocking_timeout_secs
    cache_policy chunk_statistics_auto_exit_target_unique_chunks
    chunk_statistics_auto_exit_timeout_hours chunk_statistics_auto_start_statistics
    chunk_statistics_strategy controller_pull_url controller_reply_url controller_url
    enable_async_loading enable_blending enable_chunk_statistics enable_controller
    enable_hidden_state_cache enable_kv_events enable_lazy_memory_allocator enable_p2p
    enable_pd enable_scheduler_bypass_lookup enable_xpyd external_backends
    external_lookup_client gds_backend gds_buffer_size gds_path gds_path_sharding
    hidden_state_layers hidden_states_retrieve_mode hit_miss_ratio
    internal_api_server_enabled internal_api_server_host
    internal_api_server_include_index_list internal_api_server_port_start
    internal_api_server_socket_path_prefix lazy_memory_expand_trigger_ratio
    lazy_memory_initial_ratio lazy_memory_safe_size lazy_memory_step_ratio
    lmcache_instance_id lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time
    lmcache_worker_ids lmcache_worker_port lmcache_worker_ports local_cpu_use_hugepages
    local_disk local_disk_path_sharding lookup_server_worker_ids lookup_timeout_ms maru_path
    maru_pool_size max_hidden_state_cpu_size max_local_disk_size min_retrieve_tokens mp_host
    mp_port nixl_backends nixl_buffer_device nixl_buffer_size nixl_peer_alloc_port
    nixl_peer_host nixl_peer_init_port nixl_proxy_host nixl_proxy_port nixl_role numa_mode
    p2p_host p2p_init_ports p2p_lookup_ports pd_allocation_timeout_sec pd_backend_mode
    pd_bidirectional pd_buffer_device pd_buffer_size pd_condition_poll_interval_sec
    pd_max_prefill_len pd_peer_alloc_port pd_peer_host pd_peer_init_port pd_peer_query_port
    pd_proxy_host pd_proxy_port pd_role pd_shutdown_timeout_sec pd_skip_proxy_notification
    pin_check_interval_sec pin_timeout_sec plugin_locations pre_caching_hash_algorithm
    priority_limit py_enable_gc remote_config_url remote_storage_plugins
    reserve_local_cpu_size retrieve_locations run_script_api_enabled
    runtime_plugin_locations save_decode_cache save_unfull_chunk script_allowed_imports
    storage_plugins store_location transfer_channel use_gds use_gpu_connector_v3
    use_layerwise
    """.split()  # noqa: SIM905 (a word list reads better than 110 quoted strings)
)

_OFF = ("", "0", "false", "no", "off")
_NO_SSD = (
    "pdserve's disk tier belongs to its storage nodes, not to a client: set kvstore_node.disk_path "
    "and disk_size (pdserve up: disk_size)"
)
_NO_HTTP = "Mooncake's client HTTP server is not implemented by pdserve"

#: key -> (values that change nothing, compared as lower-case strings with None as ""; why any
#: other value is refused). Mooncake's JSON (``MooncakeConfig``, vLLM's Mooncake store config)
#: and LMCache's ``mooncakestore://`` ``extra_config`` keys (also ``mooncake_``-prefixed).
REFUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "mode": (
        ("", "embedded"),
        "pdserve's workers join a Mooncake Store as embedded clients (vLLM's default); the "
        "standalone-store client process is not supported",
    ),
    "tenant_id": (("", "default"), "pdserve keeps tenants apart by cache_salt, not by tenant"),
    "enable_offload": (_OFF, _NO_SSD),
    "enable_ssd_offload": (_OFF, _NO_SSD),
    "ssd_offload_path": (("",), _NO_SSD),
    "storage_root_dir": (("",), _NO_SSD),
    "enable_client_http_server": (_OFF, _NO_HTTP),
    "client_http_port": (("", "9300"), _NO_HTTP),
    "prefer_local_alloc": (
        _OFF,
        "pdserve's master places every chunk (replicas, node health); a client cannot ask for "
        "its own node",
    ),
}
#: Mooncake's environment-only configuration variables for the keys above.
REFUSED_ENV = {
    "MOONCAKE_TENANT_ID": "tenant_id",
    "MOONCAKE_OFFLOAD_ENABLED": "enable_offload",
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "ssd_offload_path",
    "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": "enable_client_http_server",
    "MOONCAKE_CLIENT_HTTP_PORT": "client_http_port",
}
#: Why some of LMCache's own settings mean nothing to pdserve's services, beyond the general
#: reason (:func:`check`).
_LMCACHE_WHY = {
    "local_disk": _NO_SSD,
    "max_local_disk_size": _NO_SSD,
    "local_disk_path_sharding": _NO_SSD,
    "remote_storage_plugins": "pdserve's services reach the store through remote_url",
    "pre_caching_hash_algorithm": (
        "pdserve keys chunks by its own chained BLAKE3 prefix hash (docs/architecture.md)"
    ),
}


def known(key: str) -> bool:
    """Whether ``key`` is an upstream setting :func:`check` has a reason for."""
    return key in REFUSED or key in LMCACHE_OWN


def check(key: str, value: Any, *, what: str) -> None:
    """Passes when ``value`` changes nothing in pdserve; otherwise a ConfigError naming ``what``
    (the file or variable), the key and the reason. LMCache's own settings are refused in
    pdserve's own config files whatever their value: they belong to LMCache's file."""
    if key in LMCACHE_OWN:
        why = _LMCACHE_WHY.get(key, "pdserve's services have no such setting")
        raise ConfigError(
            f"{what}: {key} is LMCache's own setting ({why}); keep it in the file "
            "LMCACHE_CONFIG_FILE names, whose LMCache settings pdserve's services pass over"
        )
    off, why = REFUSED[key]
    shown = "" if value is None else str(value).strip().lower()
    if shown not in off:
        raise ConfigError(f"{what}: {key} {value!r} is not supported by pdserve ({why})")


def markdown_table() -> str:
    """The table of :data:`REFUSED` in docs/configuration.md (a test keeps the doc in step)."""
    env = {key: var for var, key in REFUSED_ENV.items()}
    rows = ["| key | variable | passes at | refused otherwise, because |", "|---|---|---|---|"]
    for key, (off, why) in REFUSED.items():
        shown = ", ".join(f"`{v}`" if v else "unset" for v in off)
        rows.append(f"| `{key}` | {f'`{env[key]}`' if key in env else '-'} | {shown} | {why} |")
    return "\n".join(rows)
