"""The transformers connector: lmcache around a Hugging Face causal LM on any device.

For each prompt it asks the cache engine how many leading tokens are cached, loads that KV
into the model's ``DynamicCache``, runs the forward pass over the uncached suffix only,
and stores the chunks that were new. At least the last prompt token is always computed,
since its logits give the first generated token.

.. code-block:: python

    conn = TransformersConnector(model, tokenizer, engine)
    out = conn.generate("What is a KV cache?", max_new_tokens=32)
    out.text, out.cached_tokens, out.ttft
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from lmcache.config import KVSpec
from lmcache.dtypes import dtype_name
from lmcache.engine import CacheEngine

log = logging.getLogger(__name__)


@dataclass
class Prefill:
    """The state after the prompt: the model cache, the last logits and what hit."""

    cache: Any
    logits: torch.Tensor  # (vocab,) logits of the last prompt token, float32
    prompt_tokens: int
    cached_tokens: int  # tokens whose KV came from lmcache
    tiers: list[str]  # tier of each retrieved chunk
    ttft: float  # seconds from the call to the first token's logits
    load_seconds: float  # of which: fetching KV from lmcache
    kv_bytes_loaded: int
    #: of ``cached_tokens``: tokens reused from chunks computed at other positions
    #: (``approximate_reuse``), and the tokens of those chunks computed again
    shifted_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class Generation:
    tokens: list[int]  # generated token ids
    text: str | None
    prompt_tokens: int
    cached_tokens: int
    tiers: list[str]
    ttft: float
    total_seconds: float
    first_logits: torch.Tensor
    kv_bytes_loaded: int = 0
    stored_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def kv_spec_of(model: Any, dtype: torch.dtype | None = None) -> KVSpec:
    """The KV shape of a Hugging Face decoder model."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dt = dtype or next(model.parameters()).dtype
    return KVSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=heads, head_size=head_dim, dtype=dtype_name(dt))


class TransformersConnector:
    """Runs a Hugging Face causal LM with lmcache underneath (batch size 1 per prompt)."""

    #: the kv spec of a model (:func:`kv_spec_of`), for callers that load this class by name
    kv_spec_of = staticmethod(kv_spec_of)

    def __init__(self, model: Any, tokenizer: Any = None, engine: CacheEngine | None = None, *, layerwise: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        self.spec = kv_spec_of(model)
        if engine is None:
            engine = CacheEngine.from_config(None, kv_spec=self.spec)
        if engine.kv_spec is None:
            engine.kv_spec = self.spec
        elif engine.kv_spec != self.spec:
            raise ValueError(f"the engine is set up for KV {engine.kv_spec.signature}, the model has {self.spec.signature}")
        self.engine = engine
        if tokenizer is not None and engine.tokenize is None:  # the instance API's /v1/tokenize
            engine.tokenize = self.encode
        self.layerwise = layerwise
        self.device = next(model.parameters()).device
        self._buf: torch.Tensor | None = None
        self._inflight: Any = None
        self._inv_freq: Any = None  # rotary frequencies, read at the first shifted prefill (False: unsupported)

    # ---------------------------------------------------------------- helpers
    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = False) -> list[int]:
        """Token ids of a prompt (text, a chat message list, or ids)."""
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1)]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            if chat:
                return list(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
                ))
            return list(self.tokenizer(prompt)["input_ids"])
        if prompt and isinstance(prompt[0], dict):  # chat messages
            return list(self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False))
        return [int(t) for t in prompt]

    def _staging(self, num_tokens: int) -> torch.Tensor:
        """A ``(L, 2, H, num_tokens, D)`` host buffer for retrieved KV, reused across
        requests (a fresh allocation per hit pays first-touch page faults).

        Layout (L, 2, H, T, D): each layer's K and V are (1, H, T, D) views. Reuse is safe
        because the forward pass replaces the cache's views with its own tensors; a
        layer-wise copy still in flight from an aborted request is waited for first.
        """
        if self._inflight is not None:
            try:
                self._inflight.wait_all()
            except Exception:
                pass
            self._inflight = None
        spec = self.spec
        if self._buf is None or self._buf.shape[3] < num_tokens:
            self._buf = torch.empty(
                (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_size),
                dtype=next(self.model.parameters()).dtype,
                device="cpu",
            )
        return self._buf[:, :, :, :num_tokens]

    def _empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _cache_from_kv(self, buf: torch.Tensor, n: int, wait: Callable[[int], None] | None = None):
        """A DynamicCache whose layers are the first ``n`` tokens of ``buf`` (L, 2, H, T, D).

        The layers are views of ``buf``, not copies. With ``wait``, a layer's first
        update first calls ``wait(layer)`` (layer-wise loading).
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        pairs = [(buf[i, 0, :, :n].unsqueeze(0), buf[i, 1, :, :n].unsqueeze(0)) for i in range(buf.shape[0])]
        cache = DynamicCache(config=self.model.config) if wait is None else _LayerwiseCache(wait, config=self.model.config)
        if len(cache.layers) != len(pairs) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            # sliding-window or hybrid layers keep extra state: let them ingest a copy
            if wait is not None:
                for i in range(len(pairs)):
                    wait(i)
            return DynamicCache(pairs, config=self.model.config)
        for layer, (k, v) in zip(cache.layers, pairs):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    def kv_of(self, cache: Any, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (key, value) views ``(T, H, D)`` of a model cache (no copy)."""
        out = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values  # (1, H, T, D)
            out.append((k[0, :, :num_tokens].transpose(0, 1), v[0, :, :num_tokens].transpose(0, 1)))
        return out

    # ---------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], *, use_cache: bool = True, store: bool = True) -> Prefill:
        """Run the prompt, reusing cached KV for its longest cached prefix."""
        t0 = time.perf_counter()
        ids = list(ids)
        if not ids:
            raise ValueError("empty prompt")
        n = 0
        tiers: list[str] = []
        cache = None
        nbytes = 0
        t_load = 0.0
        if use_cache:
            hit = self.engine.lookup(ids, pin=True)
            want = min(hit, len(ids) - 1)  # the last token is always computed
            if want > 0:
                tl = time.perf_counter()
                spec = self.spec
                buf = self._staging(hit)
                view = buf.permute(0, 1, 3, 2, 4)
                on_cpu = self.device.type == "cpu"
                try:
                    if self.layerwise and on_cpu:
                        res = self._inflight = self.engine.retrieve_layerwise(ids[:hit], out=view)
                    else:
                        res = self.engine.retrieve(ids[:hit], out=view)
                finally:  # what the retrieve read is held by it: the lookup's leases can go
                    self.engine.release(ids[:hit])
                n = min(res.num_tokens, len(ids) - 1)
                tiers = res.tiers
                if n > 0:
                    if not on_cpu:
                        buf = buf.to(self.device, non_blocking=True)
                    cache = self._cache_from_kv(buf, n, res.wait if self.layerwise and on_cpu else None)
                    nbytes = n * spec.bytes_per_token()
                t_load = time.perf_counter() - tl
            elif hit:
                self.engine.release(ids[:hit])  # nothing usable: drop the lookup's leases
        if cache is None:
            cache = self._empty_cache()
            n = 0
            tiers = []
        shifted = self.engine.services.get("approximate_reuse") if use_cache else None
        if shifted is not None and not self._reuse_applies(ids):
            shifted = None
        if shifted is not None and n == 0:
            tl = time.perf_counter()
            n = self._load_head(ids, cache, shifted)
            t_load += time.perf_counter() - tl
            nbytes += n * self.spec.bytes_per_token()
        if shifted is not None:
            got = self._prefill_shifted(ids, cache, n, shifted, store)
            if got is not None:
                cache, logits, reused, recomputed, loaded, load_s, at_logits = got
                return Prefill(cache, logits, len(ids), n + reused, tiers, at_logits - t0,
                               t_load + load_s, nbytes + loaded, reused, recomputed)
        x = torch.tensor([ids[n:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        ttft = time.perf_counter() - t0
        cache = _cache_of(out, cache)
        if store:
            self.engine.store(ids, self.kv_of(cache, len(ids)))
        return Prefill(cache, logits, len(ids), n, tiers, ttft, t_load, nbytes)

    def _reuse_applies(self, ids: list[int]) -> bool:
        """Whether approximate reuse (the exact head included) may serve ``ids``: the
        model's rotary variant is one the re-rotation supports, and the prompt fits the
        positions whose frequencies do not depend on its length (dynamic scaling)."""
        from lmcache.kernels import rope

        if self._inv_freq is None:
            try:
                self._inv_freq = rope.inv_freq_of(self.model.config)
            except ValueError as exc:
                log.warning("approximate reuse is off for this model: %s", exc)
                self._inv_freq = False
        limit = rope.max_positions(self.model.config)
        return self._inv_freq is not False and (limit is None or len(ids) <= limit)

    def _prefill_shifted(self, ids: list[int], cache: Any, n: int, shifted: Any, store: bool) -> Any:
        """After the exact prefix ``ids[:n]`` (already in ``cache``): reuse chunks that
        match later runs of ``ids`` wherever they were computed, keys re-rotated to their
        new positions, the first ``recompute`` fraction of each computed again here, and
        compute the tokens between them and the last one. ``None`` when nothing matches
        (the caller computes as usual). See docs/truncation.md."""
        from lmcache.kernels import rope

        cfg = shifted.cfg
        size = self.engine.config.chunk_size
        if len(ids) - 1 - max(n, cfg.sink_tokens) < size:
            return None
        tl = time.perf_counter()
        matches = shifted.find(ids, max(n, cfg.sink_tokens), len(ids) - 1)
        pairs = [(m, kv) for m, kv in zip(matches, shifted.fetch(matches)) if kv is not None]
        load_s = time.perf_counter() - tl
        if not pairs:
            return None
        if cfg.select == "deviation":
            redo = self._by_deviation(ids, pairs, cfg.recompute)
        else:
            redo = [list(range(r)) for r in _recompute_counts([m.length for m, _ in pairs], cfg.recompute, cfg.select)]
        kept: list[int] = []
        parts_k, parts_v = [], []
        for (m, kv), again in zip(pairs, redo):
            again = set(again)
            keep = [o for o in range(m.length) if o not in again]
            if keep:
                kv = kv[:, :, keep].to(self.device)  # (L, 2, T, H, D)
                parts_k.append(rope.rerotate(kv[:, 0], m.delta, self._inv_freq))
                parts_v.append(kv[:, 1])
                kept.extend(m.start + o for o in keep)
        reused = len(kept)
        keys = torch.cat(parts_k, dim=1) if kept else None  # (L, T, H, D), in the order of kept
        values = torch.cat(parts_v, dim=1) if kept else None
        runs = _runs(range(n, len(ids)), set(kept))
        if sum(1 for r in runs if not r[2]) <= _MAX_COMPUTE_RUNS:
            cache, logits, at_logits = self._forward_in_order(ids, cache, runs, keys, values)
        else:
            todo = [i for a, b, reused in runs if not reused for i in range(a, b)]
            cache, logits, at_logits = self._forward_by_mask(ids, cache, n, kept, todo, keys, values)
        loaded = reused * self.spec.bytes_per_token()
        if store:
            exact = min(kept) if kept else len(ids)  # tokens before the first reused one saw only exact KV
            self.engine.store(ids[:exact], self.kv_of(cache, exact))
            shifted.store_shifted(ids, self.kv_of(cache, len(ids)), exact // size)
        return cache, logits, reused, sum(map(len, redo)), loaded, load_s, at_logits

    def _load_head(self, ids: list[int], cache: Any, shifted: Any) -> int:
        """A prompt with no exact hit whose start (a system prompt shorter than a chunk)
        begins an earlier prompt's first chunk: that KV appended to ``cache`` as it is (the
        same tokens at the same positions, so exact); how many tokens it holds (0: none)."""
        m = shifted.head(ids, len(ids) - 1)
        kv = shifted.fetch([m])[0] if m is not None else None
        if kv is None:
            return 0
        kv = kv.to(self.device)
        self._append(cache, kv[:, 0], kv[:, 1])
        return m.length

    def _append(self, cache: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``(L, T, H, D)`` keys and values to every layer of ``cache``."""
        for i in range(keys.shape[0]):
            cache.update(keys[i].transpose(0, 1).unsqueeze(0), values[i].transpose(0, 1).unsqueeze(0), i)

    def _forward_in_order(self, ids: list[int], cache: Any, runs: list, keys: Any, values: Any) -> tuple:
        """The cache built in position order, run by run: reused KV appended, the tokens
        to compute run as an ordinary continuation (the causal mask of a cache whose length
        is their first position), so the cache holds only the positions before them and
        the chunks recomputed near the cut cost little attention."""
        at = 0  # reused tokens appended so far (keys are in the order of kept)
        out = None
        for start, end, reused in runs:
            if reused:
                self._append(cache, keys[:, at : at + end - start], values[:, at : at + end - start])
                at += end - start
                continue
            x = torch.tensor([ids[start:end]], dtype=torch.long, device=self.device)
            pos = torch.arange(start, end, device=self.device)[None]
            out = self.model(input_ids=x, cache=cache, use_cache=True, position_ids=pos, logits_to_keep=1)
            cache = _cache_of(out, cache)
        assert out is not None  # the last token is always computed
        return cache, out.logits[0, -1].float(), time.perf_counter()

    def _forward_by_mask(self, ids: list[int], cache: Any, n: int, kept: list[int], todo: list[int],
                         keys: Any, values: Any) -> tuple:
        """Many runs to compute (tokens chosen one by one): the reused KV first, then one
        forward pass over every token to compute at its own position, with a mask by
        position (a token sees every key at an earlier position), the cache put back in
        position order after."""
        if kept:  # one append per layer (the cache concatenates on every update)
            self._append(cache, keys, values)
        order = torch.tensor(list(range(n)) + kept + todo, device=self.device)
        pos = torch.tensor(todo, device=self.device)
        mask = (order.unsqueeze(0) <= pos.unsqueeze(1))[None, None]  # (1, 1, q, kv): earlier positions only
        x = torch.tensor([[ids[i] for i in todo]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, position_ids=pos.unsqueeze(0),
                         attention_mask=mask, logits_to_keep=1)
        logits = out.logits[0, -1].float()
        at_logits = time.perf_counter()  # the first token is known: what follows is bookkeeping
        cache = _cache_of(out, cache)
        inverse = torch.argsort(order)  # the cache in position order again, for storing and decoding
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, inverse], layer.values[:, :, inverse]
        return cache, logits, at_logits

    def _by_deviation(self, ids: list[int], pairs: list, fraction: float) -> list[list[int]]:
        """CacheBlend's choice: of the reused tokens, the ``fraction`` whose layer-1 KV
        differs most from the exact one. Layer 0 sees no context but the tokens' own
        embeddings and positions, so one exact layer-0 pass over the prompt (about one
        layer's share of a prefill) gives layer 1's exact input; the tokens whose cached
        layer-1 keys and values are furthest from it lost the most context. Falls back to
        ``leading`` for a model without Llama-style layers."""
        from lmcache.kernels import rope

        inner = getattr(self.model, "model", None)
        layers = getattr(inner, "layers", None)
        attn = getattr(layers[1], "self_attn", None) if layers is not None and len(layers) > 1 else None
        if attn is None or not hasattr(attn, "k_proj") or getattr(attn, "k_norm", None) is not None:
            return [list(range(r)) for r in _recompute_counts([m.length for m, _ in pairs], fraction, "leading")]
        n = len(ids)
        pos = torch.arange(n, device=self.device)[None]
        h = inner.embed_tokens(torch.tensor([ids], device=self.device))
        cos, sin = inner.rotary_emb(h, position_ids=pos)
        mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None, None]
        h = layers[0](h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))
        h = layers[1].input_layernorm(h)
        d = self.spec.head_size
        k = attn.k_proj(h).view(n, -1, d)  # (T, H, D), not yet rotated
        v = attn.v_proj(h).view(n, -1, d)
        c, s = cos[0, :, None].to(k.dtype), sin[0, :, None].to(k.dtype)
        k = k * c + torch.cat([-k[..., d // 2 :], k[..., : d // 2]], dim=-1) * s
        scores = []
        for m, kv in pairs:
            ck = rope.rerotate(kv[1, 0].to(self.device), m.delta, self._inv_freq)
            span = slice(m.start, m.start + m.length)
            scores.append((ck - k[span]).flatten(1).norm(dim=1) + (kv[1, 1].to(self.device) - v[span]).flatten(1).norm(dim=1))
        flat = torch.cat(scores)
        want = min(flat.numel(), math.ceil(round(fraction * flat.numel(), 6)))
        top = set(torch.topk(flat, want).indices.tolist()) if want else set()
        out, at = [], 0
        for m, _ in pairs:
            out.append([o for o in range(m.length) if at + o in top])
            at += m.length
        return out

    # ---------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor | list[dict],
        *,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        chat: bool = False,
        use_cache: bool = True,
        store: bool = True,
        store_output: bool = False,
        stop_on_eos: bool = True,
    ) -> Generation:
        """Generate like ``model.generate`` (greedy by default, or sampling).

        ``store_output`` also stores the KV of the generated tokens, so a follow-up turn
        that repeats this answer hits it.
        """
        t0 = time.perf_counter()
        ids = self.encode(prompt, chat=chat)
        pre = self.prefill(ids, use_cache=use_cache, store=store)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = self._eos_ids() if stop_on_eos else set()
        cache = pre.cache
        logits = pre.logits
        new: list[int] = []
        for step in range(max_new_tokens):
            tok = _pick(logits, do_sample, temperature, top_k, top_p, gen)
            new.append(tok)
            if tok in eos or step == max_new_tokens - 1:
                break
            x = torch.tensor([[tok]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=x, cache=cache, use_cache=True)
            cache = _cache_of(out, cache)
            logits = out.logits[0, -1].float()
        stored = 0
        if store and store_output and len(new) > 1:
            full = ids + new[:-1]  # the last token has no KV yet
            stored = self.engine.store(full, self.kv_of(cache, len(full))).stored_tokens
        text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else None
        return Generation(
            tokens=new,
            text=text,
            prompt_tokens=pre.prompt_tokens,
            cached_tokens=pre.cached_tokens,
            tiers=pre.tiers,
            ttft=pre.ttft,
            total_seconds=time.perf_counter() - t0,
            first_logits=pre.logits,
            kv_bytes_loaded=pre.kv_bytes_loaded,
            stored_tokens=stored,
            timings={"load": pre.load_seconds},
        )

    def generate_batch(self, prompts: Sequence[Any], **kwargs: Any) -> list[Generation]:
        """Run several prompts one after another; later prompts reuse what earlier ones
        stored (shared prefixes are computed once)."""
        return [self.generate(p, **kwargs) for p in prompts]

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        return ids

    def close(self) -> None:
        self.engine.close()


def _layerwise_cache_class():
    from transformers import DynamicCache

    class LayerwiseCache(DynamicCache):
        """A DynamicCache whose prefilled layers arrive while the model runs."""

        def __init__(self, wait: Callable[[int], None], **kwargs: Any):
            super().__init__(**kwargs)
            self._wait: Callable[[int], None] | None = wait
            self._waited = 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self._wait is not None and layer_idx >= self._waited:
                self._wait(layer_idx)
                self._waited = layer_idx + 1
                if self._waited >= len(self.layers):
                    self._wait = None
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return LayerwiseCache


def _LayerwiseCache(wait: Callable[[int], None], **kwargs: Any):
    global _LAYERWISE_CLS
    if _LAYERWISE_CLS is None:
        _LAYERWISE_CLS = _layerwise_cache_class()
    return _LAYERWISE_CLS(wait, **kwargs)


_LAYERWISE_CLS: Any = None


#: up to this many runs of tokens to compute, the shifted prefill goes run by run in
#: position order; more (tokens chosen one by one) take one forward pass with a mask
_MAX_COMPUTE_RUNS = 6


def _runs(positions: range, reused: set[int]) -> list[tuple[int, int, bool]]:
    """``positions`` cut into maximal runs ``(start, end, reused)``."""
    out: list[tuple[int, int, bool]] = []
    for p in positions:
        r = p in reused
        if out and out[-1][2] == r and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1, r)
        else:
            out.append((p, p + 1, r))
    return out


def _recompute_counts(lengths: list[int], fraction: float, select: str) -> list[int]:
    """How many leading tokens of each reused chunk to compute again: ``fraction`` of all
    of them (rounded up), the earliest chunks first (``leading``) or the same share of
    each chunk (``chunk_starts``)."""
    if select == "chunk_starts":
        return [min(n, math.ceil(round(fraction * n, 6))) for n in lengths]
    left = math.ceil(round(fraction * sum(lengths), 6))
    out = []
    for n in lengths:
        out.append(min(n, left))
        left -= out[-1]
    return out


def _cache_of(out: Any, fallback: Any) -> Any:
    """The model output's cache (``cache`` in transformers 5, ``past_key_values`` before)."""
    for name in ("cache", "past_key_values"):
        c = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if c is not None:
            return c
    return fallback


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float, gen: torch.Generator | None) -> int:
    if not do_sample:
        return int(torch.argmax(logits))
    if temperature <= 0:
        raise ValueError("temperature must be positive when sampling")
    scores = logits / temperature
    if top_k and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


