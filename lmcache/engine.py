"""The cache engine: the public API engines and connectors call.

KV tensors have the layout ``(num_layers, 2, num_tokens, num_kv_heads, head_size)``
(index 0 of the second axis is K, 1 is V). ``store`` splits the tokens into chunks,
skips chunks already cached and puts the rest into the hierarchy; ``lookup`` tells how
many leading tokens are cached; ``retrieve`` returns exactly the stored bytes of the
longest cached prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Mapping, Sequence

import torch

from .config import Config, KVSpec, load_config
from .dtypes import dtype_from_name, dtype_name
from .errors import KVShapeError
from .engine_io import (  # noqa: F401 - RetrieveResult, StoreResult, LayerwiseRetrieval: public here too
    _KV, KVGather, LayerwiseRetrieval, RetrieveResult, StoreResult, _check_out, _check_out_dtype, _default_instance_id, _fits,
    copy_off_main,
    spec_in_tiers, store_chunks,
)
from .chunks import ChunkGateway
from .direct_read import Direct, into_out
from .hierarchy import StorageHierarchy
from .keys import Chunk, KeyExtra, TokenProcessor, key_prefix
from .memory import MemoryObj, MemoryPool
from .plugin_manager import Registries
from .prompt import Prompt, PromptMemo
from .services import start_services
from .tier import Tier

log = logging.getLogger(__name__)
#: chunks a store may hold while a file-like top tier writes them
PUTS_IN_FLIGHT = 4


class CacheEngine:
    """Store, look up and retrieve KV for token sequences through a tier hierarchy."""

    def __init__(
        self,
        config: Config,
        *,
        kv_spec: KVSpec | None = None,
        registries: Registries | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock
        self.tokens = TokenProcessor(config.chunk_size, config.save_unfull_chunk, config.hash_algorithm)
        #: the prompts seen last, so that one request's calls hash its tokens once (:mod:`lmcache.prompt`)
        self.prompts = PromptMemo(self.tokens)
        self.pool = MemoryPool(config.pool_size, prefault=config.memory_pool_prefault)
        self.hierarchy = StorageHierarchy(config, self.pool, registries, clock)
        self.kv_spec = kv_spec or config.kv_spec
        self._lock = threading.Lock()
        self._closed = False
        self._puts: Any = None  # the store's I/O threads for a file-like top tier
        self._admin = None
        #: this instance's name in the controller (``controller.instance_id`` or a generated one)
        self.instance_id: str = config.controller.instance_id or _default_instance_id()
        #: ``text -> token ids`` with the tokenizer of the model cached here, set by a connector
        #: that has one (the transformers connector); the instance API's ``/v1/tokenize`` uses it
        self.tokenize: Callable[[str], list[int]] | None = None
        #: hooks of the data path that services add to (see :mod:`lmcache.services`):
        #: ``filler(chunks, keys, have) -> fetched`` asked when a lookup misses after
        #: ``have`` chunks; ``observer(tokens, chunks, keys)`` told before chunks are stored
        #: or promoted, never of chunks keyed with a :class:`~lmcache.keys.KeyExtra` (their
        #: tokens alone do not name their KV: no content index or KV event may offer them
        #: as those tokens' KV)
        self.miss_fillers: list[Callable[[list[Chunk], list[str], int], int]] = []
        self.store_observers: list[Callable[[Any, list[Chunk], list[str]], None]] = []
        #: the started services by registered name (:mod:`lmcache.services`), closed in reverse
        self.services: dict[str, Any] = {}
        #: the one check and fetch of chunks (:mod:`lmcache.chunks`), shared with the services
        self.chunks = ChunkGateway.of(self)
        self._stack = contextlib.ExitStack()
        self._stack.callback(self.pool.close)  # unwound last: the memory goes back at close
        self._stack.callback(self.hierarchy.close)
        try:
            start_services(self, self.hierarchy.registries.services, self._stack)
        except BaseException:
            self._stack.close()
            raise

    # the services by their old attribute names (connectors, tools and tests read them)
    @property
    def api(self) -> Any:
        return self.services.get("api")

    @property
    def p2p(self) -> Any:
        return self.services.get("p2p")

    @property
    def controller_worker(self) -> Any:
        return self.services.get("controller")

    @property
    def kv_events(self) -> Any:
        svc = self.services.get("kv_events")
        return svc.publisher if svc is not None else None

    @property
    def kv_spec(self) -> KVSpec | None:
        return self._kv_spec

    @kv_spec.setter
    def kv_spec(self, spec: KVSpec | None) -> None:
        # Once the shape is known, no entry read from a tier may claim more than a whole
        # chunk of it: a forged header claiming 16 GiB is a corrupt entry, not an allocation.
        self._kv_spec = spec
        self.hierarchy.max_entry_bytes = (
            None if spec is None else self.config.chunk_size * spec.bytes_per_token()
        )

    @classmethod
    def from_config(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
        *,
        kv_spec: KVSpec | Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> CacheEngine:
        """Build an engine from a YAML path, a mapping or a :class:`Config`
        (then environment variables, then ``overrides``)."""
        cfg = load_config(source, **overrides)
        if isinstance(kv_spec, Mapping):
            kv_spec = KVSpec(**kv_spec)
        return cls(cfg, kv_spec=kv_spec)

    # --------------------------------------------------------------- keys
    _prefix: tuple[str, str] | None = None  # (kv signature, key prefix), set by _key_prefix

    def _key_prefix(self) -> str:
        """Every key of this engine up to the chunk hash, built and checked once per kv spec."""
        assert self.kv_spec is not None
        sig = self.kv_spec.signature
        cached = self._prefix
        if cached is None or cached[0] != sig:
            cached = self._prefix = (sig, key_prefix(self.config.namespace, self.config.model, sig))
        return cached[1]

    def chunk_keys(self, tokens: Any, extra: KeyExtra | None = None) -> tuple[list[Chunk], list[str]]:
        """The chunks of ``tokens`` and their key strings (see :class:`~lmcache.keys.KeyExtra`),
        hashed now (:meth:`prompt` keeps them for the calls that follow)."""
        return self.tokens.chunk_keys(tokens, self._key_prefix(), extra)

    def prompt(self, tokens: Any, extra: KeyExtra | None = None, request: str | None = None) -> Prompt:
        """``tokens`` with their chunk keys, hashed once for every call that follows:
        :meth:`lookup`, :meth:`locate`, :meth:`store`, :meth:`retrieve`, :meth:`release`
        and :meth:`retrieve_layerwise` take it in place of the tokens (and find it again
        when given the same tokens and extra: see :class:`~lmcache.prompt.PromptMemo`).
        ``request``: the caller's name of the request these tokens are (a prefix or an
        extension of) the tokens of; its prompt is then found by that name, with no digest
        of the tokens (:meth:`~lmcache.prompt.PromptMemo.of_request`); :meth:`forget` it when
        it finished. Needs the kv spec (the keys name it)."""
        if self.kv_spec is None:
            raise KVShapeError("no kv_spec yet: give the engine one, or store once, before building prompts")
        return self.prompts.get(tokens, self._key_prefix(), extra, request)

    def forget(self, request: str) -> None:
        """Drop what :meth:`prompt` keeps of ``request`` (it finished)."""
        self.prompts.forget(request)

    def _adopt_spec(self, kv: _KV) -> KVSpec:
        """This engine's kv spec, taken from the first KV stored; later KV must match it."""
        with self._lock:
            if self.kv_spec is None:
                self.kv_spec = kv.spec()
            spec = self.kv_spec
        kv.check_matches(spec)
        return spec

    # --------------------------------------------------------------- API
    def lookup(self, tokens: Any, *, pin: bool = False, extra: KeyExtra | None = None) -> int:
        """Number of leading tokens whose KV is cached.

        ``extra`` (here and in :meth:`locate`, :meth:`store`, :meth:`retrieve`,
        :meth:`release`, :meth:`retrieve_layerwise`) is what besides the tokens decides the
        KV (a vLLM request's cache salt, LoRA adapter, images): chunks stored with one
        extra are found only with an equal one; ``None`` or an empty one is the plain keys.

        With ``pin=True`` the hits are leased (not evictable) until the caller's
        :meth:`release` of the same tokens (once its :meth:`retrieve` returned, or when none
        will follow) or until ``lookup_pin_timeout`` seconds pass. Leases are counted per
        chunk: each ``release`` drops one, and a :meth:`retrieve` drops none, so one
        caller's retrieve can never end the lease another caller's lookup took.
        """
        return self.locate(tokens, pin=pin, extra=extra)[0]

    _spec_probe_at = -1e9  # when the tiers were last searched for a kv spec

    def _spec_from_tiers(self) -> KVSpec | None:
        """With no ``kv_spec`` yet (a fresh process over a persisted or shared tier), the
        spec of the entries the tiers hold (see :func:`lmcache.engine_io.spec_in_tiers`),
        searched at most once a second."""
        now = self.clock()
        if now - self._spec_probe_at < 1.0:
            return None
        self._spec_probe_at = now
        spec = spec_in_tiers(self.hierarchy.tiers, self.config.namespace, self.config.model)
        if spec is not None:
            with self._lock:
                if self.kv_spec is None:
                    self.kv_spec = spec
                    log.info("kv_spec %s taken from the entries already in the tiers", spec.signature)
        return self.kv_spec if spec is not None else None

    def locate(self, tokens: Any, *, pin: bool = False, extra: KeyExtra | None = None) -> tuple[int, list[str]]:
        """Like :meth:`lookup`, also naming the tier of each cached chunk."""
        self._check_open()
        if self.kv_spec is None and self._spec_from_tiers() is None:
            return 0, []
        prompt = self.prompt(tokens, extra)
        if self.miss_fillers:  # a service fetches what the tiers miss (the p2p endpoint)
            chunks, keys = prompt.chunks, prompt.keys
            tiers = self.chunks.exists_prefix(keys)
            for fill in self.miss_fillers:
                if len(tiers) == len(keys):
                    break
                if fill(chunks, keys, len(tiers)):
                    tiers = self.chunks.exists_prefix(keys)
            n = chunks[len(tiers) - 1].end if tiers else 0
        else:
            # hash and look up in growing batches (8, 32, 128, ... chunks): a prefix ends at
            # its first miss, so a miss costs the chunks up to it, not the whole prompt
            keys, tiers = [], []
            for batch in prompt.batches():
                keys += batch
                got = self.chunks.exists_prefix(batch)
                tiers += got
                if len(got) < len(batch):
                    break
            n = min(len(tiers) * self.tokens.chunk_size, len(prompt))
        if pin:
            held = self.hierarchy.lease_prefix(keys, tiers, self.config.lookup_pin_timeout)
            if held < len(tiers):  # evicted between the lookup and its lease: promise what is held
                tiers = tiers[:held]
                n = min(held * self.tokens.chunk_size, len(prompt))
            # the retrieve of what was found follows: it finds the keys (a caller that
            # brought its prompt, as the vLLM connector does, brings it again)
            head = prompt.head(n) if 0 < n < len(prompt) and not isinstance(tokens, Prompt) else None
            if head is not None:
                self.prompts.put(head)
        return n, tiers

    def store(self, tokens: Any, kv: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]] | KVGather, *,
              extra: KeyExtra | None = None) -> StoreResult:
        """Store the KV of ``tokens``.

        ``kv`` is a tensor ``(layers, 2, len(tokens), heads, head_size)``, or one
        ``(key, value)`` pair per layer, each ``(len(tokens), heads, head_size)``; views
        with any strides are fine (only the chunks not yet cached are copied). Or a
        :class:`~lmcache.engine_io.KVGather`: each chunk not yet cached is written by the
        caller straight into the cache's memory (one copy from a paged KV cache).
        """
        self._check_open()
        src = _KV.wrap(kv)
        self._adopt_spec(src)
        prompt = self.prompt(tokens, extra)
        if src.num_tokens != len(prompt):
            raise KVShapeError(f"kv holds {src.num_tokens} tokens but {len(prompt)} tokens were given")
        # a file-like top tier writes on the store's own I/O threads, so that the write of
        # chunk i overlaps the copy of chunk i+1 (at most PUTS_IN_FLIGHT chunks held);
        # the store observers (the KV-event publisher) hear the token ids of plain keys
        pool = self._put_pool() if self.hierarchy.tiers[0].backend.streams_gets else None
        r = self.chunks.store(prompt.keys, src, chunks=prompt.chunks, tokens=None if prompt.extra else prompt.tokens,
                              pool=pool, in_flight=PUTS_IN_FLIGHT)
        return StoreResult(r.stored_tokens, r.skipped_tokens, r.dropped_tokens)

    def _put_pool(self) -> Any:
        with self._lock:
            if self._puts is None:
                from concurrent.futures import ThreadPoolExecutor

                self._puts = ThreadPoolExecutor(2, thread_name_prefix="lmcache-store")
            return self._puts

    def retrieve(self, tokens: Any, *, out: torch.Tensor | None = None, extra: KeyExtra | None = None,
                 into: Callable[[Chunk, torch.Tensor], Sequence[Future] | None] | None = None,
                 leased: bool = False) -> RetrieveResult:
        """KV of the longest cached prefix of ``tokens``.

        With ``out`` (``(layers, 2, >= len(tokens), heads, head_size)``), KV is written
        into it and ``result.kv`` is ``out``; otherwise a new tensor of exactly
        ``num_tokens`` tokens is returned (``None`` on a total miss). Only the first
        ``num_tokens`` tokens of ``out`` are the result: chunks read after a miss may
        have been copied into the rest of it (a file-like tier copies each chunk as it
        arrives).

        With ``into`` (a sink; no ``out``), nothing is copied here: ``into(chunk, kv)``
        gets each chunk's KV in the memory pool (``(layers, 2, chunk tokens, heads,
        head_size)``, contiguous, to be read during the call only) as soon as it is
        ready, on a file-like tier's I/O threads too, so the caller copies it once, to
        where it goes. Every chunk of the result is handed over exactly once before this
        returns; chunks read after a miss may be handed over too (not part of the
        result, like ``out`` past ``num_tokens``). ``result.kv`` is ``None``. The sink
        may leave a copy running and return its futures: the chunk stays readable until
        they end, and this returns after every one (an error of one is raised here).

        The chunks read are kept from eviction while they are read (the promotions of
        one chunk may not evict the next): by the caller's leases with ``leased=True``
        (its ``lookup(tokens, pin=True)`` of these tokens, released after this returns:
        one guard per chunk, no pins taken here; a lease that expired leaves its chunk
        unguarded, so at worst it is a miss), else by pins taken for the read.
        """
        self._check_open()
        if out is not None and into is not None:
            raise ValueError("retrieve takes out or into, not both")
        if self.kv_spec is None and self._spec_from_tiers() is None:
            return RetrieveResult(0, out)
        spec = self.kv_spec
        if out is not None:
            _check_out_dtype(out, spec)  # before anything is read: never a silent conversion
        chunks, keys = self._to_read(tokens, extra)
        got: list[tuple[Chunk, MemoryObj, Tier]] = []
        # chunks that a file-like tier reads on its I/O threads are copied into `out` there,
        # as each arrives, overlapping the reads of the next ones (`out` past the cached
        # prefix may then hold KV of chunks after a miss; it is not part of the result)
        copied: set[int] = set()
        running: list[Future] = []  # copies a sink left running on the chunks in `got`
        on_ready = _on_ready(chunks, spec, out, into, copied, running)
        direct, made = None, {}  # chunks a file tier reads straight into `out` (direct_read)
        if on_ready is not None and into is None:
            direct, made = into_out(out, chunks, spec) or (None, {})
        try:
            got = self._fetch(chunks, keys, on_ready, pin=not leased, direct=direct)
            n = got[-1][0].end if got else 0
            if into is not None:
                for j, (chunk, obj, _) in enumerate(got):
                    if j not in copied:
                        running.extend(into(chunk, obj.tensor) or ())
                for f in running:
                    f.result()
                return RetrieveResult(n, None, [t.name for _, _, t in got], [c for c, _, _ in got])
            if out is None and n:
                out = torch.empty(spec.chunk_shape(n), dtype=dtype_from_name(spec.dtype))
            elif out is not None and n:
                _check_out(out, n, spec)
            for j, (chunk, obj, _) in enumerate(got):
                if j not in copied and obj is not made.get(j):  # (a direct read is in place)
                    out[:, :, chunk.start : chunk.end].copy_(obj.tensor)  # type: ignore[index]
        finally:
            futures_wait(running)  # on an error too: no copy may read a chunk given back
            for _, obj, _ in got:
                obj.unref()
        return RetrieveResult(n, out, [t.name for _, _, t in got], [c for c, _, _ in got])

    def release(self, tokens: Any, *, extra: KeyExtra | None = None, upto: int | None = None) -> None:
        """Drop the leases that the caller's ``lookup(tokens, pin=True)`` took: once the
        :meth:`retrieve` that followed returned (it holds what it read), or when none will
        (otherwise they expire after ``lookup_pin_timeout``). One lease per chunk each call.
        ``upto`` (a lookup's answer) releases what ``lookup(tokens[:upto], pin=True)`` took,
        without hashing that prefix again."""
        self._check_open()
        if self.kv_spec is not None:
            prompt = self.prompt(tokens, extra)
            self.hierarchy.release_leases(prompt.keys if upto is None else prompt.keys_upto(upto))

    def retrieve_layerwise(self, tokens: Any, out: torch.Tensor, *, timeout: float = 60.0,
                           extra: KeyExtra | None = None) -> LayerwiseRetrieval:
        """Start a retrieve that fills ``out`` one layer at a time.

        The cached chunks are fetched from their tiers before this returns (so
        ``num_tokens`` is known); a background thread then copies layer 0, 1, ... into
        ``out`` (``(layers, 2, >= len(tokens), heads, head_size)``, any strides), so an
        engine can compute layer i while layer i+1 is still being copied.
        ``handle.wait(i)`` blocks until layer ``i`` is in place (at most ``timeout``
        seconds, then ``TimeoutError``).
        """
        self._check_open()
        if self.kv_spec is None:
            return LayerwiseRetrieval([], 0, out, 0, None, timeout)
        spec = self.kv_spec
        _check_out_dtype(out, spec)
        chunks, keys = self._to_read(tokens, extra)
        got = self._fetch(chunks, keys)
        n = got[-1][0].end if got else 0
        try:
            if n:
                _check_out(out, n, spec)
        except BaseException:
            for _, obj, _ in got:
                obj.unref()
            raise
        return LayerwiseRetrieval(got, n, out, spec.num_layers, None, timeout)

    def _fetch(self, chunks: list[Chunk], keys: list[str], on_ready: Callable[[int, MemoryObj], None] | None = None,
               *, pin: bool = True, direct: Direct | None = None) -> list[tuple[Chunk, MemoryObj, Tier]]:
        """Chunk objects of the longest cached prefix (the caller owns one reference each),
        through the chunk gateway: one batch per tier, each checked against the kv spec (a
        wrong one is dropped from its tier, counted corrupt, never promoted)."""
        hits = self.chunks.find(keys, sizes=[c.num_tokens for c in chunks], on_ready=on_ready, pin=pin, direct=direct)
        return [(c, obj, tier) for c, (obj, tier) in zip(chunks, hits)]  # (a prefix: no None)

    def _to_read(self, tokens: Any, extra: KeyExtra | None = None) -> tuple[list[Chunk], list[str]]:
        """The chunks and keys a retrieve reads: observers hear them (promotions are
        stored chunks too), and chunks missing after the local prefix are asked of the
        miss fillers first (usually a no-op: the lookup before already fetched them)."""
        prompt = self.prompt(tokens, extra)
        chunks, keys = prompt.chunks, prompt.keys
        for observe in self.store_observers if not prompt.extra else ():
            observe(prompt.tokens, chunks, keys)
        for fill in self.miss_fillers if keys else ():
            have = len(self.hierarchy.exists_prefix(keys))
            if have == len(keys):
                break
            fill(chunks, keys, have)
        return chunks, keys

    @property
    def peer_url(self) -> str | None:
        """``lm://host:port`` of this instance's peer endpoint, or ``None`` (``p2p.enabled``)."""
        return self.p2p.url if self.p2p is not None else None

    def push(self, tokens: Any = None, target: str = "", *, keys: Sequence[str] | None = None,
             tier: str | None = None, target_tier: str | None = None, remove_source: bool = False) -> dict[str, Any]:
        """Send the cached KV of ``tokens`` (its cached prefix), or of ``keys``, to
        another instance's peer endpoint: ``target`` is ``lm://host:port`` or an
        instance id (resolved through the controller). The target stores the chunks in
        ``target_tier`` (default: its top tier) and serves them as local hits, e.g. a
        decode instance after a prefill instance pushed a request's KV. With
        ``remove_source`` the sent entries are evicted here (from ``tier``, else from
        every tier): a move. Raises ``BackendError`` when the target fails."""
        self._check_open()
        if self.p2p is None:
            raise RuntimeError("push needs the peer-to-peer part: set p2p: {enabled: true}")
        return self.p2p.push_prompt(tokens, target, keys=keys, tier=tier, target_tier=target_tier, remove_source=remove_source)

    # --------------------------------------------------------------- admin
    def flush(self) -> None:
        """Wait for queued lower-tier writes."""
        self.hierarchy.flush()

    @property
    def admin(self):
        """The admin operations on this engine's tiers (:class:`lmcache.admin.Admin`):
        list keys, evict, pin; the instance API serves exactly these."""
        if self._admin is None:
            from .admin import Admin

            self._admin = Admin.for_engine(self)
        return self._admin

    @property
    def api_url(self) -> str | None:
        """``http://host:port`` of the instance API, or ``None`` when it is not enabled."""
        return self.api.url if self.api is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters and usage: per tier (:meth:`lmcache.tier.Tier.info`: hits,
        misses, hit_rate, bytes_in, bytes_out, evictions, used_bytes, capacity_bytes,
        entries, ...), the memory pool and the hierarchy's write queue."""
        out = {
            "tiers": {t.name: t.info() for t in self.hierarchy.tiers},
            "pool": {"capacity": self.pool.capacity, "used": self.pool.used, "live": self.pool.live},
            "hierarchy": {**dataclasses.asdict(self.hierarchy.stats), "pending_writes": self.hierarchy.pending_writes()},
        }
        for name, svc in self.services.items():
            got = svc.info()
            if got is not None:
                out[name] = got
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CacheEngine is closed")

    def close(self) -> None:
        """Flush pending tier writes and release every tier."""
        if self._closed:
            return
        self._closed = True
        if self._puts is not None:
            self._puts.shutdown(wait=True)
        self._stack.close()  # the services in reverse start order, then the hierarchy

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

def _on_ready(chunks: list[Chunk], spec: KVSpec, out: torch.Tensor | None,
              into: Callable[[Chunk, torch.Tensor], Sequence[Future] | None] | None, copied: set[int],
              running: list[Future]) -> Callable[[int, MemoryObj], None] | None:
    """What a file-like tier calls on its I/O threads as each chunk of a retrieve arrives
    (``None``: nothing, the chunks are copied after the fetch): hand it to ``into`` (the
    futures it leaves go to ``running``), or copy it into ``out`` (when ``out`` holds the
    whole request); the chunks handled are added to ``copied``."""
    if into is not None:
        def to_sink(j: int, obj: MemoryObj) -> None:
            if obj.shape == spec.chunk_shape(chunks[j].num_tokens) and dtype_name(obj.dtype) == spec.dtype:
                try:
                    running.extend(into(chunks[j], obj.tensor) or ())
                except Exception:  # handed over again after the fetch, where its error reaches the caller
                    return
                copied.add(j)
        return to_sink
    if out is None or not chunks or not _fits(out, chunks[-1].end, spec):
        return None
    dtype = dtype_from_name(spec.dtype)
    # an out made under torch.inference_mode (the transformers connector's) can only be written in it
    inference = out.is_inference()

    def to_out(j: int, obj: MemoryObj) -> None:
        c = chunks[j]
        if obj.shape == spec.chunk_shape(c.num_tokens) and obj.dtype == dtype:
            with torch.inference_mode(inference):
                copy_off_main(out[:, :, c.start : c.end], obj.tensor)  # type: ignore[index]
            copied.add(j)
    return to_out

