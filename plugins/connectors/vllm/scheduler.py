"""The scheduler side of the vLLM connector (:class:`ConnectorScheduler`): it opens no tiers.

It asks the workers' engines over the lookup channel (the engine's ``lookup`` service,
:mod:`lmcache.plugins.services.lookup`; workers in this process directly) or in-band
(``vllm.lookup: inband``, any host: the question rides in the connector metadata, each
rank answers in its worker metadata, merged by vLLM; the answer is read on the next
scheduling pass, one engine step later), keeps each
request's state (its prompt, blocks, key extra, what was saved), turns admitted hits into
:class:`~.metadata.LoadSpec` and completed prompt chunks into :class:`~.metadata.SaveSpec`
(:meth:`ConnectorScheduler.build_connector_meta`), and merges the workers' tier events for
vLLM to publish (:meth:`ConnectorScheduler.take_events`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

from lmcache.config import load_config
from lmcache.keys import KeyExtra

from ...services.lookup import LookupReply, socket_path
from ...services.lookup_client import LookupClient
from .common import Side, usable_tokens
from .events import BlockInfo, LMCacheTierEvents, block_info
from .extra import SKIP_SAVE, TAG_PREFIX, request_extra, request_params
from .metadata import LMCacheConnectorMetadata, LMCacheWorkerMetadata, LoadSpec, LookupAsk, SaveSpec, _Lookup, _ReqState
from .pd import PDScheduler
from .registry import LocalWorker, local_workers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["ConnectorScheduler"]


class ConnectorScheduler(Side):
    """The scheduler role's half of :class:`~lmcache.plugins.connectors.vllm.LMCacheConnector`
    (see the package doc): lookups, request state, connector metadata, events merge."""

    role = "scheduler"

    def __init__(self, vllm_config: VllmConfig, kv_transfer_config: Any, kv_cache_config: KVCacheConfig | None,
                 config_file: str | None, overrides: dict[str, Any]) -> None:
        super().__init__(vllm_config, kv_transfer_config, kv_cache_config, 0)
        self._client: LookupClient | None = None
        # the scheduler opens no tiers: the workers' engines answer its lookups
        self._configure(load_config(config_file, **overrides))
        opts = self.config.vllm
        self.async_loads = opts.async_loads
        self.lookup_wait = opts.lookup_wait
        self.lookup_timeout = opts.lookup_timeout
        if opts.load_failure_policy == "recompute" and getattr(kv_transfer_config, "kv_load_failure_policy", None) == "fail":
            # a cache miss must never fail a request: vLLM reads this after building us
            kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("lmcache: kv_load_failure_policy set to 'recompute' (a failed load is recomputed)")
        #: a kv_consumer (vLLM's role for an instance that only takes KV) stores nothing
        self.saves = getattr(kv_transfer_config, "kv_role", None) != "kv_consumer"
        self._tier_sources = [t.backend for t in self.config.tiers]
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}  # req -> lookup in flight or answered, not yet admitted
        self._loads: dict[str, LoadSpec] = {}
        self._async_pending: set[str] = set()  # async loads admitted, not reported finished yet
        self._hit_sources: dict[str, dict[str, int]] = {}
        self._unkeyed_warned: set[str] = set()
        self._params_warned: set[str] = set()  # lmcache.* request params with no effect, warned once
        self.stats = {"lookups": 0, "lookup_timeouts": 0, "hit_tokens": 0, "async_loads": 0, "sync_loads": 0,
                      "shifted_hit_tokens": 0}
        self._tier_events: LMCacheTierEvents | None = None  # the workers' events, not yet taken
        # in-band lookups (vllm.lookup): questions for the next metadata, answers by seq,
        # releases for the next metadata, the scheduling pass count, every rank's count
        self._asks: list[tuple[LookupAsk, _Lookup]] = []
        self._answers: dict[int, list[LookupReply]] = {}
        self._awaiting: set[int] = set()
        self._releases: list[int] = []
        self._seq = 0
        self._pass = 0
        pc = vllm_config.parallel_config
        self._ranks = self.tp_size * int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        #: prefill->decode (pd.role; .pd)
        self._pd = PDScheduler(self.config, self.instance, self.dp_rank, self.tp_size) if self.config.pd.role != "off" else None

    # ================================================================ lookup channel
    def _local_workers(self) -> list[LocalWorker] | None:
        """This instance's worker sides if all of them live in this process."""
        return local_workers(self.instance, self.dp_rank, self.tp_size)

    def _channel(self) -> LookupClient:
        if self._client is None:
            self._client = LookupClient([socket_path(self.instance, self.dp_rank, r) for r in range(self.tp_size)])
        return self._client

    def _start_lookup(self, tokens: list[int], extra: KeyExtra | None = None, request: str | None = None) -> _Lookup:
        skip = self.config.vllm.skip_last_n_tokens  # a PD decoder's prompt ends with the prefiller's first token
        if skip:
            tokens = tokens[: max(0, len(tokens) - skip)]
        self.stats["lookups"] += 1
        lk = _Lookup(tokens, time.monotonic(), extra, request)
        local = None if self.lookup_mode == "inband" else self._local_workers()
        if self.lookup_mode == "inband":
            self._seq += 1
            lk.seq, lk.inband = self._seq, True
            self._asks.append((LookupAsk(lk.seq, tokens, self.shifted, extra, request), lk))
        elif local is not None:
            lk.replies = []
            for w in local:
                try:
                    n, tiers = w.serve_lookup(tokens, True, self.shifted, extra, request)
                except Exception:
                    log.exception("lmcache: lookup failed; treating it as a miss")
                    n, tiers = 0, []
                lk.replies.append(LookupReply(n, bytes(tiers)))
        else:
            lk.seq = self._channel().submit(tokens, pin=True, shifted=self.shifted, extra=extra, request=request)
        return lk

    def _inband_result(self, lk: _Lookup) -> list[LookupReply] | None:
        """The ranks' in-band answers to ``lk`` once in; an answer missing a rank is a
        miss (its pins, where taken, are released)."""
        assert lk.seq is not None
        got = self._answers.pop(lk.seq, None)
        if got is not None and len(got) != self._ranks:
            log.warning("lmcache: lookup %d: %d of %d ranks answered; a miss", lk.seq, len(got), self._ranks)
            if any(r.hit for r in got):
                self._releases.append(lk.seq)
            got = [LookupReply(0, b"")]
        return got

    def _timed_out(self, lk: _Lookup, now: float) -> bool:
        """Whether an unanswered lookup is a miss: on the socket after ``lookup_timeout``;
        in-band once the answer did not come with its step's output, four scheduling
        passes after its question was sent (however long those steps took), or after
        ``lookup_timeout`` if it was never sent."""
        if not lk.inband:
            return now - lk.started >= self.lookup_timeout
        if lk.sent is None:
            return now - lk.started >= self.lookup_timeout
        return self._pass - lk.sent > 4

    def _release_lookup(self, lk: _Lookup) -> None:
        """Drop the pins a lookup took on every rank (nothing to do for a miss)."""
        if not lk.pinned:
            return
        lk.pinned = False
        if lk.inband:
            assert lk.seq is not None
            if lk.replies is None:  # unsent: never asked; sent: a late answer is released when it comes
                self._asks = [a for a in self._asks if a[1] is not lk]
                self._awaiting.discard(lk.seq)
                got = self._answers.pop(lk.seq, None)  # in, not read yet
                if got is not None and any(r.hit for r in got):
                    self._releases.append(lk.seq)
            elif any(r.hit for r in lk.replies):
                self._releases.append(lk.seq)  # each rank drops what it pinned for it
            return
        if lk.seq is not None and lk.replies is None:
            self._channel().forget(lk.seq)
        if lk.replies is not None and not any(r.hit for r in lk.replies):
            return
        if lk.replies is None:  # never answered here: whatever a rank pinned expires on its own
            return
        # each rank releases exactly what it leased (its own hit), never a chunk past it,
        # which may be another request's lease
        per_rank = [lk.tokens[: r.exact(self.chunk_size)] for r in lk.replies]
        local = self._local_workers()
        try:
            if local is not None:
                for w, toks in zip(local, per_rank):
                    if toks:
                        w.release_lookup(toks, lk.extra, lk.request)
            elif self._client is not None:
                self._client.release_each(per_rank, lk.extra, lk.request)
        except Exception:
            log.exception("lmcache: releasing a lookup's pins failed (they expire on their own)")

    # ================================================================ scheduler role
    def _key_extra(self, request: Request) -> tuple[KeyExtra | None, bool]:
        """``(extra, keyed)``: the request's key extra (:mod:`.extra`), and ``False``
        when it cannot be keyed safely (then it is neither looked up nor stored; one
        warning per reason)."""
        try:
            return request_extra(request), True
        except ValueError as exc:
            if str(exc) not in self._unkeyed_warned:
                self._unkeyed_warned.add(str(exc))
                log.warning("lmcache: %s: not cached (%s)", request.request_id, exc)
            return None, False

    def _skip_save(self, request: Request) -> bool:
        """Whether the request's ``kv_transfer_params`` ask LMCache's ``lmcache.skip_save``
        (its KV is still looked up and loaded). Other ``lmcache.*`` entries than that and
        the ``lmcache.tag.*`` tags (:mod:`.extra`) have no effect: one warning per name."""
        params = request_params(request)
        for name in params:
            if name != SKIP_SAVE and not name.startswith(TAG_PREFIX) and name not in self._params_warned:
                self._params_warned.add(name)
                log.warning("lmcache: kv_transfer_params %s has no effect here (served: %s, %s<name>)",
                            name, SKIP_SAVE, TAG_PREFIX)
        v = params.get(SKIP_SAVE, False)
        return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        extra, keyed = self._key_extra(request)
        if not keyed:
            return 0, False
        plan = self._pd.plan(request) if self._pd is not None else None
        if plan is not None and plan.pull is not None and not plan.loaded:  # PD decoder, vLLM's flow: the offer
            n = self._pd.pull_match(request, num_computed_tokens, self.block_size)  # type: ignore[union-attr]
            return n, bool(n) and self.async_loads != "never"
        lk = self._lookups.get(req_id)
        now = time.monotonic()
        if lk is not None and lk.replies is not None and now - lk.started > self.config.lookup_pin_timeout / 2:
            self._release_lookup(lk)  # answered long ago: its pins may have expired
            lk = None
        if lk is None:
            lk = self._lookups[req_id] = self._start_lookup(list(request.prompt_token_ids or []), extra, req_id)
            wait = self.lookup_wait
        else:
            wait = 0.0
        if lk.replies is None:
            assert lk.seq is not None
            got = self._inband_result(lk) if lk.inband else self._channel().result(lk.seq, wait)
            if got is None:
                if not self._timed_out(lk, now):
                    return None, False  # vLLM asks again on its next scheduling pass
                if lk.inband:
                    self._awaiting.discard(lk.seq)
                else:
                    self._channel().forget(lk.seq)
                self.stats["lookup_timeouts"] += 1
                log.warning("lmcache: %s: no lookup answer within %.3f s; a miss", req_id, self.lookup_timeout)
                got = [LookupReply(0, b"")]
            lk.replies = got
        hit = lk.hit
        if not lk.counted:
            lk.counted = True
            self.metrics.lookup(len(lk.tokens), hit, num_computed_tokens, time.monotonic() - lk.started)
        usable = usable_tokens(hit, request.num_tokens, self.block_size, lk.exact(self.chunk_size))
        if usable <= num_computed_tokens:
            self._release_lookup(lk)
            del self._lookups[req_id]
            return 0, False
        first = num_computed_tokens // self.chunk_size
        last = -(-usable // self.chunk_size)
        deep = any(lk.tier_of_chunk(i) > 0 for i in range(first, last))
        lk.is_async = self.async_loads == "always" or (self.async_loads == "auto" and deep)
        lk.local = num_computed_tokens
        return usable - num_computed_tokens, lk.is_async

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """Split a hit between vLLM's host / disk / external labels by the tier it comes from."""
        got = self._hit_sources.pop(request.request_id, None)
        if not num_external_tokens:
            return {}
        try:
            from vllm.v1.metrics.cache_hit_source import CacheHitSource
        except ImportError:  # vLLM without per-source metrics
            return {}
        if not got:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        names = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P}
        out: dict[Any, int] = {}
        for label, n in got.items():
            src = names.get(label, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        total = sum(out.values())
        if total != num_external_tokens:  # vLLM trimmed the hit: keep the split's proportions simple
            return {CacheHitSource.outermost(out): num_external_tokens}
        return out

    def _sources(self, lk: _Lookup, start: int, end: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for pos in range(start // self.chunk_size * self.chunk_size, end, self.chunk_size):
            i = pos // self.chunk_size
            t = lk.tier_of_chunk(i)
            backend = self._tier_sources[t] if t < len(self._tier_sources) else ""
            label = "host" if backend == "cpu" else "disk" if backend in ("disk", "fs", "gds") else "external"
            n = min(end, pos + self.chunk_size) - max(start, pos)
            out[label] = out.get(label, 0) + n
        return out

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks | None, num_external_tokens: int) -> None:
        req_id = request.request_id
        st = self._reqs.get(req_id)
        if st is None:
            extra, keyed = self._key_extra(request)
            st = self._reqs[req_id] = _ReqState(list(request.prompt_token_ids or []), extra=extra, keyed=keyed,
                                                skip_save=self._skip_save(request))
        st.request = request
        if self._pd is not None and st.pd is None:
            st.pd = self._pd.plans.get(req_id)
        if st.pd is not None and st.pd.pull is not None and not st.pd.loaded:
            self._pd_load(request, st, blocks, num_external_tokens)
            return
        if num_external_tokens <= 0:
            if req_id not in self._async_pending:  # the second call after an async load is a no-op
                lk = self._lookups.pop(req_id, None)
                if lk is not None:
                    self._release_lookup(lk)
            return
        lk = self._lookups.pop(req_id, None)
        if lk is None or lk.replies is None:
            log.warning("lmcache: %s: %d external tokens without a lookup; not loading", req_id, num_external_tokens)
            return
        local, is_async = lk.local, lk.is_async
        end = local + num_external_tokens
        # vLLM's LMCacheConnectorV1 wrapper passes no blocks: a sync load's blocks are the
        # scheduled request's, set in build_connector_meta
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        # the load reads (and then releases on every rank) the prefix all ranks hold; a
        # rank's pins past it expire after lookup_pin_timeout
        exact = lk.exact(self.chunk_size)
        shifted = end > exact
        self._loads[req_id] = LoadSpec(req_id, lk.tokens[: lk.hit], block_ids, local, end, is_async, exact, shifted,
                                       lk.extra, seq=lk.seq if lk.inband else None)
        if shifted:
            self.stats["shifted_hit_tokens"] += end - max(exact, local)
        self._hit_sources[req_id] = self._sources(lk, local, end)
        self.stats["hit_tokens"] += num_external_tokens
        self.stats["async_loads" if is_async else "sync_loads"] += 1
        if is_async:
            self._async_pending.add(req_id)

    def _pd_load(self, request: Request, st: _ReqState, blocks: KVCacheBlocks | None, n: int) -> None:
        """PD decoder, vLLM's flow: load the offered prompt tokens after the worker pulled them."""
        if n <= 0 or st.pd is None or st.pd.pull is None or self._pd is None:
            return
        local = request.num_computed_tokens
        is_async = self.async_loads != "never"
        toks = st.prompt[: st.pd.pull["tokens"]]
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        self._loads[request.request_id] = LoadSpec(request.request_id, toks, block_ids, local, local + n, is_async,
                                                   len(toks), False, st.extra, pull=st.pd.pull)
        st.pd.loaded = True  # once: a request back in the queue finds what arrived by a lookup
        self._pd.stats["pd_pulls"] += 1
        self.stats["hit_tokens"] += n
        self.stats["async_loads" if is_async else "sync_loads"] += 1
        if is_async:
            self._async_pending.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata()
        self._pass += 1
        meta.releases, self._releases = self._releases, []
        for ask, lk in self._asks:
            meta.asks.append(ask)
            self._awaiting.add(ask.seq)
            lk.sent = self._pass
        self._asks = []
        scheduled: list[tuple[str, int]] = []
        # asynchronous loads start now, into the blocks allocated for them; the request is
        # scheduled once every worker reported the load finished
        for req_id in list(self._loads):
            if self._loads[req_id].is_async:
                load = self._loads.pop(req_id)
                st = self._reqs.get(req_id)
                load.blocks = self._blocks(st, len(load.exact_ids)) if st is not None else None
                meta.loads.append(load)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:  # never seen in update_state_after_alloc: its cache salt is unknown
                st = self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids or []), keyed=False)
            st.block_ids = list(new.block_ids[0])
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            scheduled.append((req_id, cached.num_computed_tokens[i]))
        for req_id, num_computed in scheduled:
            st = self._reqs[req_id]
            load = self._loads.pop(req_id, None)
            if load is not None:
                load.block_ids = list(st.block_ids)
                load.blocks = self._blocks(st, len(load.exact_ids))
                meta.loads.append(load)
            end = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            n = len(st.prompt)
            save_end = n if end >= n else end // self.chunk_size * self.chunk_size
            if save_end > st.saved_end and self.saves and st.keyed and not st.skip_save:
                meta.saves.append(SaveSpec(req_id, st.prompt[:save_end], list(st.block_ids), st.saved_end, st.extra,
                                           self._blocks(st, save_end)))
                st.saved_end = save_end
            if end >= n and self._pd is not None and st.keyed:
                send = self._pd.send(req_id, st.prompt, st.extra)
                if send is not None:
                    meta.pd.append(send)
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _blocks(self, st: _ReqState, n_tokens: int) -> BlockInfo | None:
        """vLLM's block hashes of the request's first ``n_tokens`` tokens, for the workers'
        KV events (``None`` when vLLM publishes none)."""
        if not self.kv_events or st.request is None:
            return None
        try:
            return block_info(st.request, self.block_size, n_tokens)
        except Exception:  # events must never fail a request
            log.exception("lmcache: KV events: cannot read the block hashes of %s", st.request.request_id)
            return None

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, LMCacheWorkerMetadata):
            for seq, replies in wm.answers.items():
                if seq in self._awaiting:
                    self._awaiting.discard(seq)
                    self._answers[seq] = replies
                elif any(r.hit for r in replies):  # its request went away: drop the pins
                    self._releases.append(seq)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            self._async_pending.discard(req_id)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, LMCacheTierEvents):
            if self._tier_events is None:
                self._tier_events = events
            else:
                self._tier_events.add_events(events.get_all_events())
                self._tier_events.increment_workers(events.get_number_of_workers())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._pd.finished(request) if self._pd is not None else None
        self._forget(request.request_id)
        return False, params  # saves are synchronous: vLLM may free the blocks now

    def _forget(self, req_id: str) -> None:
        if self._pd is not None:
            self._pd.forget(req_id)
        self._reqs.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._hit_sources.pop(req_id, None)
        lk = self._lookups.pop(req_id, None)
        if lk is not None:
            self._release_lookup(lk)

    def take_events(self) -> Iterable[Any]:
        """lmcache's tier events the workers reported since the last call (each one once
        every worker reported it), for vLLM to publish with its own (.events)."""
        events, self._tier_events = self._tier_events, None
        if events is None:
            return ()
        return events.aggregate().get_all_events()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.close()
