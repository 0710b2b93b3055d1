"""``lmcache demo``: a real model answers questions about a long document, with lmcache underneath.

The model is SmolLM2-135M-Instruct on the CPU (:func:`lmcache.plugins.connectors.hf_models.load_smollm2`),
run by the transformers connector over a :class:`~lmcache.engine.CacheEngine` with a CPU
tier above a disk tier (write-through). The workload is long-document question answering:
one staff handbook of a fictional company (about 3k tokens, generated deterministically,
with numbered key facts so that every answer can be checked) and several questions about
it. Every prompt is the chat template around the handbook and one question, so every
prompt starts with the same ~3k tokens:

1. the first question is a cold prefill: nothing is cached, the model computes every token;
2. the later questions find the handbook's KV in the CPU tier and compute only the question;
3. one of them is run again on the plain model (transformers' own ``generate``, no
   lmcache at all), to show that the answer is the same and how far the first token's
   logits moved;
4. a second process (the hidden ``demo restart-check`` command, reporting JSON), as a
   restarted server would, loads the model, opens only the disk tier on the same directory
   and asks one more question: the handbook's KV now comes from disk. It too checks its
   answer against the plain model.

Then: time to first token without cache, with a CPU-tier hit and with a disk-tier hit,
the speed-ups, and each tier's KV load next to a memcpy of the same bytes (measured in the
same run). The command exits non-zero if a hit is missing or an answer changes.

The workload (the handbook, the model, the reference generate) is
:mod:`lmcache.benchmarks.handbook`, shared with the model benchmarks.

``lmcache demo synthetic`` is the storage-only demo (random Llama-3-8B-shaped KV, no
model): :mod:`lmcache.demos.synthetic`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from lmcache.units import format_size

from lmcache.benchmarks import harness
from lmcache.benchmarks.handbook import (CONFIG_NAME, Answer, Document, write_config, ask,
                                         build_document, compare, demo_config, load_model, plain_generate, warm_up)
from lmcache.cli.console import err, out, size_option




def main(questions: int, doc_tokens: int, max_new_tokens: int, chunk_size: int, seed: int, cpu_capacity: str,
         disk_capacity: str, directory: Path | None, memcpy_size: str, threads: int | None, restart: bool,
         verify: bool) -> None:
    """``lmcache demo``: the long-document QA run (cold prefill, CPU-tier hits, a disk-tier
    hit after a restart); exits 1 when a hit is missing or an answer changes."""
    cpu_cap = size_option(cpu_capacity, "--cpu-capacity", auto=False)
    disk_cap = size_option(disk_capacity, "--disk-capacity", auto=False)
    memcpy_bytes = size_option(memcpy_size, "--memcpy-size", auto=False) or (256 << 20)
    harness.set_threads(threads)
    wd = harness.open_work_dir(directory, "lmcache-demo-")
    try:
        kv_dir = wd.path / "kv"
        tiers = [{"backend": "cpu", "capacity": cpu_cap}, {"backend": "disk", "path": str(kv_dir.resolve()), "capacity": disk_cap}]
        cfg = demo_config(chunk_size, tiers)  # a bad config fails here, before the model loads
        if not wd.temporary:
            write_config(wd.path / CONFIG_NAME, chunk_size, tiers)
        ok = _run(cfg, wd, questions, doc_tokens, max_new_tokens, chunk_size, seed, disk_cap or 0, memcpy_bytes,
                  threads, restart, verify)
    finally:
        if wd.temporary:
            shutil.rmtree(wd.path, ignore_errors=True)
    if not ok:
        raise typer.Exit(1)


def _run(cfg: Any, wd: harness.WorkDir, questions: int, doc_tokens: int, max_new_tokens: int, chunk_size: int,
         seed: int, disk_cap: int, memcpy_bytes: int, threads: int | None, restart: bool, verify: bool) -> bool:
    from lmcache.engine import CacheEngine
    from lmcache import connector

    TransformersConnector = connector("transformers")  # through the plugin registries
    kv_spec_of = TransformersConnector.kv_spec_of

    o, e = out(), err()
    started = time.perf_counter()
    machine = harness.machine_info(wd.path)
    o.print("[bold]lmcache demo[/]: a real model answers questions about a long document, with lmcache underneath")
    harness.warn_if_busy(machine)
    model, tok, load_info = load_model(e)
    spec = kv_spec_of(model)
    with e.status("measuring memcpy ..."):
        memcpy = harness.memcpy_gbps(memcpy_bytes)
    with e.status("writing the handbook ..."):
        doc = build_document(tok, doc_tokens, chunk_size, seed)
    with e.status("warming up the model ..."):
        load_info["warm_up_seconds"] = warm_up(model, tok, doc.prefix_tokens)
    _intro(o, machine, load_info, spec, cfg, wd, doc, memcpy, memcpy_bytes)

    engine = CacheEngine(cfg, kv_spec=spec)
    conn = TransformersConnector(model, tok, engine)
    answers: list[Answer] = []
    gens: list[Any] = []
    facts = doc.facts[:questions]
    try:
        for i, fact in enumerate(facts):
            what = "prefilling the whole prompt (nothing cached yet)" if i == 0 else "reusing the cached handbook"
            with e.status(f"question {i + 1}/{len(facts)}: {what} ..."):
                a, g = ask(conn, doc, fact, max_new_tokens)
            answers.append(a)
            gens.append(g)
        _requests(o, answers, doc)
        check = None
        if verify:
            j = 1 if len(answers) > 1 else 0  # the first CPU-tier hit, if there is one
            with e.status(f"question {j + 1} again on the plain model (transformers' generate, no lmcache) ..."):
                ref = plain_generate(model, tok, doc.prompt_ids(tok, facts[j].question), max_new_tokens)
            check = {"request": j + 1, **compare(gens[j].tokens, gens[j].first_logits, ref)}
            _check(o, check, answers[j])
        with e.status("flushing the disk tier ..."):
            engine.flush()
        stats = engine.stats()
    finally:
        engine.close()  # the server stops; what is on disk stays
    rs = None
    if restart:
        nxt = doc.facts[questions]
        with e.status("restart: a new process loads the model and opens only the disk tier ..."):
            rs = spawn_restart_check(wd.path, doc_tokens, chunk_size, seed, nxt.number, max_new_tokens, disk_cap,
                                     verify, threads)
        _restart(o, rs, wd.path / "kv")
    _tiers(o, answers, rs, memcpy, stats)
    ok = _summary(o, answers, check, rs, memcpy, doc, time.perf_counter() - started)
    if not wd.temporary:
        conf = wd.path / CONFIG_NAME
        o.print(f"The cache was kept in {wd.path / 'kv'}; its config is {conf}. Inspect it with:")
        o.print(f"  lmcache tiers --config {conf}    lmcache ls --config {conf} --tier disk")
        o.print(f"  lmcache evict --config {conf} --tier disk --all --yes")
    return ok


# --------------------------------------------------------------------------- restart


def restart_check(directory: Path, doc_tokens: int, chunk_size: int, seed: int, fact_number: int,
                  max_new_tokens: int, disk_capacity: int, verify: bool) -> dict[str, Any]:
    """What a new process finds when it opens only the disk tier and asks a question."""
    from lmcache.engine import CacheEngine
    from lmcache import connector

    TransformersConnector = connector("transformers")  # through the plugin registries
    kv_spec_of = TransformersConnector.kv_spec_of

    model, tok, load_info = load_model(None)
    doc = build_document(tok, doc_tokens, chunk_size, seed)
    warm = warm_up(model, tok, doc.prefix_tokens)
    fact = doc.facts[fact_number - 1]
    spec = kv_spec_of(model)
    # the pool must hold the whole prompt's chunks while they are read
    pool = max(256 << 20, (doc.prefix_tokens + 2 * chunk_size) * spec.bytes_per_token() * 5 // 4)
    cfg = demo_config(chunk_size, [{"backend": "disk", "path": str(directory / "kv"), "capacity": disk_capacity}],
                      memory_pool_size=pool)
    t0 = time.perf_counter()
    engine = CacheEngine(cfg, kv_spec=spec)
    open_s = time.perf_counter() - t0
    try:
        usage = engine.stats()["tiers"]["disk"]
        conn = TransformersConnector(model, tok, engine)
        a, g = ask(conn, doc, fact, max_new_tokens)
        engine.flush()
        stats = engine.stats()["tiers"]["disk"]
    finally:
        engine.close()
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "model_load_seconds": load_info["seconds"],
        "warm_up_seconds": warm,
        "open_seconds": open_s,
        "entries": usage["entries"],
        "used_bytes": usage["used_bytes"],
        "answer": asdict(a),
        "disk": {k: stats[k] for k in ("hits", "misses", "hit_bytes", "get_seconds")},
    }
    if verify:
        ref = plain_generate(model, tok, doc.prompt_ids(tok, fact.question), max_new_tokens)
        report["check"] = compare(g.tokens, g.first_logits, ref)
    return report


def spawn_restart_check(directory: Path, doc_tokens: int, chunk_size: int, seed: int, fact_number: int,
                        max_new_tokens: int, disk_capacity: int, verify: bool, threads: int | None = None,
                        timeout: float = 600) -> dict[str, Any]:
    """Run :func:`restart_check` in a new Python process and return its report."""
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "demo", "restart-check",
        "--dir", str(directory), "--doc-tokens", str(doc_tokens), "--chunk-size", str(chunk_size),
        "--seed", str(seed), "--fact", str(fact_number), "--max-new-tokens", str(max_new_tokens),
        "--disk-capacity", str(disk_capacity), "--verify" if verify else "--no-verify",
        *(["--threads", str(threads)] if threads else []),
    ]
    return harness.run_json_child(cmd, "restart", timeout)


# --------------------------------------------------------------------------- output


def _n(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms" if s < 1 else f"{s:,.2f} s"


def _tiers_text(tiers: dict[str, int]) -> str:
    return " + ".join(f"{name} x{n}" for name, n in tiers.items()) or "-"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < harness.GB else f"{nbytes / harness.GB:.2f} GB"


def _intro(o, machine: dict[str, Any], load_info: dict[str, Any], spec: Any, cfg: Any, wd: harness.WorkDir,
           doc: Document, memcpy: float, memcpy_bytes: int) -> None:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    how = "converted from GGUF on this first run and loaded" if load_info["converted"] else "loaded"
    t.add_row(
        "model",
        f"SmolLM2-135M-Instruct, float32 on the CPU ({how} in {load_info['seconds']:.1f} s, warmed up in "
        f"{load_info.get('warm_up_seconds', 0):.1f} s); KV: {spec.num_layers} "
        f"layers x {spec.num_kv_heads} KV heads x head size {spec.head_size} = {format_size(spec.bytes_per_token())} per token",
    )
    chunk_bytes = cfg.chunk_size * spec.bytes_per_token()
    where = f"{wd.path / 'kv'}" + (" (temporary)" if wd.temporary else "")
    t.add_row(
        "lmcache",
        f"transformers connector over a CacheEngine: cpu tier {format_size(cfg.tiers[0].capacity)} -> disk tier "
        f"{format_size(cfg.tiers[1].capacity)} at {where}, write-through; chunks of {cfg.chunk_size} tokens "
        f"({format_size(chunk_bytes)} of KV)",
    )
    n_chunks = doc.prefix_tokens // doc.chunk_size
    t.add_row(
        "workload",
        f"a staff handbook of a fictional company ({_n(doc.sections, 'section')} and {len(doc.facts)} numbered key facts) "
        f"and questions about it; every prompt = chat template + handbook + one question, greedy answers",
    )
    shared = (
        f"the {doc.prefix_tokens:,} tokens every prompt shares are exactly {_n(n_chunks, 'chunk')}"
        if doc.aligned
        else f"the {doc.prefix_tokens:,} tokens every prompt shares end inside a chunk (its tail is recomputed)"
    )
    t.add_row("", f"{shared} ({_gb(doc.prefix_tokens * spec.bytes_per_token())} of KV)")
    t.add_row(
        "machine",
        f"{harness.machine_text(machine)}, load average {machine.get('load_average_1m') or 0:.2f}; "
        f"memcpy {memcpy:.1f} GB/s (torch copy_ of {format_size(memcpy_bytes)}, best of 10, measured now)",
    )
    o.print(t)
    o.print()
    excerpt = doc.text.splitlines()
    facts_at = excerpt.index("Key facts:")
    o.print("[bold]The handbook[/] (excerpt)")
    for line in excerpt[:4] + ["..."] + excerpt[facts_at : facts_at + 3] + ["..."]:
        line = line if len(line) <= 120 else line[:117] + "..."
        o.print(f"  [dim]{line}[/]" if line else "", soft_wrap=True)


def _requests(o, answers: list[Answer], doc: Document) -> None:
    t = Table(title="Questions (TTFT = time to first token; KV loaded = bytes lmcache handed to the model)", title_justify="left")
    for col in ("#", "question", "prompt", "cached", "from (chunks)", "KV loaded", "TTFT", "answer"):
        t.add_column(col, justify="right" if col in ("#", "prompt", "cached", "KV loaded", "TTFT") else "left")
    for i, a in enumerate(answers):
        mark = "[green]✓[/]" if a.correct else f"[yellow]✗[/] (handbook: {a.expected})"
        t.add_row(
            str(i + 1), a.question, f"{a.prompt_tokens:,}", f"{a.cached_tokens:,}",
            _tiers_text(a.tiers) if a.tiers else "[dim]none: cold[/]",
            _gb(a.kv_bytes) if a.kv_bytes else "-", _ms(a.ttft), f"{a.text} {mark}",
        )
    o.print()
    o.print(t)
    if len(answers) > 1:
        first = answers[0]
        hits = answers[1:]
        later = "Question 2" if len(hits) == 1 else f"Questions 2-{len(answers)}"
        own = sorted({a.prompt_tokens - a.cached_tokens for a in hits})
        own_text = str(own[0]) if len(own) == 1 else f"{own[0]}-{own[-1]}"
        o.print(
            f"Question 1 computed all {first.prompt_tokens:,} prompt tokens and stored their KV (in the cpu tier, and "
            f"the disk tier behind it). {later} reused the handbook's {hits[0].cached_tokens:,} tokens from the cpu "
            f"tier and computed only their own {own_text} (the question and the chat template around it)."
        )


def _check(o, c: dict[str, Any], a: Answer) -> None:
    o.print()
    same = "[green]identical[/]" if c["identical"] else "[red]DIFFERENT[/]"
    o.print(
        f"[bold]Without lmcache[/]: question {c['request']} again on the plain model (transformers' generate, "
        f"no lmcache): TTFT {_ms(c['ttft'])} instead of {_ms(a.ttft)}; answer {same} "
        f"({c['text']!r}); first-token logits differ by at most {c['max_abs_logit_diff']:.1e}."
    )


def _restart(o, r: dict[str, Any], kv_dir: Path) -> None:
    a = r["answer"]
    o.print()
    o.print(
        f"[bold]After a restart[/]: a new process (pid {r['pid']}) loaded the model in {r['model_load_seconds']:.1f} s "
        f"(and warmed it up, as a server does before taking requests), opened only the disk tier at {kv_dir} and found {r['entries']} chunks ({format_size(r['used_bytes'])}) "
        f"in {r['open_seconds'] * 1e3:.0f} ms; then it asked one more question:"
    )
    t = Table()
    for col in ("question", "prompt", "cached", "from (chunks)", "KV loaded", "TTFT", "answer"):
        t.add_column(col, justify="left" if col in ("question", "from (chunks)", "answer") else "right")
    mark = "[green]✓[/]" if a["correct"] else f"[yellow]✗[/] (handbook: {a['expected']})"
    t.add_row(
        a["question"], f"{a['prompt_tokens']:,}", f"{a['cached_tokens']:,}", _tiers_text(a["tiers"]),
        _gb(a["kv_bytes"]), _ms(a["ttft"]), f"{a['text']} {mark}",
    )
    o.print(t)
    c = r.get("check")
    if c is not None:
        same = "[green]identical[/]" if c["identical"] else "[red]DIFFERENT[/]"
        o.print(
            f"The same process then ran that prompt on the plain model (no lmcache): TTFT {_ms(c['ttft'])}; "
            f"answer {same}; first-token logits differ by at most {c['max_abs_logit_diff']:.1e}."
        )


def _tiers(o, answers: list[Answer], rs: dict[str, Any] | None, memcpy: float, stats: dict[str, Any]) -> None:
    rows = []
    for name, reqs in (("cpu", [a for a in answers if set(a.tiers) == {"cpu"}]),
                       ("disk", [Answer(**rs["answer"])] if rs and set(rs["answer"]["tiers"]) == {"disk"} else [])):
        if not reqs:
            continue
        nbytes = sum(a.kv_bytes for a in reqs)
        load = sum(a.load_seconds for a in reqs)
        chunks = sum(sum(a.tiers.values()) for a in reqs)
        rows.append((name, len(reqs), chunks, nbytes, load))
    if not rows:
        return
    t = Table(
        title="Tiers (KV load = lookup, retrieve and building the model's cache, per request; GB/s = 10^9 bytes/s)",
        title_justify="left",
    )
    for col in ("tier", "requests", "chunk hits", "KV bytes", "KV load", "GB/s", "memcpy of the same bytes", "load / memcpy"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name, n, chunks, nbytes, load in rows:
        ideal = nbytes / (memcpy * harness.GB)
        t.add_row(
            name, str(n), str(chunks), _gb(nbytes), _ms(load / n), f"{nbytes / load / harness.GB:.2f}" if load else "n/a",
            _ms(ideal / n), f"{load / ideal:.1f}x" if ideal else "n/a",
        )
    o.print()
    o.print(t)
    notes = []
    cpu = stats["tiers"].get("cpu", {})
    if cpu:
        notes.append(f"cpu tier: {cpu.get('entries', 0)} chunks held, {cpu.get('hits', 0)} hits")
    if rs:
        d = rs["disk"]
        if d["get_seconds"] > 0:
            notes.append(
                f"disk tier after the restart: {d['hits']} reads of {_gb(d['hit_bytes'])} at "
                f"{d['hit_bytes'] / d['get_seconds'] / harness.GB:.2f} GB/s by its own timer (open, read, checksum; "
                "likely from the page cache)"
            )
    if notes:
        o.print("; ".join(notes) + ".")


def _summary(o, answers: list[Answer], check: dict[str, Any] | None, rs: dict[str, Any] | None, memcpy: float,
             doc: Document, seconds: float) -> bool:
    cold = answers[0]
    hits = [a for a in answers[1:] if a.cached_tokens > 0 and set(a.tiers) == {"cpu"}]
    t = Table.grid(padding=(0, 3))
    for _ in range(4):
        t.add_column(justify="left")
    t.add_row("[bold]TTFT[/]", "no cache (question 1: full prefill)", _ms(cold.ttft), f"{cold.prompt_tokens:,} tokens computed")
    parts: list[str] = []
    ok = True
    if hits:
        hit = statistics.median(a.ttft for a in hits)
        t.add_row(
            "", f"cpu-tier hit (median of {len(hits)})", _ms(hit),
            f"[bold green]{cold.ttft / hit:.0f}x faster[/]; {_gb(hits[0].kv_bytes)} of KV loaded per request",
        )
        parts.append(f"cpu hit {cold.ttft / hit:.0f}x faster")
    elif len(answers) > 1:
        ok = False
        parts.append("no cpu-tier hit")
    if rs is not None:
        a = rs["answer"]
        if a["cached_tokens"] and set(a["tiers"]) == {"disk"}:
            t.add_row(
                "", "disk-tier hit after a restart", _ms(a["ttft"]),
                f"[bold green]{cold.ttft / a['ttft']:.0f}x faster[/]; {_gb(a['kv_bytes'])} of KV read from disk",
            )
            parts.append(f"disk hit after restart {cold.ttft / a['ttft']:.0f}x faster")
        else:
            ok = False
            parts.append("the restart found nothing on disk")
    o.print()
    o.print(t)
    if hits:
        h = hits[0]
        ideal = h.kv_bytes / (memcpy * harness.GB)
        o.print(
            f"Where a hit's time goes (question 2): KV load {_ms(h.load_seconds)} for {_gb(h.kv_bytes)} "
            f"(a memcpy of the same bytes: {_ms(ideal)} at {memcpy:.1f} GB/s); the rest, {_ms(h.ttft - h.load_seconds)}, "
            f"is the model computing the question's {h.prompt_tokens - h.cached_tokens} tokens against the cached handbook."
        )
    checks = [c for c in (check, (rs or {}).get("check")) if c is not None]
    if checks:
        same = all(c["identical"] for c in checks)
        ok = ok and same
        worst = max(c["max_abs_logit_diff"] for c in checks)
        parts.append(
            f"answers {'identical' if same else 'DIFFERENT'} with and without lmcache "
            f"({len(checks)} checked, max |Δ| first-token logits {worst:.1e})"
        )
    right = sum(a.correct for a in answers) + (rs["answer"]["correct"] if rs else 0)
    parts.append(f"{right}/{len(answers) + (1 if rs else 0)} answers match the handbook")
    word = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
    o.print()
    o.print(f"{word}: " + "; ".join(parts) + f" ({seconds:.0f} s in all).", soft_wrap=True)
    if not ok:
        err().print("lmcache demo: a cache hit was missing, or an answer changed with lmcache")
    return ok
