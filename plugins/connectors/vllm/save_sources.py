"""Where one vLLM save's chunks come from: one interface (:class:`SaveSource`), three ways.

The worker saves every request the same way (:meth:`.worker.ConnectorWorker.save_source`):
``src.begin()`` (``False``: nothing to save), then, for a layerwise save, ``src.layer(i)``
as vLLM's forward reaches layer ``i``, then ``src.finish()`` (the engine's store; the
pins the save took end whatever happens); ``src.abort()`` ends a save that cannot finish
(a layer walk that stopped short) and stores nothing. The sources:

- :class:`Direct`: no staging; the engine asks for each chunk it does not hold yet,
  gathered from the paged blocks straight into the cache's memory pool
  (:class:`~lmcache.engine_io.KVGather`); no lookup before it, no leases;
- :class:`Staged`: what is cached already is pinned (a lookup with ``pin=True``), the rest
  gathered into one buffer, then stored (MLA, vLLM's CPU attention layout, a request
  built on shifted reuse, whose KV goes under shifted keys only);
- :class:`Layerwise`: as :class:`Staged`, the gather one layer at a time while the
  forward runs.

``w`` below is the :class:`~.worker.ConnectorWorker` (its layout, layers, buffers and
engine); this module does not import it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from lmcache import kernels as K
from lmcache.engine_io import KVGather

from .layout import _slots

if TYPE_CHECKING:
    from .metadata import SaveSpec

log = logging.getLogger(__name__)


class SaveSource:
    """One save of ``spec`` by the worker ``w``: :meth:`begin`, :meth:`layer` per layer
    (layerwise only), then :meth:`finish` or :meth:`abort`."""

    def __init__(self, w: Any, spec: SaveSpec):
        self.w, self.spec = w, spec

    def begin(self) -> bool:
        """Set the save up; ``False`` when there is nothing to save (nothing is held then)."""
        return True

    def layer(self, i: int) -> None:
        """Take layer ``i`` of the request's KV (a layerwise save, while the forward runs)."""

    def finish(self) -> None:
        """Store what this save took; a failure is logged, never raised."""
        raise NotImplementedError

    def abort(self) -> None:
        """End the save without storing (what :meth:`begin` held is released)."""

    def _stored(self, res: Any, t0: float) -> None:
        self.w.metrics.store(res.stored_tokens, time.perf_counter() - t0)
        self.w.metrics.usage(self.w.engine.hierarchy.tiers)


class Direct(SaveSource):
    """Chunk by chunk from the paged blocks into the pool, as the engine's store asks (on
    a GPU through one chunk-sized device buffer; whole-block entries one copy per block)."""

    def finish(self) -> None:
        w, spec = self.w, self.spec
        slots = _slots(spec.block_ids, w.block_size, len(spec.token_ids))
        layers, layout, device, blocks = w._layers, w._layout, w._device(), w._block_entries

        def fill(start: int, end: int, out: torch.Tensor) -> None:
            shape = layout.chunk_shape(layers[0], len(layers), end - start)
            if blocks is not None:  # whole blocks (.blocks)
                blocks.save(out, start, end, spec.block_ids)
            elif device.type == "cpu":
                K.gather(layers, layout, slots[start:end], out.view(shape))
            else:
                out.view(shape).copy_(K.gather(layers, layout, slots[start:end],
                                               torch.empty(shape, dtype=out.dtype, device=device)))

        kv = w.kv_spec
        src = KVGather(fill, num_tokens=len(spec.token_ids), num_layers=kv.num_layers,
                       num_kv_heads=kv.num_kv_heads, head_size=kv.head_size, dtype=layers[0].dtype)
        t0 = time.perf_counter()
        try:
            self._stored(w.engine.store(spec.keyed(w.engine), src, extra=spec.extra), t0)
        except Exception:
            log.exception("lmcache: storing %s failed", spec.req_id)


class Staged(SaveSource):
    """Pin what is cached, gather the rest into one buffer on the engine's device (kept
    for :attr:`role`, see ``ConnectorWorker._buffer``), store it, release the pins."""

    role: str | None = "gather"

    def begin(self) -> bool:
        w, spec = self.w, self.spec
        self.skip = w.engine.lookup(spec.keyed(w.engine), pin=True, extra=spec.extra)
        if self.skip >= len(spec.token_ids):
            w.engine.release(spec.keyed(w.engine), extra=spec.extra)
            return False
        # from here on, what this lookup leased is token_ids[:skip]: every release below
        # drops exactly that (a chunk past it may be another caller's lease by then)
        self.slots = _slots(spec.block_ids, w.block_size, len(spec.token_ids))
        self.dev_buf, _ = w._buffer(len(spec.token_ids), self.role, w._device())
        return True

    def abort(self) -> None:
        self.w.engine.release(self.spec.keyed(self.w.engine), extra=self.spec.extra, upto=self.skip)

    def finish(self) -> None:
        try:
            K.gather(self.w._layers, self.w._layout, self.slots, self.dev_buf, self._gather_from())
        except Exception:
            log.exception("lmcache: gathering %s failed", self.spec.req_id)
            self.abort()
            return
        self._store()

    def _gather_from(self) -> int:
        """Where the gather starts: ``skip`` (what is cached already), or the first position
        a shifted load did not load exactly, if earlier."""
        b = self.w.shifted_from(self.spec.req_id)
        return self.skip if b is None else min(self.skip, b)

    def _store(self) -> None:
        """Store the gathered buffer (under shifted keys from where a shifted load began)."""
        w, spec, dev_buf = self.w, self.spec, self.dev_buf
        try:
            if dev_buf.device.type == "cpu":  # gathered on the host already (vLLM's CPU backend)
                view = w._view_of(dev_buf)
            else:
                buf, view = w._buffer(len(spec.token_ids), "save")
                g = self._gather_from()
                buf[:, :, g:].copy_(dev_buf[:, :, g:])
            b = w.shifted_from(spec.req_id)
            if b is not None and b < len(spec.token_ids):
                # KV built on shifted reuse is not exact: never under the exact keys
                if b:
                    w.engine.store(spec.token_ids[:b], view[:, :, :b], extra=spec.extra)
                svc = w.engine.services.get("approximate_reuse")
                if svc is not None:
                    svc.store_shifted(spec.token_ids, view, b // w.chunk_size)
                return
            # chunks before ``skip`` stay pinned (leased) until after the store, so the
            # store skips them and never reads their unfilled rows
            t0 = time.perf_counter()
            self._stored(w.engine.store(spec.keyed(w.engine), view, extra=spec.extra), t0)
        except Exception:
            log.exception("lmcache: storing %s failed", spec.req_id)
        finally:
            self.abort()


class Layerwise(Staged):
    """As :class:`Staged`, the gather layer by layer (:meth:`layer`) into a fresh buffer."""

    role = None

    def layer(self, i: int) -> None:
        w = self.w
        for j in w._kernel_layers(i):
            K.gather_layer(w._layers[j], w._layout, self.slots, self.dev_buf[j], self.skip)

    def finish(self) -> None:
        self._store()


__all__ = ["Direct", "Layerwise", "SaveSource", "Staged"]
