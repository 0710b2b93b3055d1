"""LMCache's configuration vocabulary, translated by lmcache.upstream through load_config:
every mapping, every refusal, the environment forms deployments use, the anchors'
example files, and the coverage of upstream's real key list."""

from __future__ import annotations

import ast
import glob
import logging
import os
from pathlib import Path

import pytest

from lmcache import upstream
from lmcache.config import KVSpec, _physical_memory, load_config
from lmcache.errors import ConfigError
from tests._missing import missing

GB = 1 << 30
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_warnings():
    """Each test sees the once-per-process warnings afresh."""
    upstream._warned.clear()
    yield
    upstream._warned.clear()


def tiers(cfg) -> list[tuple]:
    return [(t.backend, t.capacity, t.codec, t.policy, t.options) for t in cfg.tiers]


# ------------------------------------------------------------------ storage
def test_upstream_defaults_apply_once_its_vocabulary_is_used():
    # llm-d sets no LMCACHE_LOCAL_CPU: upstream's default (True) applies
    cfg = load_config(None, environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": "2.0"})
    assert tiers(cfg) == [("cpu", 2 * GB, "raw", "lru", {})]
    assert cfg.source_of("tiers") == "env:LMCACHE_MAX_LOCAL_CPU_SIZE"
    # any upstream-only key: upstream's 5 GB cpu tier
    cfg = load_config(None, environ={"LMCACHE_USE_LAYERWISE": "False"})
    assert tiers(cfg) == [("cpu", 5 * GB, "raw", "lru", {})]
    # a shared key alone keeps our defaults
    cfg = load_config(None, environ={"LMCACHE_CHUNK_SIZE": "256"})
    assert tiers(cfg) == [("cpu", GB, "raw", "lru", {})] and cfg.chunk_size == 256


def test_vllm_cpu_offload_example_env():
    env = {"LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "5.0"}
    cfg = load_config(None, environ=env)
    assert cfg.chunk_size == 256 and tiers(cfg) == [("cpu", 5 * GB, "raw", "lru", {})]
    assert cfg.source_of("chunk_size") == "env:LMCACHE_CHUNK_SIZE"
    assert cfg.source_of("tiers") == "env:LMCACHE_LOCAL_CPU, env:LMCACHE_MAX_LOCAL_CPU_SIZE"


def test_connector_overrides_take_upstream_keys():
    """vLLM's --kv-offloading-backend lmcache: {"lmcache.local_cpu": true, "lmcache.max_local_cpu_size": 2}."""
    cfg = load_config(None, environ={}, local_cpu=True, max_local_cpu_size=2)
    assert tiers(cfg) == [("cpu", 2 * GB, "raw", "lru", {})] and cfg.source_of("tiers") == "override"


def test_disk_from_llm_d_env(tmp_path):
    env = {"LMCACHE_LOCAL_DISK": f"file://{tmp_path}/kv/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "400.0",
           "LMCACHE_EXTRA_CONFIG": '{"use_odirect": false}', "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"}
    cfg = load_config(None, environ=env)
    assert tiers(cfg) == [("cpu", GB, "raw", "lru", {}),
                          ("disk", 400 * GB, "raw", "lru", {"path": f"{tmp_path}/kv/", "o_direct": False})]


def test_local_disk_forms(tmp_path, caplog):
    both = {"max_local_disk_size": 1, "local_cpu": False}
    assert load_config({"local_disk": "/a/", **both}, environ={}).tiers[0].options == {"path": "/a/"}
    two = load_config({"local_disk": "file:///a/,/b/", **both}, environ={}).tiers
    assert [(t.name, t.options["path"], t.capacity) for t in two] == [("disk", "/a/", GB // 2), ("disk-1", "/b/", GB // 2)]
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        # the Helm Ray template's "True": upstream's parse makes it the directory True
        assert load_config(None, environ={"LMCACHE_LOCAL_DISK": "True", "LMCACHE_MAX_LOCAL_DISK_SIZE": "640",
                                          "LMCACHE_LOCAL_CPU": "False"}).tiers[0].options == {"path": "True"}
    assert "directory 'True'" in caplog.text
    assert load_config({"local_disk": True, **both}, environ={}).tiers[0].options == {"path": "True"}
    # "False", or a path without a size (production stack's main template): no disk tier
    for data in ({"local_disk": "False", "max_local_disk_size": 5}, {"max_local_disk_size": 640},
                 {"local_disk": "/a/"}):
        assert [t.backend for t in load_config(data, environ={}).tiers] == ["cpu"]


def test_no_storage_at_all_is_a_small_cpu_tier(caplog):
    """The production stack's PD storage env with PD off: nothing to store in; the engine still runs."""
    env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_REMOTE_SERDE": "NULL",
           "LMCACHE_ENABLE_NIXL": "False", "LMCACHE_NIXL_ROLE": "sender", "LMCACHE_NIXL_ENABLE_GC": "True"}
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        cfg = load_config(None, environ=env)
    assert tiers(cfg) == [("cpu", upstream.NO_STORAGE_CPU, "raw", "lru", {})] and cfg.pd.role == "off"
    assert "ask for no storage" in caplog.text and "nixl_enable_gc" in caplog.text
    assert "PD keys (nixl_role) have no effect: enable_pd is not true" in caplog.text


@pytest.mark.parametrize("url,backend,our_url", [
    ("lm://cache-server-service:80", "lm", "lm://cache-server-service:80"),
    ("redis://localhost:6379", "redis", "redis://localhost:6379"),
    ("rediss://u:p@redis.example.com:6380/0", "redis", "rediss://u:p@redis.example.com:6380/0"),
    ("redis-sentinel://u:p@s1:26379,s2:26379/mymaster", "redis", "redis+sentinel://u:p@s1:26379,s2:26379/mymaster"),
    ("redis-sentinel://s1:26379", "redis", "redis+sentinel://s1:26379/redismaster"),
    ("redis-cluster://h1:7000,h2:7001", "redis", "redis+cluster://h1:7000,h2:7001"),
    ("resp://localhost:6379", "redis", "redis://localhost:6379"),
    ("valkey://localhost:6379", "valkey", "valkey://localhost:6379"),
    ("mooncakestore://master:50051", "mooncake", "mooncake://master:50051"),
    ("fs://localhost:0/mnt/shared", "fs", "file:///mnt/shared"),
    ("s3://kv-cache.s3.us-east-1.amazonaws.com", "s3", "s3://kv-cache"),
])
def test_remote_url_schemes(url, backend, our_url):
    cfg = load_config({"remote_url": url, "local_cpu": False, "remote_serde": "naive"}, environ={})
    (t,) = cfg.tiers
    assert (t.backend, t.options["url"], t.codec, t.capacity) == (backend, our_url, "raw", upstream.UNBOUNDED)


def test_remote_extra_config_and_sentinel_master_from_environment():
    extra = {"valkey_mode": "cluster", "s3_region": "eu-west-1", "master_server_address": "m:50052",
             "global_segment_size": 3355443200, "mooncake_protocol": "tcp"}
    opts = {u.split(":")[0]: load_config({"remote_url": u, "extra_config": extra}, environ={}).tiers[1].options
            for u in ("valkey://h:6379", "s3://bucket/pre", "mooncakestore://ignored:1")}
    assert opts["valkey"]["url"] == "valkey+cluster://h:6379"
    assert opts["s3"] == {"url": "s3://bucket/pre", "region": "eu-west-1"}
    assert opts["mooncakestore"] == {"url": "mooncake://m:50052", "global_segment_size": 3355443200, "protocol": "tcp"}
    cfg = load_config(None, environ={"LMCACHE_REMOTE_URL": "redis-sentinel://s1:26379", "REDIS_SERVICE_NAME": "kv"})
    assert cfg.tiers[1].options["url"] == "redis+sentinel://s1:26379/kv"


def test_remote_serde():
    def codec(**kw):
        return load_config({"remote_url": "lm://h:1", **kw}, environ={}).tiers[-1].codec
    assert codec(remote_serde="cachegen") == "cachegen"
    assert codec(remote_serde=None) == codec(remote_serde="NULL") == codec(remote_serde="naive") == codec() == "raw"
    assert load_config(None, environ={"LMCACHE_REMOTE_URL": "lm://h:1",
                                      "LMCACHE_REMOTE_SERDE": "NULL"}).tiers[-1].codec == "raw"
    with pytest.raises(ConfigError, match=r"'remote_serde'.*'kivi' is not naive, cachegen or NULL"):
        codec(remote_serde="kivi")


@pytest.mark.parametrize("url,match", [
    ("infinistore://127.0.0.1:12345", r"'remote_url'.*scheme 'infinistore' has no backend here"),
    ("unix:///run/redis.sock", r"'remote_url'.*scheme 'unix' has no backend"),
    ("localhost:6379", r"'remote_url'.*has no scheme"),
    ("lm://host:notaport", r"'remote_url'.*malformed lm:// URL"),
    ("redis://:secret@:6379", r"'remote_url'.*the redis:// URL 'redis://:\*\*\*@:6379' names no host"),
])
def test_bad_remote_url_names_key_and_scheme(url, match):
    with pytest.raises(ConfigError, match=match) as ei:
        load_config(None, environ={"LMCACHE_REMOTE_URL": url})
    assert "$LMCACHE_REMOTE_URL" in str(ei.value) and "secret" not in str(ei.value)


def test_gds_and_cache_policy(caplog):
    cfg = load_config({"gds_path": "/mnt/nvme", "use_gds": False, "cache_policy": "LFU", "local_cpu": False},
                      environ={})
    assert tiers(cfg) == [("gds", upstream.UNBOUNDED, "raw", "lfu", {"path": "/mnt/nvme", "use_kvikio": False})]
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        assert load_config({"cache_policy": "MRU"}, environ={}).tiers[0].policy == "lru"
    assert "no MRU policy" in caplog.text
    with pytest.raises(ConfigError, match=r"'cache_policy'.*'ARC' is not one of lru, lfu, fifo, mru"):
        load_config({"cache_policy": "ARC"}, environ={})


def test_memory_check_names_the_upstream_key():
    total = _physical_memory()
    if not total:
        missing("this platform does not report its physical memory")
    too_much = f"{total / GB * 2 + 1:.1f}"
    with pytest.raises(ConfigError, match=r"^config key 'max_local_cpu_size' \(in \$LMCACHE_MAX_LOCAL_CPU_SIZE\): "
                                          r"the memory pool would need .* more than this machine has"):
        load_config(None, environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": too_much})
    # llm-d's exact value: refused, naming the key, on any machine that has less
    if total < 200 * GB + (256 << 20):
        with pytest.raises(ConfigError, match=r"'max_local_cpu_size'"):
            load_config(None, environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": "200.0"})
    else:
        assert load_config(None, environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": "200.0"}).tiers[0].capacity == 200 * GB


# ------------------------------------------------------------------ the other sections
def test_engine_and_vllm_keys():
    cfg = load_config({"pre_caching_hash_algorithm": "sha256_cbor", "pin_timeout_sec": 300, "use_layerwise": True,
                       "enable_async_loading": True, "lookup_timeout_ms": 3000, "save_unfull_chunk": False},
                      environ={})
    assert (cfg.hash_algorithm, cfg.lookup_pin_timeout, cfg.save_unfull_chunk) == ("blake2b", 300.0, False)
    assert (cfg.vllm.layerwise, cfg.vllm.async_loads, cfg.vllm.lookup_timeout) == (True, "auto", 3.0)
    assert cfg.source_of("vllm.layerwise") == cfg.source_of("hash_algorithm") == "mapping"
    assert load_config({"pre_caching_hash_algorithm": "builtin"}, environ={}).hash_algorithm == "xxh3_128"
    assert load_config({"enable_async_loading": False}, environ={}).vllm.async_loads == "never"
    with pytest.raises(ConfigError, match=r"'pre_caching_hash_algorithm'.*'md5' is not one of"):
        load_config({"pre_caching_hash_algorithm": "md5"}, environ={})


def test_production_stack_controller_env():
    env = {"LMCACHE_ENABLE_CONTROLLER": "True", "LMCACHE_LMCACHE_INSTANCE_ID": "pod-1",
           "LMCACHE_CONTROLLER_PULL_URL": "rel-router-service:9000", "LMCACHE_CONTROLLER_REPLY_URL": "r:9001",
           "LMCACHE_LMCACHE_WORKER_PORTS": "8001", "LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME": "30",
           "LMCACHE_P2P_HOST": "localhost", "LMCACHE_P2P_INIT_PORTS": "30081", "LMCACHE_ENABLE_P2P": "True",
           "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_SERVER_SERVICE_PORT": "81", "LMCACHE_ENABLE_KV_EVENTS": "true"}
    cfg = load_config(None, environ=env)
    c = cfg.controller
    # a 30 s beat would make the instance flap at lmcache controller's 10 s instance timeout: ours stays
    assert (c.url, c.instance_id, c.heartbeat_interval) == ("http://rel-router-service:9000", "pod-1", 2.0)
    assert (cfg.p2p.enabled, cfg.p2p.host, cfg.p2p.port, cfg.kv_events.enabled) == (True, "localhost", 30081, True)
    assert cfg.source_of("controller.instance_id") == "env:LMCACHE_LMCACHE_INSTANCE_ID"
    assert cfg.source_of("controller.url") == "env:LMCACHE_CONTROLLER_PULL_URL"
    # the controller off: its address is kept out
    assert load_config({"enable_controller": False, "controller_pull_url": "h:1"}, environ={}).controller.url is None
    with pytest.raises(ConfigError, match=r"'controller_pull_url'.*required when enable_controller"):
        load_config({"enable_controller": True}, environ={})
    with pytest.raises(ConfigError, match=r"'controller_pull_url'.*expected host:port"):
        load_config({"enable_controller": True, "controller_pull_url": "router"}, environ={})


def test_internal_api_server():
    cfg = load_config(None, environ={"LMCACHE_INTERNAL_API_SERVER_ENABLED": "True",
                                     "LMCACHE_INTERNAL_API_SERVER_PORT_START": "6999",
                                     "LMCACHE_INTERNAL_API_SERVER_HOST": "0.0.0.0"})
    assert (cfg.api.enabled, cfg.api.host, cfg.api.port) == (True, "0.0.0.0", 6999)


# ------------------------------------------------------------------ prefill->decode (PD)
PD_PREFILLER = ('enable_pd: True\ntransfer_channel: "nixl"\npd_role: "sender"\npd_proxy_host: "localhost"\n'
                'pd_proxy_port: 7500\npd_buffer_size: 1073741824\npd_buffer_device: "cuda"\nnixl_backends: [UCX]\n')
PD_DECODER = ('enable_pd: True\ntransfer_channel: "nixl"\npd_role: "receiver"\npd_peer_host: "localhost"\n'
              'pd_peer_init_port: 7300\npd_peer_alloc_port: 7400\npd_buffer_size: 2147483648\n'
              'pd_buffer_device: "cuda"\nnixl_backends: [UCX]\n')


def test_lmcache_1p1d_prefiller_and_decoder_files(tmp_path, caplog):
    """LMCache's 1P1D example files (docs, disagg_prefill/1p1d): a PD sender and a PD receiver."""
    files = {}
    for name, text in (("prefiller", PD_PREFILLER), ("decoder", PD_DECODER)):
        files[name] = tmp_path / f"lmcache-{name}-config.yaml"
        files[name].write_text(text)
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        pre = load_config(files["prefiller"], environ={}, too_big=lambda e: None)  # LMCache's 5 GB cpu default
        dec = load_config(files["decoder"], environ={}, too_big=lambda e: None)
    assert not [r for r in caplog.records if "no effect" in r.getMessage()]
    assert (pre.pd.role, pre.pd.proxy_host, pre.pd.proxy_port, pre.pd.notify) == ("sender", "localhost", 7500, True)
    assert (pre.transfer_channel, pre.transfer.buffer_size, pre.transfer.nixl_backends) == ("nixl", GB, ["UCX"])
    assert pre.source_of("pd.role") == pre.source_of("transfer.buffer_size") == f"file:{files['prefiller']}"
    assert (dec.pd.role, dec.pd.peer_host, dec.pd.peer_init_port, dec.pd.peer_alloc_port) == \
        ("receiver", "localhost", [7300], [7400])
    assert (dec.transfer_channel, dec.transfer.buffer_size, dec.transfer.nixl_backends) == ("nixl", 2 * GB, ["UCX"])
    assert dec.vllm.skip_last_n_tokens == 0  # LMCache's decoders set it in kv_connector_extra_config
    # with local_cpu: False (the docs' prefiller) the cpu tier is the PD buffer: received KV lives in the top tier
    f = tmp_path / "no-cpu.yaml"
    f.write_text(PD_PREFILLER + "local_cpu: False\n")
    assert tiers(load_config(f, environ={})) == [("cpu", GB, "raw", "lru", {})]


PS_DECODE_POD = {
    "LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_ENABLE_PD": "True",
    "LMCACHE_ENABLE_NIXL": "True", "LMCACHE_TRANSFER_CHANNEL": "nixl", "LMCACHE_PD_TRANSFER_CHANNEL": "nixl",
    "LMCACHE_PD_ROLE": "receiver", "LMCACHE_NIXL_ROLE": "receiver", "LMCACHE_PD_BUFFER_SIZE": "58720256",
    "LMCACHE_NIXL_BUFFER_SIZE": "58720256", "LMCACHE_PD_BUFFER_DEVICE": "cuda", "LMCACHE_NIXL_BUFFER_DEVICE": "cuda",
    "LMCACHE_PD_PEER_HOST": "0.0.0.0", "LMCACHE_NIXL_PEER_HOST": "0.0.0.0", "LMCACHE_PD_PEER_INIT_PORT": "7300",
    "LMCACHE_NIXL_PEER_INIT_PORT": "7300", "LMCACHE_PD_PEER_ALLOC_PORT": "7400", "LMCACHE_NIXL_PEER_ALLOC_PORT": "7400",
    "LMCACHE_ENABLE_XPYD": "False", "LMCACHE_RPC_PORT": "consumer1", "LMCACHE_SKIP_LAST_N_TOKENS": "1",
    "LMCACHE_REMOTE_SERDE": "naive",
}


def test_production_stack_pd_pods_env(caplog):
    """production-stack's operator environment for a decode pod and a prefill pod: PD on
    (its LMCACHE_ENABLE_XPYD=False beside LMCACHE_ENABLE_PD=True does not switch it off),
    the cpu tier the size of the PD buffer, no warning but the CUDA note."""
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        dec = load_config(None, environ=PS_DECODE_POD)
    assert (dec.pd.role, dec.pd.peer_host, dec.pd.peer_init_port, dec.pd.peer_alloc_port) == \
        ("receiver", "0.0.0.0", [7300], [7400])
    assert tiers(dec) == [("cpu", 58720256, "raw", "lru", {})] and dec.transfer.buffer_size == 58720256
    assert (dec.transfer_channel, dec.vllm.skip_last_n_tokens) == ("nixl", 1)
    assert (dec.source_of("pd.role"), dec.source_of("transfer_channel")) == ("env:LMCACHE_PD_ROLE", "env:LMCACHE_TRANSFER_CHANNEL")
    assert dec.source_of("tiers") == "env:LMCACHE_LOCAL_CPU, env:LMCACHE_MAX_LOCAL_CPU_SIZE, env:LMCACHE_REMOTE_SERDE, " \
                                     "env:LMCACHE_ENABLE_PD, env:LMCACHE_PD_BUFFER_SIZE"
    assert not [r for r in caplog.records if "no CUDA" not in r.getMessage()], caplog.text
    prefill = {k: v for k, v in PS_DECODE_POD.items() if "PEER" not in k and k != "LMCACHE_SKIP_LAST_N_TOKENS"}
    prefill.update({"LMCACHE_PD_ROLE": "sender", "LMCACHE_NIXL_ROLE": "sender", "LMCACHE_RPC_PORT": "producer1",
                    "LMCACHE_PD_PROXY_HOST": "pd-proxy", "LMCACHE_PD_PROXY_PORT": "7500",
                    "LMCACHE_NIXL_PROXY_HOST": "pd-proxy", "LMCACHE_NIXL_PROXY_PORT": "7500"})
    pre = load_config(None, environ=prefill)
    assert (pre.pd.role, pre.pd.proxy_host, pre.pd.proxy_port, pre.pd.peer_init_port) == ("sender", "pd-proxy", 7500, [])
    assert (tiers(pre), pre.vllm.skip_last_n_tokens, pre.transfer_channel) == ([("cpu", 58720256, "raw", "lru", {})], 0, "nixl")


def test_old_nixl_prefiller_file(tmp_path, caplog):
    """lmcache-prefiller-config.yaml of LMCache's NIXL days: the old names, the same PD sender."""
    f = tmp_path / "lmcache-prefiller-config.yaml"
    f.write_text(ANCHOR_FILES["lmcache-prefiller-config.yaml @5ee0c1f (old NIXL keys)"][0])
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        cfg = load_config(f, environ={})
    assert (cfg.pd.role, cfg.pd.peer_host, cfg.pd.peer_init_port) == ("sender", "localhost", [55555])
    assert tiers(cfg) == [("cpu", GB, "raw", "lru", {})] and cfg.transfer.buffer_size == GB
    assert cfg.transfer_channel == "nixl" and cfg.source_of("transfer_channel") == "default:pd.role"
    assert [m.split(" has no effect")[0] for m in (r.getMessage() for r in caplog.records) if "no effect" in m] == \
        ["LMCache config key nixl_enable_gc"]


@pytest.mark.parametrize("file,env,overrides,role", [
    ({}, {"LMCACHE_ENABLE_XPYD": "False", "LMCACHE_ENABLE_PD": "True", "LMCACHE_PD_ROLE": "receiver"}, {}, "receiver"),
    ({"enable_xpyd": False, "enable_pd": True, "pd_role": "sender"}, {}, {}, "sender"),
    ({"enable_pd": True, "enable_xpyd": False, "nixl_role": "receiver", "pd_role": "sender"}, {}, {}, "sender"),
    ({"enable_pd": True, "pd_role": "sender"}, {"LMCACHE_NIXL_ROLE": "receiver", "LMCACHE_ENABLE_NIXL": "0"}, {},
     "sender"),
    ({"nixl_role": "receiver", "enable_xpyd": True}, {"LMCACHE_PD_ROLE": "sender"}, {}, "sender"),
    ({"enable_pd": True, "pd_role": "sender"}, {}, {"nixl_role": "receiver", "enable_xpyd": False}, "sender"),
    ({"nixl_role": "receiver", "enable_nixl": True}, {"LMCACHE_NIXL_ROLE": "sender"}, {}, "sender"),  # old over old: later
])
def test_current_name_wins_over_its_old_name(file, env, overrides, role, caplog):
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        assert load_config(file, environ=env, **overrides).pd.role == role
    assert caplog.records == []


def test_pd_transfer_channel_variable():
    assert load_config(None, environ={"LMCACHE_PD_TRANSFER_CHANNEL": "tcp"}).transfer_channel == "tcp"
    both = {"LMCACHE_PD_TRANSFER_CHANNEL": "tcp", "LMCACHE_TRANSFER_CHANNEL": "nixl"}
    assert load_config(None, environ=both).transfer_channel == "nixl"
    assert load_config({"transfer_channel": "nixl"}, environ={"LMCACHE_PD_TRANSFER_CHANNEL": "tcp"}).transfer_channel == "nixl"
    assert load_config({"enable_pd": True, "pd_role": "sender", "transfer_channel": "tcp"}, environ={}).transfer_channel == "tcp"


def test_enable_pd_without_pd_role_is_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'pd_role' \(in \$LMCACHE_ENABLE_PD\): is required when "
                                          r"enable_pd is true: sender, receiver or both$"):
        load_config(None, environ={"LMCACHE_ENABLE_PD": "True"})
    f = tmp_path / "pd.yaml"
    f.write_text("enable_pd: true\npd_peer_host: localhost\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    assert ei.value.key == "pd_role" and str(f) in str(ei.value) and "\n" not in str(ei.value)


def test_pd_allocation_timeout_is_capped(caplog):
    pd = {"enable_pd": True, "pd_role": "sender"}
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        assert load_config({**pd, "pd_allocation_timeout_sec": float("inf")}, environ={}).transfer.alloc_wait == 60.0
        env = {"LMCACHE_ENABLE_PD": "1", "LMCACHE_PD_ROLE": "sender", "LMCACHE_PD_ALLOCATION_TIMEOUT_SEC": "inf"}
        assert load_config(None, environ=env).transfer.alloc_wait == 60.0
    assert sum("never retried forever" in r.getMessage() for r in caplog.records) == 1
    assert load_config({**pd, "pd_allocation_timeout_sec": 1e9}, environ={}).transfer.alloc_wait == 60.0
    assert load_config({**pd, "pd_allocation_timeout_sec": 10}, environ={}).transfer.alloc_wait == 10.0
    with pytest.raises(ConfigError, match=r"'pd_allocation_timeout_sec'.*positive number of seconds"):
        load_config({**pd, "pd_allocation_timeout_sec": 0}, environ={})


def test_pd_off_leaves_its_keys_without_effect(caplog):
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        cfg = load_config({"enable_pd": False, "pd_role": "sender", "pd_buffer_size": 1 << 20,
                           "nixl_backends": ["UCX", "GDS"]}, environ={})
    assert (cfg.pd.role, cfg.transfer.buffer_size, cfg.transfer_channel) == ("off", None, None)
    assert cfg.transfer.nixl_backends == ["UCX", "GDS"]  # the nixl channel's, PD or not
    assert "PD keys (pd_role, pd_buffer_size) have no effect: enable_pd is not true" in caplog.text
    assert load_config({"pd_role": "receiver"}, environ={}).pd.role == "off"  # LMCache's enable_pd default: false
    # the connector's own skip_last_n_tokens wins over the variable, quietly
    env = {"LMCACHE_SKIP_LAST_N_TOKENS": "1"}
    assert load_config(None, environ=env).vllm.skip_last_n_tokens == 1
    assert load_config(None, environ=env, vllm={"skip_last_n_tokens": 2}).vllm.skip_last_n_tokens == 2


# ------------------------------------------------------------------ refusals, warnings, env forms
@pytest.mark.parametrize("ours,theirs,names", [
    ({"tiers": [{"backend": "cpu", "capacity": "1GiB"}]}, {"LMCACHE_LOCAL_CPU": "True"}, ("local_cpu", "tiers")),
    ({"tiers": [{"backend": "cpu", "capacity": "1GiB"}]}, {"LMCACHE_REMOTE_URL": "lm://h:1"}, ("remote_url", "tiers")),
    ({"hash_algorithm": "blake2b"}, {"LMCACHE_PRE_CACHING_HASH_ALGORITHM": "sha256"},
     ("pre_caching_hash_algorithm", "hash_algorithm")),
    ({"vllm": {"layerwise": True}}, {"LMCACHE_USE_LAYERWISE": "True"}, ("use_layerwise", "vllm.layerwise")),
    ({"controller": {"instance_id": "a"}}, {"LMCACHE_LMCACHE_INSTANCE_ID": "b"},
     ("lmcache_instance_id", "controller.instance_id")),
    ({"pd": {"role": "sender"}}, {"LMCACHE_ENABLE_PD": "True", "LMCACHE_PD_ROLE": "sender"}, ("enable_pd", "pd.role")),
    ({"transfer": {"buffer_size": "1GiB"}}, {"LMCACHE_ENABLE_PD": "1", "LMCACHE_PD_ROLE": "sender",
                                             "LMCACHE_NIXL_BUFFER_SIZE": "1024"}, ("pd_buffer_size", "transfer.buffer_size")),
])
def test_mixing_vocabularies_is_refused_naming_both(ours, theirs, names):
    with pytest.raises(ConfigError) as ei:
        load_config(ours, environ=theirs)
    assert all(n in str(ei.value) for n in names) and "\n" not in str(ei.value)


def test_mixing_across_file_and_overrides(tmp_path):
    f = tmp_path / "lmcache.yaml"
    f.write_text("local_cpu: true\nmax_local_cpu_size: 1\n")
    with pytest.raises(ConfigError, match=r"'local_cpu'.*our tiers \(override\)"):
        load_config(f, environ={}, tiers=[{"backend": "cpu", "capacity": "1GiB"}])
    # unrelated things in both vocabularies are fine: our tiers stay, upstream's defaults do not replace them
    cfg = load_config({"tiers": [{"backend": "cpu", "capacity": "2MiB"}]}, environ={"LMCACHE_USE_LAYERWISE": "1"})
    assert tiers(cfg) == [("cpu", 2 << 20, "raw", "lru", {})] and cfg.vllm.layerwise is True


def test_unknown_keys_still_refused():
    with pytest.raises(ConfigError, match=r"^config key 'local_cpus': unknown key; did you mean 'local_cpu' \(LMCache's\)\?$"):
        load_config({"local_cpus": True}, environ={})
    with pytest.raises(ConfigError, match=r"'max_local_cpu_sise'.*unknown key"):
        load_config(None, environ={}, max_local_cpu_sise=2)


def test_no_effect_keys_warned_once_each(caplog):
    env = {"LMCACHE_SAVE_DECODE_CACHE": "True", "LMCACHE_EXTRA_CONFIG": '{"lookup_backoff_time": 0.001}',
           "LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_FORCE_SKIP_SAVE": "1"}
    with caplog.at_level(logging.WARNING, "lmcache.config"):
        load_config(None, environ=env)
        load_config(None, environ=env)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("save_decode_cache has no effect" in m for m in msgs) == 1
    assert sum("extra_config.lookup_backoff_time has no effect" in m for m in msgs) == 1
    # read elsewhere (the LMCacheConnectorV1 adapter) or meaningless: quiet
    assert not any("LMCACHE_USE_EXPERIMENTAL" in m or "LMCACHE_FORCE_SKIP_SAVE" in m for m in msgs)


@pytest.mark.parametrize("env,match", [
    ({"LMCACHE_LOCAL_CPU": "maybe"}, r"'local_cpu' \(in \$LMCACHE_LOCAL_CPU\): expected True or False"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "5GB"}, r"'max_local_cpu_size'.*expected a number"),
    ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"}, r"'max_local_cpu_size'.*a number from 0 to 1048576, got '-1'"),
    ({"LMCACHE_EXTRA_CONFIG": "{use_odirect: false}"}, r"'extra_config'.*expected a JSON object"),
    ({"LMCACHE_EXTRA_CONFIG": "[1]"}, r"'extra_config'.*expected a mapping"),
    ({"LMCACHE_LOOKUP_TIMEOUT_MS": "1.5"}, r"'lookup_timeout_ms'.*expected an integer"),
    ({"LMCACHE_PD_ROLE": "decoder"}, r"'pd_role' \(in \$LMCACHE_PD_ROLE\): 'decoder' is not sender, receiver or both"),
    ({"LMCACHE_NIXL_PEER_PORT": "7300,70000"}, r"'pd_peer_init_port' \(in \$LMCACHE_NIXL_PEER_PORT\): must be <= 65535"),
    ({"LMCACHE_PD_PROXY_PORT": "7500,7501"}, r"'pd_proxy_port'.*expected one port"),
    ({"LMCACHE_PD_BUFFER_SIZE": "1GB"}, r"'pd_buffer_size'.*expected a number of bytes"),
    ({"LMCACHE_NIXL_BACKENDS": "UCX,a b"}, r"'nixl_backends\[1\]'.*may only contain"),
])
def test_bad_env_values_name_key_and_variable(env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, environ=env)


def test_env_quoting_and_converters():
    env = {"LMCACHE_LOCAL_CPU": "'true'", "LMCACHE_MAX_LOCAL_CPU_SIZE": '"1"', "LMCACHE_P2P_INIT_PORTS": "8200,8201"}
    cfg = load_config(None, environ=env)
    assert tiers(cfg)[0][:2] == ("cpu", GB) and cfg.p2p.port == 8200


# ------------------------------------------------------------------ the anchors' files
ANCHOR_FILES = {
    "centralized_sharing/example.yaml": (
        'chunk_size: 256\nlocal_device: "cpu"\nremote_url: "lm://localhost:65432"\nremote_serde: "cachegen"\n'
        "pipelined_backend: False\n", ["cpu", "lm"]),
    "p2p_sharing/example1.yaml": (
        'chunk_size: 256\nlocal_cpu: True\nmax_local_cpu_size: 1\nenable_async_loading: True\nenable_p2p: True\n'
        'p2p_host: "localhost"\np2p_init_ports: 8200\np2p_lookup_ports: 8201\ntransfer_channel: "nixl"\n'
        'enable_controller: True\nlmcache_instance_id: "lmcache_instance_1"\ncontroller_pull_url: "localhost:8300"\n'
        'controller_reply_url: "localhost:8400"\nlmcache_worker_ports: 8500\n'
        "extra_config:\n  lookup_backoff_time: 0.001\n", ["cpu"]),
    "lmcache-decoder-pd-with-remote-config.yaml": (
        'local_cpu: False\nmax_local_cpu_size: 0\nremote_url: "lm://localhost:6800"\nremote_serde: "cachegen"\n'
        'retrieve_locations: ["PDBackend"]\nstore_location: "RemoteBackend"\nenable_pd: True\n'
        'transfer_channel: "nixl"\npd_role: "receiver"\npd_peer_host: "localhost"\npd_peer_init_port: 7300\n'
        'pd_peer_alloc_port: 7400\npd_buffer_size: 2147483648\npd_buffer_device: "cuda"\nnixl_backends: [UCX]\n'
        "save_decode_cache: true\nsave_unfull_chunk: true\n", ["cpu", "lm"]),
    "prefiller (current docs)": (
        'enable_pd: True\ntransfer_channel: "nixl"\npd_role: "sender"\npd_proxy_host: "localhost"\n'
        'pd_proxy_port: 7500\npd_buffer_size: 1073741824\npd_buffer_device: "cuda"\nnixl_backends: [UCX]\n'
        "local_cpu: False\n", ["cpu"]),
    "lmcache-prefiller-config.yaml @5ee0c1f (old NIXL keys)": (
        'local_cpu: False\nmax_local_cpu_size: 0\nmax_local_disk_size: 0\nremote_serde: NULL\nenable_nixl: True\n'
        'nixl_role: "sender"\nnixl_peer_host: "localhost"\nnixl_peer_port: 55555\nnixl_buffer_size: 1073741824\n'
        'nixl_buffer_device: "cuda"\nnixl_enable_gc: True\n', ["cpu"]),
    "lmcache-decoder-config.yaml @313e0b1": (
        'enable_pd: True\ntransfer_channel: "nixl"\npd_role: "receiver"\npd_peer_host: "localhost"\n'
        'pd_peer_init_port: 7300\npd_peer_alloc_port: 7400\npd_buffer_size: 2147483648\n'
        'pd_buffer_device: "cuda"\nnixl_backends: [UCX]\n', ["cpu"]),
}


@pytest.mark.parametrize("name", list(ANCHOR_FILES))
def test_anchor_example_files_load(name, tmp_path):
    text, backends = ANCHOR_FILES[name]
    f = tmp_path / "lmcache.yaml"
    f.write_text(text)
    cfg = load_config(None, environ={"LMCACHE_CONFIG_FILE": str(f), "LMCACHE_USE_EXPERIMENTAL": "True"})
    assert [t.backend for t in cfg.tiers] == backends


def test_anchor_p2p_example_values(tmp_path):
    f = tmp_path / "example1.yaml"
    f.write_text(ANCHOR_FILES["p2p_sharing/example1.yaml"][0])
    cfg = load_config(f, environ={})
    assert cfg.controller.url == "http://localhost:8300" and cfg.controller.instance_id == "lmcache_instance_1"
    assert (cfg.p2p.enabled, cfg.p2p.port, cfg.vllm.async_loads) == (True, 8200, "auto")
    assert cfg.source_of("tiers") == f"file:{f}"


def test_report_shows_translated_values():
    report = load_config(None, environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": "1.5", "LMCACHE_USE_LAYERWISE": "True"}).report()
    assert report["values"]["tiers"][0]["capacity"] == int(1.5 * GB)
    assert report["sources"]["tiers"] == "env:LMCACHE_MAX_LOCAL_CPU_SIZE"
    assert report["sources"]["vllm.layerwise"] == "env:LMCACHE_USE_LAYERWISE"


# ------------------------------------------------------------------ upstream's own key list
def _reference_config() -> Path:
    """upstream's lmcache/v1/config.py: $UPSTREAM_LMCACHE_DIR (an unpacked lmcache package's
    parent) or the reference venv that `make test` builds."""
    root = os.environ.get("UPSTREAM_LMCACHE_DIR")
    found = [Path(root) / "lmcache/v1/config.py"] if root else [
        Path(p) for p in glob.glob(str(REPO / ".venv-lmcache-ref/lib/python3*/site-packages/lmcache/v1/config.py"))]
    if not found or not found[0].is_file():
        missing("upstream LMCache's lmcache/v1/config.py is absent: run make test, or "
                "bash requirements/setup-lmcache-ref.sh .venv-lmcache-ref")
    return found[0]


def _dict_keys(tree: ast.Module, name: str) -> list[str]:
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    raise AssertionError(f"{name} not found in upstream's config.py")


def test_every_upstream_key_is_mapped_or_accepted_without_effect():
    tree = ast.parse(_reference_config().read_text(encoding="utf-8"))
    definitions = _dict_keys(tree, "_CONFIG_DEFINITIONS")
    aliases = _dict_keys(tree, "_CONFIG_ALIASES")
    assert len(definitions) > 50 and aliases
    unknown = [k for k in definitions if k not in upstream.MAPPED and k not in upstream.NO_EFFECT]
    assert not unknown, f"upstream keys in neither MAPPED nor NO_EFFECT: {unknown}"
    unresolved = [a for a in aliases if upstream.ALIASES.get(a, a) not in {**upstream.MAPPED, **upstream.NO_EFFECT}]
    assert not unresolved, f"upstream aliases that resolve to no known key: {unresolved}"
    assert not set(upstream.MAPPED) & set(upstream.NO_EFFECT)


BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 9))
HOSTILE = [None, True, -1, 0, 1e308, float("nan"), float("inf"), "", "x" * 100_000, "::::", "lm://", "a,b,,c",
           [1, "x", None], {"a": {"b": [1, 2]}}, "BOMB"]


@pytest.mark.parametrize("key", sorted(upstream._CONVERT))
def test_hostile_values_of_mapped_keys_raise_only_config_error_and_short(key):
    import yaml

    bomb = yaml.safe_load(BOMB)["a8"]
    for value in HOSTILE:
        data = {key: bomb if value == "BOMB" else value}
        for wrap in (data, {**data, "remote_url": "lm://h:1", "enable_controller": True}):
            try:
                load_config(wrap, environ={})
            except ConfigError as exc:
                assert len(str(exc)) < 1000 and "\n" not in str(exc)


# ------------------------------------------------------------------ engines built from LMCache's settings
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_size=2, dtype="float32")


def _kv(tokens):
    import torch

    t = torch.as_tensor(list(tokens), dtype=torch.float32).reshape(1, 1, -1, 1, 1)
    return (t * 0.25 + torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 1, 2, 2)).contiguous()


def test_engines_from_upstream_env_share_kv_through_an_lm_server(tmp_path):
    """vLLM's sharing example (LMCACHE_LOCAL_CPU=False, remote lm://, serde naive) and the
    llm-d disk env, as real engines: what one stores, the other retrieves from the server."""
    import torch

    from lmcache import CacheEngine
    from tests._missing import loopback_store

    toks = list(range(64))
    with loopback_store("lm") as store:
        sharing = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "5.0", "LMCACHE_CHUNK_SIZE": "16",
                   "LMCACHE_REMOTE_URL": store.options["url"], "LMCACHE_REMOTE_SERDE": "naive"}
        disk = {"LMCACHE_CHUNK_SIZE": "16", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.004",
                "LMCACHE_LOCAL_DISK": f"file://{tmp_path}/kv-store-disk/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.05",
                "LMCACHE_EXTRA_CONFIG": '{"use_odirect": false}', "LMCACHE_REMOTE_URL": store.options["url"]}
        with CacheEngine(load_config(None, environ=disk), kv_spec=SPEC) as a:
            assert [t.backend for t in a.config.tiers] == ["cpu", "disk", "lm"]
            a.store(toks, _kv(toks))
            a.flush()  # the write-through copies reach the disk and the server before the engine closes
            assert a.config.tiers[1].options == {"path": f"{tmp_path}/kv-store-disk/", "o_direct": False}
            assert len(list((tmp_path / "kv-store-disk").rglob("*.lmc"))) == 4
        with CacheEngine(load_config(None, environ=sharing), kv_spec=SPEC) as b:
            assert [t.backend for t in b.config.tiers] == ["lm"]
            res = b.retrieve(toks)
            assert res.num_tokens == 64 and torch.equal(res.kv, _kv(toks)) and set(res.tiers) == {"lm"}


def test_an_engine_from_a_pd_config_with_no_storage_runs():
    import torch

    from lmcache import CacheEngine

    env = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0", "LMCACHE_REMOTE_SERDE": "NULL",
           "LMCACHE_ENABLE_NIXL": "True", "LMCACHE_NIXL_ROLE": "sender", "LMCACHE_NIXL_BUFFER_SIZE": str(16 << 20),
           "LMCACHE_CHUNK_SIZE": "16"}
    toks = list(range(32))
    with CacheEngine(load_config(None, environ=env), kv_spec=SPEC) as e:
        e.store(toks, _kv(toks))
        res = e.retrieve(toks)
        assert res.num_tokens == 32 and torch.equal(res.kv, _kv(toks))
