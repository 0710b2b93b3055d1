from __future__ import annotations

import pytest

import lmcache
from lmcache.config import KVSpec, load_config
from lmcache.errors import ConfigError
from lmcache.units import format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 << 30),
        ("500MB", 500_000_000),
        ("1.5 KiB", 1536),
        ("12", 12),
        (1048576, 1 << 20),
        ("2gb", 2_000_000_000),
        ("7 B", 7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4 GiBs", "-1", "", "x", -5, True, None, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(10) == "10 B"


def test_defaults():
    cfg = load_config({})
    assert cfg.chunk_size == 256
    assert cfg.save_unfull_chunk is True
    assert cfg.write_policy == "write-through"
    assert cfg.namespace == "default"
    assert [t.backend for t in cfg.tiers] == ["cpu"]


def test_yaml_file_env_and_overrides_in_order(tmp_path):
    f = tmp_path / "lmcache.yaml"
    f.write_text(
        "chunk_size: 128\n"
        "namespace: team-a\n"
        "tiers:\n"
        "  - {backend: cpu, capacity: 4GiB}\n"
        "  - {backend: disk, path: /tmp/x, capacity: 200GiB, codec: zstd, policy: lfu}\n"
        "write_policy: write-back\n"
    )
    cfg = load_config(f, environ={})
    assert cfg.chunk_size == 128 and cfg.write_policy == "write-back"
    assert cfg.tiers[0].capacity == 4 << 30
    disk = cfg.tiers[1]
    assert (disk.backend, disk.capacity, disk.codec, disk.policy) == ("disk", 200 << 30, "zstd", "lfu")
    assert disk.options == {"path": "/tmp/x"}
    assert cfg.source == str(f)

    env = {"LMCACHE_CHUNK_SIZE": "512", "LMCACHE_SAVE_UNFULL_CHUNK": "false"}
    cfg = load_config(f, environ=env)
    assert cfg.chunk_size == 512 and cfg.save_unfull_chunk is False
    cfg = load_config(f, environ=env, chunk_size=64)
    assert cfg.chunk_size == 64


def test_config_file_from_environment(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("namespace: fromfile\n")
    cfg = load_config(None, environ={"LMCACHE_CONFIG_FILE": str(f)})
    assert cfg.namespace == "fromfile"


def test_tiers_from_environment():
    cfg = load_config({}, environ={"LMCACHE_TIERS": "[{backend: cpu, capacity: 2MiB}]"})
    assert cfg.tiers[0].capacity == 2 << 20


def test_unknown_env_variable_is_only_warned(caplog):
    cfg = load_config({}, environ={"LMCACHE_CHUNKSIZE": "5", "LMCACHE_DEBUG": "1"})
    assert cfg.chunk_size == 256
    assert "LMCACHE_CHUNKSIZE" in caplog.text
    assert "LMCACHE_DEBUG" not in caplog.text


@pytest.mark.parametrize(
    "yaml_text,key,fragment",
    [
        ("chunk_sise: 128\n", "chunk_sise", "did you mean 'chunk_size'"),
        ("chunk_size: big\n", "chunk_size", "expected an integer"),
        ("chunk_size: 0\n", "chunk_size", "must be >= 1"),
        ("save_unfull_chunk: 3\n", "save_unfull_chunk", "true or false"),
        ("write_policy: sometimes\n", "write_policy", "write-through, write-back"),
        ("namespace: 'a/b'\n", "namespace", "may only contain"),
        ("tiers: []\n", "tiers", "non-empty list"),
        ("tiers: [{capacity: 1GiB}]\n", "tiers[0].backend", "required"),
        ("tiers: [{backend: cpu}]\n", "tiers[0].capacity", "required"),
        ("tiers: [{backend: cpu, capacity: lots}]\n", "tiers[0].capacity", "cannot read 'lots'"),
        ("tiers: [{backend: cpu, capacity: 0}]\n", "tiers[0].capacity", "larger than 0"),
        (
            "tiers: [{backend: cpu, capacity: 1GiB}, {backend: cpu, capacity: 1GiB}]\n",
            "tiers",
            "two tiers are named 'cpu'",
        ),
        ("kv_spec: {num_layers: 0, num_kv_heads: 1, head_size: 8}\n", "kv_spec.num_layers", "positive"),
        ("kv_spec: {num_layers: 2, num_kv_heads: 1, head_size: 8, dtype: float17}\n", "kv_spec.dtype", "unknown dtype"),
        ("kv_spec: {layers: 2}\n", "kv_spec.layers", "unknown key"),
        ("lookup_pin_timeout: -1\n", "lookup_pin_timeout", "positive"),
        ("pd: {role: decoder}\n", "pd.role", "must be one of off, sender, receiver, both; got 'decoder'"),
        ("pd: decoder\n", "pd.role", "must be one of off, sender, receiver, both"),
        ("pd: {role: receiver, peer_init_port: 70000}\n", "pd.peer_init_port", "must be <= 65535, got 70000"),
        ("pd: {peer_init_port: '7300,x'}\n", "pd.peer_init_port", "expected an integer"),
        ("pd: {peer_alloc_port: [7400, 0]}\n", "pd.peer_alloc_port", "must be >= 1"),
        ("pd: {proxy_port: 70000}\n", "pd.proxy_port", "must be <= 65535"),
        ("pd: {recv_timeout: 0}\n", "pd.recv_timeout", "positive"),
        ("pd: {notify: maybe}\n", "pd.notify", "true or false"),
        ("pd: {rol: sender}\n", "pd.rol", "did you mean 'role'"),
        ("transfer: {advertise_host: ''}\n", "transfer.advertise_host", "non-empty string"),
        ("vllm: {skip_last_n_tokens: -1}\n", "vllm.skip_last_n_tokens", "must be >= 0"),
        ("- 1\n- 2\n", "<file>", "mapping"),
        ("chunk_size: [\n", "<file>", "not valid YAML"),
    ],
)
def test_errors_name_the_key_and_the_file(tmp_path, yaml_text, key, fragment):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml_text)
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    err = ei.value
    assert err.key == key
    assert str(f) in str(err)
    assert fragment in str(err)


PD_SECTION = """\
pd:
  role: receiver
  peer_host: 0.0.0.0
  peer_init_port: "7300,7301"
  peer_alloc_port: 7400
  proxy_host: pd-proxy
  proxy_port: 7500
  notify: false
  notify_timeout: 1.5
  recv_timeout: 10
  offer_ttl: 60
transfer: {advertise_host: decode-0.example, buffer_size: 64MiB}
vllm: {skip_last_n_tokens: 1}
"""


def test_pd_section_loads_round_trips_and_turns_on_nixl(tmp_path):
    import yaml

    f = tmp_path / "pd.yaml"
    f.write_text(PD_SECTION)
    cfg = load_config(f, environ={})
    pd = cfg.pd
    assert (pd.role, pd.peer_host, pd.peer_init_port, pd.peer_alloc_port) == ("receiver", "0.0.0.0", [7300, 7301], [7400])
    assert (pd.proxy_host, pd.proxy_port, pd.notify, pd.notify_timeout, pd.recv_timeout, pd.offer_ttl) == \
        ("pd-proxy", 7500, False, 1.5, 10.0, 60.0)
    assert (cfg.transfer.advertise_host, cfg.transfer.buffer_size, cfg.vllm.skip_last_n_tokens) == \
        ("decode-0.example", 64 << 20, 1)
    # PD on, no channel named: LMCache's only one
    assert cfg.transfer_channel == "nixl" and cfg.source_of("transfer_channel") == "default:pd.role"
    assert cfg.source_of("pd.peer_init_port") == f"file:{f}"
    # what `lmcache config show` prints loads back to the same config
    report = cfg.report()
    assert report["values"]["pd"]["peer_init_port"] == [7300, 7301] and report["sources"]["pd.role"] == f"file:{f}"
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(cfg.to_dict()))
    back = load_config(again, environ={})
    assert (back.pd, back.transfer, back.vllm, back.transfer_channel) == (cfg.pd, cfg.transfer, cfg.vllm, "nixl")
    # the defaults, the shorthand, ports as one int, a list or a string, the environment
    d = load_config({}, environ={}).pd
    assert (d.role, d.peer_host, d.peer_init_port, d.peer_alloc_port, d.proxy_host, d.proxy_port) == \
        ("off", "127.0.0.1", [], [], None, None)
    assert (d.notify, d.notify_timeout, d.recv_timeout, d.offer_ttl) == (True, 2.0, 30.0, 120.0)
    assert load_config({}, environ={}).transfer_channel is None and load_config({}, environ={}).transfer.advertise_host is None
    assert load_config({"pd": "sender"}, environ={}).pd.role == "sender"
    for ports in (7300, [7300], "7300", " 7300 ,"):
        assert load_config({"pd": {"peer_init_port": ports}}, environ={}).pd.peer_init_port == [7300]
    env = load_config({}, environ={"LMCACHE_PD": "{role: both, peer_init_port: 7300}"})
    assert (env.pd.role, env.pd.peer_init_port, env.transfer_channel) == ("both", [7300], "nixl")
    assert load_config({"pd": "sender", "transfer_channel": "tcp"}, environ={}).transfer_channel == "tcp"


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml", environ={})


def test_env_error_names_the_variable():
    with pytest.raises(ConfigError) as ei:
        load_config({}, environ={"LMCACHE_CHUNK_SIZE": "-3"})
    assert "chunk_size" in str(ei.value) and "$LMCACHE_CHUNK_SIZE" in str(ei.value)


@pytest.mark.parametrize(
    "tier,key,fragment",
    [
        ({"backend": "disk", "capacity": "1MiB"}, "tiers[0].path", "needs a directory"),
        ({"backend": "disk", "capacity": "1MiB", "path": "/tmp/x", "colour": "red"}, "tiers[0].colour", "unknown key"),
        ({"backend": "floppy", "capacity": "1MiB"}, "tiers[0].backend", "unknown backend 'floppy'"),
        ({"backend": "cpu", "capacity": "1MiB", "codec": "rot13"}, "tiers[0].codec", "unknown codec 'rot13'"),
        ({"backend": "cpu", "capacity": "1MiB", "policy": "random"}, "tiers[0].policy", "unknown policy 'random'"),
        (
            {"backend": "cpu", "capacity": "1MiB", "codec": "zstd", "codec_options": {"level": 99}},
            "tiers[0].codec_options",
            "zstd level",
        ),
    ],
)
def test_backend_specific_errors_name_the_tier_key_and_file(tmp_path, tier, key, fragment):
    import yaml

    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"tiers": [tier]}))
    with pytest.raises(ConfigError) as ei:
        lmcache.CacheEngine.from_config(f)
    assert ei.value.key == key, str(ei.value)
    assert str(f) in str(ei.value)
    assert fragment in str(ei.value)


def test_kv_spec_signature_names_every_shape_field():
    s = KVSpec(num_layers=30, num_kv_heads=3, head_size=64, dtype="float32", tp_rank=1, tp_size=2)
    assert s.signature == "float32-L30-H3-D64-lt2hd-tp1of2"
    assert s.bytes_per_token() == 30 * 2 * 3 * 64 * 4


def test_config_object_is_copied_not_shared():
    a = load_config({"chunk_size": 16})
    b = load_config(a, chunk_size=32)
    assert a.chunk_size == 16 and b.chunk_size == 32


# ------------------------------------------------------------ hostile configs (outside review)
def _bomb(levels: int = 9, width: int = 9) -> str:
    """A YAML alias bomb as the value of chunk_size: width**levels leaves from a few
    hundred bytes."""
    lines = ["chunk_size:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines)


@pytest.mark.parametrize("text, key, fragment", [
    ("BOMB", "chunk_size", "chunk_size"),
    ("tiers: [{backend: cpu, capacity: .inf}]\n", "tiers[0].capacity", "finite"),
    ("tiers: [{backend: cpu, capacity: 1TiB}]\n", "tiers[0].capacity", "more than this machine has"),
    ("memory_pool_size: 1TiB\n", "memory_pool_size", "more than this machine has"),
    ("kv_spec: {num_layers: 2, num_kv_heads: 2, head_size: 8, layout: 'a:b'}\n", "kv_spec.layout", "letters"),
    ("controller: {url: 'http://127.0.0.1:1', heartbeat_interval: 1.0e-9}\n", "controller.heartbeat_interval", "at least"),
])
def test_hostile_configs_are_one_line_errors_naming_the_key(tmp_path, text, key, fragment):
    """Each of these gave a traceback, a 254 MB message, or passed validation and failed
    later; each is now a short ConfigError naming the key, at load time."""
    import time

    f = tmp_path / "c.yaml"
    f.write_text(_bomb() + "\n" if text == "BOMB" else text)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as ei:
        load_config(f)
    assert time.monotonic() - t0 < 5  # a hang guard: the bomb's expansion is never printed
    assert ei.value.key == key, ei.value
    assert fragment in str(ei.value) and len(str(ei.value)) < 600, str(ei.value)[:700]


def test_a_config_file_that_is_not_utf8_names_the_byte(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"chunk_size: 256\nnamespace: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at offset 27\)") as ei:
        load_config(f)
    assert ei.value.key == "<file>" and str(f) in str(ei.value)


# ------------------------------------------------------------ sections declared once
def test_a_section_declared_only_as_a_dataclass_gets_checks_copy_masking_and_env():
    """A new section is a dataclass of ``option`` fields and one field of a Config: it
    is validated, merged, copied, masked and read from the environment with no code of its own."""
    import dataclasses

    from lmcache import settings as check
    from lmcache.config import Config
    from lmcache.settings import option

    @dataclasses.dataclass
    class WarmerConfig:
        enabled: bool = option(False, check.boolean, shorthand=bool)
        workers: int = option(4, check.integer(1))
        endpoint: str = option("tcp://127.0.0.1:5600", check.zmq_endpoint)
        token: str | None = option(None, check.token, secret=True, env=True)

    @dataclasses.dataclass
    class WarmConfig(Config):
        warmer: WarmerConfig = dataclasses.field(default_factory=WarmerConfig)

    env = {"LMCACHE_WARMER": "{workers: 8}", "LMCACHE_WARMER_TOKEN": "0123"}
    cfg = load_config(WarmConfig(), environ=env, warmer=True)  # `warmer: true` is {enabled: true}
    assert (cfg.warmer.enabled, cfg.warmer.workers, cfg.warmer.token) == (True, 8, "0123")  # merged; token verbatim
    assert cfg.source_of("warmer.workers") == "env:LMCACHE_WARMER" and cfg.source_of("warmer.enabled") == "override"
    assert cfg.to_dict(mask_secrets=True)["warmer"]["token"] == "***" and cfg.to_dict()["warmer"]["token"] == "0123"
    report = cfg.report()
    assert report["values"]["warmer"]["token"] == "***" and report["sources"]["warmer.token"] == "env:LMCACHE_WARMER_TOKEN"
    copied = load_config(cfg, environ={})
    assert copied == cfg and copied.warmer is not cfg.warmer
    for bad, key, fragment in [
        ({"workers": 0}, "warmer.workers", "must be >= 1"),
        ({"endpoint": "x"}, "warmer.endpoint", "ZMQ endpoint"),
        ({"wokers": 2}, "warmer.wokers", "did you mean 'workers'"),
        ({"token": " t"}, "warmer.token", "without surrounding spaces"),
        ("on", "warmer", "expected a mapping"),
    ]:
        with pytest.raises(ConfigError) as ei:
            load_config(WarmConfig(), environ={}, warmer=bad)
        assert ei.value.key == key and fragment in str(ei.value), str(ei.value)
    with pytest.raises(ConfigError, match=r"\$LMCACHE_WARMER\b.*expected an integer"):
        load_config(WarmConfig(), environ={"LMCACHE_WARMER": "{workers: many}"})
    # the same path on its own, for a section used outside Config
    base = WarmerConfig(workers=2)
    assert check.parse(WarmerConfig, {"enabled": True}, "warmer", base=base) == WarmerConfig(True, 2)
    assert base.enabled is False
