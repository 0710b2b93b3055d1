"""Issue 44 item 12: no credential from a configuration is ever shown.

``lmcache config show`` (offline and against an instance), ``/v1/config``, ``lmcache
tiers``/``stats``, ``config validate``/``convert``, every error message and log line:
S3 secret keys, session tokens, tokens, and the passwords in redis/fs/controller URLs
read ``***`` (see lmcache.redact), while the rest of the config still shows. The
commands run as the user runs them (the installed ``lmcache`` script), the instance API
is a real engine's with real stores behind its tiers (rclone's S3, an lmcache server
with a token, a redis-server with ``requirepass``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from lmcache.errors import AdminError, ConfigError
from lmcache.redact import MASK, redact, redact_text
from tests._missing import loopback_store, missing

LMCACHE = Path(sys.executable).with_name("lmcache")
S3_SECRET = "S3CRET-abc123"
S3_SESSION = "S3SSN-444ddd"
S3_KEY_ID = "AKIAEXAMPLE0000WXYZ"
REDIS_PW = "R3DISPW-789xyz"
LM_TOKEN = "LMT0K-456qrs"
API_TOKEN = "APIT0K-111aaa"
CTL_PW = "CTLPW-222bbb"
CTL_TOKEN = "CTLT0K-555eee"
FS_PW = "FSPW-333ccc"
SECRETS = (S3_SECRET, S3_SESSION, REDIS_PW, LM_TOKEN, API_TOKEN, CTL_PW, CTL_TOKEN, FS_PW)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmcache(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The installed ``lmcache`` command, with no LMCACHE_* variable but those given."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "AWS_"))}
    return subprocess.run([str(LMCACHE), *args], env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def clean(text: str, *secrets: str) -> None:
    for s in secrets or SECRETS:
        assert s not in text, f"secret {s!r} shown in:\n{text}"


def both(r: subprocess.CompletedProcess) -> str:
    return r.stdout + r.stderr


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, both(r)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("lmcache: error: ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def native_config(tmp_path: Path) -> dict:
    return {
        "chunk_size": 16,
        "tiers": [
            {"backend": "cpu", "capacity": "4MiB"},
            {"backend": "s3", "capacity": "1GiB", "url": "s3://my-bucket/pfx", "region": "us-east-1",
             "access_key_id": S3_KEY_ID, "secret_access_key": S3_SECRET, "session_token": S3_SESSION},
            {"backend": "redis", "name": "r1", "capacity": "1GiB", "url": f"rediss://default:{REDIS_PW}@127.0.0.1:6380/0"},
            {"backend": "redis", "name": "r2", "capacity": "1GiB", "url": f"redis://:{REDIS_PW}@127.0.0.1:6381/1"},
            {"backend": "lm", "capacity": "1GiB", "url": "lm://127.0.0.1:6555", "token": LM_TOKEN},
            {"backend": "fs", "capacity": "1GiB", "url": f"file://{tmp_path}/fs",
             "fs_options": {"password": FS_PW, "user": "fsuser"}},
        ],
        "api": {"enabled": False, "token": API_TOKEN},
        "controller": {"url": f"http://ctl:{CTL_PW}@127.0.0.1:9000", "token": CTL_TOKEN},
    }


# ------------------------------------------------------------------ case 1: config show, native YAML
def test_config_show_masks_native_yaml(tmp_path):
    cfg = write(tmp_path / "c.yaml", native_config(tmp_path))
    table = lmcache("config", "show", "-c", str(cfg))
    assert table.returncode == 0, both(table)
    clean(both(table))
    js = lmcache("config", "show", "-c", str(cfg), "--json")
    assert js.returncode == 0, both(js)
    clean(both(js))
    values, sources = json.loads(js.stdout)["values"], json.loads(js.stdout)["sources"]
    assert sources["api.token"] == f"file:{cfg}"  # where a secret came from still shows
    s3 = values["tiers"][1]
    assert s3["url"] == "s3://my-bucket/pfx" and s3["region"] == "us-east-1"  # the rest still shows
    assert s3["secret_access_key"] == MASK and s3["session_token"] == MASK
    assert s3["access_key_id"] == MASK + "WXYZ"  # an id, partly shown, as `aws configure list` does
    assert values["tiers"][2]["url"] == f"rediss://default:{MASK}@127.0.0.1:6380/0"
    assert values["tiers"][3]["url"] == f"redis://:{MASK}@127.0.0.1:6381/1"
    assert values["tiers"][4]["token"] == MASK and values["tiers"][4]["url"] == "lm://127.0.0.1:6555"
    assert values["tiers"][5]["fs_options"] == {"password": MASK, "user": "fsuser"}
    assert values["controller"]["url"] == f"http://ctl:{MASK}@127.0.0.1:9000"
    assert values["api"]["token"] == MASK and values["controller"]["token"] == MASK
    assert "127.0.0.1:6380" in table.stdout and "my-bucket" in table.stdout


# ------------------------------------------------------------------ case 2: /v1/config of a live instance
def _redis_with_password():
    from lmcache.testing.stores import LocalServer, free_port, port_open

    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        missing("redis-server (or valkey-server) is not installed (make servers)")
    port = free_port()
    return LocalServer("redis-pw", [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", REDIS_PW,
                                    "--save", "", "--appendonly", "no"], port, ready=lambda: port_open(port))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """An engine with the instance API (admin token), tiers on real stores holding
    credentials: rclone's S3 (its random secret), an lmcache server with a token, a
    redis-server with a password; and a controller URL with a password (nothing there)."""
    import lmcache as lm

    tmp = tmp_path_factory.mktemp("live")
    with loopback_store("s3") as s3, loopback_store("lm", token=LM_TOKEN) as lms, _redis_with_password() as rs:
        rs.start()
        config = {
            "chunk_size": 16,
            "tiers": [
                {"backend": "cpu", "capacity": "4MiB"},
                {"backend": "s3", "capacity": "64MiB", **s3.options},
                {"backend": "lm", "capacity": "64MiB", **lms.options},
                {"backend": "redis", "capacity": "64MiB", "url": f"redis://default:{REDIS_PW}@127.0.0.1:{rs.port}/0"},
            ],
            "api": {"enabled": True, "host": "127.0.0.1", "port": 0, "token": API_TOKEN},
            "controller": {"url": f"http://ctl:{CTL_PW}@127.0.0.1:{closed_port()}", "token": CTL_TOKEN,
                           "timeout": 0.2, "heartbeat_interval": 0.2},
        }
        path = write(tmp / "lmcache.yaml", config)
        with lm.CacheEngine.from_config(path) as engine:
            yield engine, (*SECRETS, s3.options["secret_access_key"])


def test_instance_api_config_masks(live):
    engine, secrets = live
    req = urllib.request.Request(engine.api_url + "/v1/config", headers={"Authorization": f"Bearer {API_TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    clean(text, *secrets)
    values = json.loads(text)["values"]
    assert [t["backend"] for t in values["tiers"]] == ["cpu", "s3", "lm", "redis"]
    assert values["tiers"][1]["endpoint_url"].startswith("http://127.0.0.1:")  # the rest still shows
    assert values["tiers"][1]["secret_access_key"] == MASK and values["tiers"][2]["token"] == MASK
    assert f"default:{MASK}@127.0.0.1:" in values["tiers"][3]["url"]
    for args in (("config", "show"), ("config", "show", "--json"), ("tiers",), ("tiers", "--json"),
                 ("stats", "--json")):
        r = lmcache(*args, "--url", engine.api_url, "--token", API_TOKEN)
        assert r.returncode == 0, both(r)
        clean(both(r), *secrets)


def test_worker_stats_and_logs_mask_the_controller_url(live, caplog):
    """The controller worker names its controller in stats and in every log line."""
    engine, secrets = live
    with caplog.at_level(logging.DEBUG, logger="lmcache"):
        from tests._procs import until

        w = engine.controller_worker
        first = w.stats()["failed_calls"]
        until(lambda: w.stats()["failed_calls"] >= first + 2, "the worker tried its controller twice more")
        stats = json.dumps(engine.stats(), default=str)
    clean(stats, *secrets)
    clean(caplog.text, *secrets)
    assert f"ctl:{MASK}@127.0.0.1" in stats


# ------------------------------------------------------------------ case 3: LMCACHE_* / LMCACHE_EXTRA_CONFIG
@pytest.mark.parametrize("env", [
    {"LMCACHE_REMOTE_URL": "s3://my-bucket.s3.us-east-1.amazonaws.com/pfx",
     "LMCACHE_EXTRA_CONFIG": json.dumps({"s3_region": "us-east-1", "aws_access_key_id": S3_KEY_ID,
                                         "aws_secret_access_key": S3_SECRET})},
    {"LMCACHE_REMOTE_URL": f"redis://default:{REDIS_PW}@127.0.0.1:6379"},
    {"LMCACHE_REMOTE_URL": "lm://127.0.0.1:6555", "LMCACHE_ENABLE_CONTROLLER": "True",
     "LMCACHE_CONTROLLER_PULL_URL": f"ctl:{CTL_PW}@127.0.0.1:9000"},
    {"LMCACHE_TIERS": f'[{{backend: redis, capacity: 1GiB, url: "redis://:{REDIS_PW}@127.0.0.1:6379/0"}}]',
     "LMCACHE_API_TOKEN": API_TOKEN, "LMCACHE_CONTROLLER_TOKEN": CTL_TOKEN},
], ids=["s3-extra-config", "redis-remote-url", "controller-pull-url", "native-env"])
def test_config_show_masks_the_environment(env):
    for args in (("config", "show"), ("config", "show", "--json")):
        r = lmcache(*args, env=env)
        assert r.returncode == 0, both(r)
        clean(both(r))
    values = json.loads(r.stdout)["values"]
    assert "127.0.0.1" in json.dumps(values) or "my-bucket" in json.dumps(values)  # the rest still shows


# ------------------------------------------------------------------ case 4: a bad LMCACHE_EXTRA_CONFIG
@pytest.mark.parametrize("extra", [
    # a trailing comma: not JSON; the secret at the end, past a bounded repr's head
    f'{{"s3_region": "us-east-1", "aws_access_key_id": "{S3_KEY_ID}", "aws_secret_access_key": "{S3_SECRET}",}}',
    f"{{aws_secret_access_key: {S3_SECRET}}}",
    f'["aws_secret_access_key", "{S3_SECRET}"]',
])
def test_bad_extra_config_error_masks(extra):
    r = lmcache("config", "show", env={"LMCACHE_REMOTE_URL": "s3://my-bucket/pfx", "LMCACHE_EXTRA_CONFIG": extra})
    line = one_line_error(r)
    clean(both(r))
    assert "extra_config" in line and "$LMCACHE_EXTRA_CONFIG" in line


# ------------------------------------------------------------------ cases 5-7: errors built from URLs
@pytest.mark.parametrize("data, names", [
    ({"remote_url": f"fs://fsuser:{FS_PW}@127.0.0.1:1/a,b", "max_local_cpu_size": 0.01}, "remote_url"),
    ({"remote_url": f"fs://fsuser:{FS_PW}@127.0.0.1:x/a"}, "remote_url"),
    ({"enable_controller": True, "controller_pull_url": f"ctl:{CTL_PW}@127.0.0.1:notaport"}, "controller_pull_url"),
    ({"enable_controller": True, "controller_pull_url": f"tcp://ctl:{CTL_PW}@127.0.0.1"}, "controller_pull_url"),
    ({"remote_url": f"redis://:{REDIS_PW}@127.0.0.1:badport"}, "remote_url"),
    ({"remote_url": f"redis-sentinel://:{REDIS_PW}@"}, "remote_url"),
    ({"tiers": [{"backend": "redis", "capacity": "1GiB", "url": f"redis://default:{REDIS_PW}@127.0.0.1:6379/notadb"}]},
     "url"),
    ({"tiers": [{"backend": "redis", "capacity": "1GiB", "url": f"redis://default:{REDIS_PW}@127.0.0.1:6379/0?x=1"}]},
     "url"),
    ({"tiers": [{"backend": "valkey", "capacity": "1GiB", "url": f"valkey://:{REDIS_PW}@h1:1,h2:2/0"}]}, "url"),
    ({"tiers": [{"backend": "lm", "capacity": "1GiB", "url": f"lm://u:{LM_TOKEN}@127.0.0.1:6555"}]}, "url"),
    ({"tiers": [{"backend": "s3", "capacity": "1GiB", "url": f"s3://AKIA:{S3_SECRET}@bucket/p"}]}, "url"),
    ({"tiers": [{"backend": "s3", "capacity": "1GiB", "url": "s3://bucket/p", "access_key_id": S3_KEY_ID,
                 "secret_access_key": 12345678}]}, "secret_access_key"),
    ({"tiers": [{"backend": "fs", "capacity": "1GiB", "url": f"nosuchproto://u:{FS_PW}@host/p"}]}, "url"),
    ({"tiers": {"backend": "s3", "secret_access_key": S3_SECRET}}, "tiers"),
    ({"controller": {"url": f"ftp://ctl:{CTL_PW}@127.0.0.1:1"}}, "controller.url"),
], ids=["fs-two-dirs", "fs-bad-port", "pull-url-bad-port", "pull-url-no-port", "redis-bad-port", "sentinel-no-host",
        "redis-bad-db", "redis-query", "valkey-two-hosts", "lm-userinfo", "s3-userinfo", "s3-bad-secret",
        "fs-unknown-proto", "tiers-not-a-list", "controller-url-scheme"])
def test_config_errors_mask_credentials(tmp_path, data, names):
    cfg = write(tmp_path / "c.yaml", data)
    for args in (("config", "validate", str(cfg)), ("config", "show", "-c", str(cfg))):
        r = lmcache(*args)
        if args[1] == "show" and r.returncode == 0:
            clean(both(r), *SECRETS, "12345678")  # show does not open the tiers: no backend check
            continue
        line = one_line_error(r)
        clean(both(r), *SECRETS, "12345678")
        assert names in line and str(cfg) in line


@pytest.mark.parametrize("text, line", [
    (f"tiers:\n  - backend: s3\n    secret_access_key: {S3_SECRET}: x\n", 3),
    (f"tiers:\n  - backend: s3\n    secret_access_key: \"{S3_SECRET}\n", 4),
    (f"tiers:\n  - {{backend: s3, secret_access_key: {S3_SECRET}, url: x\n", 3),
    (f"tiers:\n  - {{backend: redis, url: redis://:{REDIS_PW}@h:1/0\n", 3),
], ids=["mapping-in-value", "open-quote", "open-flow-mapping", "redis-url"])
def test_yaml_syntax_error_does_not_echo_the_line(tmp_path, text, line):
    """PyYAML's message quotes the line it stopped at; ours names line and column only."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    r = lmcache("config", "validate", str(cfg))
    msg = one_line_error(r)
    clean(both(r))
    assert "not valid YAML" in msg and f"line {line}," in msg
    # the same text in an LMCACHE_<KEY> variable
    r = lmcache("config", "show", env={"LMCACHE_TIERS": text.split("\n", 1)[1]})
    msg = one_line_error(r)
    clean(both(r))
    assert "$LMCACHE_TIERS" in msg


# ------------------------------------------------------------------ ControllerClient errors
def test_controller_client_errors_mask_the_url_password():
    from lmcache.plugins.services.controller_client import ControllerClient, split_urls

    port = closed_port()
    r = lmcache("controller", "instances", "--url", f"http://admin:{CTL_PW}@127.0.0.1:{port}", "--timeout", "1")
    line = one_line_error(r)
    clean(both(r))
    assert f"admin:{MASK}@127.0.0.1:{port}" in line
    two = f"http://a:{CTL_PW}@127.0.0.1:{port},http://b:{CTL_PW}@127.0.0.1:{closed_port()}"
    with ControllerClient(two, token=CTL_TOKEN, timeout=0.5) as c:
        with pytest.raises(AdminError) as e:
            c.health()
        clean(str(e.value) + repr(e.value) + c.url)
    for bad in (f"http://a:{CTL_PW}@127.0.0.1:notaport", f"ftp://a:{CTL_PW}@h:1", f"http://a:{CTL_PW}@h:1,,"):
        with pytest.raises(AdminError) as e:
            split_urls(bad)
        clean(str(e.value) + repr(e.value))


# ------------------------------------------------------------------ convert: secrets only where asked
def test_convert_masks_stdout_and_writes_secrets_only_to_the_file(tmp_path):
    up = write(tmp_path / "lmcache-upstream.yaml", {
        "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.01,
        "remote_url": "s3://my-bucket.s3.us-east-1.amazonaws.com/pfx",
        "extra_config": {"aws_access_key_id": S3_KEY_ID, "aws_secret_access_key": S3_SECRET},
        "enable_controller": True, "controller_pull_url": f"ctl:{CTL_PW}@127.0.0.1:9000",
    })
    r = lmcache("config", "convert", str(up))
    assert r.returncode == 0, both(r)
    clean(both(r))
    assert "my-bucket" in r.stdout and "secret_access_key: '***'" in r.stdout
    assert "--show-secrets" in r.stderr and "-o" in r.stderr  # says how to get them
    out = tmp_path / "ours.yaml"
    r = lmcache("config", "convert", str(up), "-o", str(out))
    assert r.returncode == 0, both(r)
    clean(both(r))
    assert S3_SECRET in out.read_text() and CTL_PW in out.read_text()  # a usable config
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    from lmcache.config import load_config

    assert load_config(out, environ={}).to_dict() == load_config(up, environ={}).to_dict()
    r = lmcache("config", "convert", str(up), "--show-secrets")
    assert r.returncode == 0 and S3_SECRET in r.stdout


# ------------------------------------------------------------------ the two functions
@pytest.mark.parametrize("text, shown", [
    (f"redis://default:{REDIS_PW}@h:1/0", f"redis://default:{MASK}@h:1/0"),
    (f"rediss://:{REDIS_PW}@h", f"rediss://:{MASK}@h"),
    (f"redis://{REDIS_PW}@h:1", f"redis://{MASK}@h:1"),
    (f"redis+sentinel://:{REDIS_PW}@h1:1,h2:2/m", f"redis+sentinel://:{MASK}@h1:1,h2:2/m"),
    (f"cannot reach http://u:{CTL_PW}@h:9: refused", f"cannot reach http://u:{MASK}@h:9: refused"),
    (f"GET /x?password={REDIS_PW}&db=1", f"GET /x?password={MASK}&db=1"),
    (f"AWS_SECRET_ACCESS_KEY={S3_SECRET} x", f"AWS_SECRET_ACCESS_KEY={MASK} x"),
    (f"{{'secret_access_key': '{S3_SECRET}', 'url': 's3://b'}}", f"{{'secret_access_key': '{MASK}', 'url': 's3://b'}}"),
    (f'{{"session_token": "{S3_SESSION}", "a": 1', f'{{"session_token": "{MASK}", "a": 1'),
    (f"    secret_access_key: {S3_SECRET}", f"    secret_access_key: {MASK}"),
    (f"Authorization: Bearer {API_TOKEN}", f"Authorization: Bearer {MASK}"),
    ("missing or wrong token: send 'Authorization: Bearer <token>'",
     "missing or wrong token: send 'Authorization: Bearer <token>'"),
    ("config key 'api.token' (in f.yaml): expected a string", "config key 'api.token' (in f.yaml): expected a string"),
    ("http://127.0.0.1:9000/v1/x", "http://127.0.0.1:9000/v1/x"),
])
def test_redact_text(text, shown):
    assert redact_text(text) == shown
    assert redact_text(shown) == shown  # idempotent


def test_redact_structure():
    data = {"tiers": [{"url": f"redis://u:{REDIS_PW}@h", "secret_access_key": S3_SECRET, "token": None,
                       "access_key_id": S3_KEY_ID, "fs_options": {"password": FS_PW, "key": "AKIA0000000011112222"},
                       "capacity": 5, "o_direct": True}],
            "api": {"token": [API_TOKEN], "auth": True}}
    out = redact(data)
    clean(json.dumps(out))
    assert out["tiers"][0]["capacity"] == 5 and out["tiers"][0]["o_direct"] is True and out["api"]["auth"] is True
    assert out["tiers"][0]["token"] is None and out["api"]["token"] == [MASK]
    assert out["tiers"][0]["fs_options"]["key"] == MASK + "2222"
    assert redact(out) == out
    assert data["tiers"][0]["secret_access_key"] == S3_SECRET  # a copy


def test_every_error_masks_what_it_names():
    e = ConfigError("tiers[0].url", f"malformed URL 'redis://:{REDIS_PW}@h:x'", "f.yaml")
    clean(str(e) + repr(e) + e.problem)
    e = AdminError(f"cannot reach http://u:{CTL_PW}@h:1")
    clean(str(e) + repr(e))
