"""Where one vLLM load's chunks go: one interface (:class:`LoadSink`), four places.

The worker loads every request the same way (:meth:`.worker.ConnectorWorker.load`): the
PD pull first where the request has one, then ``sink.fetch(keys)`` (the engine's
retrieve; the lookup's pins end right after it, whatever happens), then
``sink.finish(got)`` (what arrived, into vLLM's paged blocks; the tokens loaded). The sinks:

- :class:`Direct`: each chunk from the engine's memory pool straight into the paged blocks
  as it is ready (one copy, one kernel call per chunk and layer);
- :class:`Blocks`: whole-block entries (:mod:`.blocks`), one copy per block and layer;
- :class:`Staged`: the request into one host buffer, then one bulk scatter (MLA, vLLM's CPU
  attention layout, shifted reuse: :mod:`.shifted_load` re-rotates keys in the buffer);
- :class:`Layerwise`: the request into a buffer one layer at a time; vLLM's
  ``wait_for_layer_load`` scatters each layer as it lands.

``w`` below is the :class:`~.worker.ConnectorWorker` (its layout, layers, buffers and
engine); this module does not import it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

from lmcache import kernels as K

from .shifted_load import load_shifted

if TYPE_CHECKING:
    import torch

    from .metadata import LoadSpec


class LoadSink:
    """One load of ``spec`` by the worker ``w``: :meth:`fetch`, then :meth:`finish`."""

    def __init__(self, w: Any, spec: LoadSpec):
        self.w, self.spec = w, spec

    def fetch(self, keys: Any) -> int:
        """Run the engine's retrieve of ``keys`` (the spec's keyed tokens); tokens found."""
        raise NotImplementedError

    def finish(self, got: int) -> int:
        """Move what :meth:`fetch` left into the paged blocks; the tokens loaded."""
        return got


class Direct(LoadSink):
    """Chunk by chunk from the pool into the paged blocks (tokens below ``skip`` are vLLM's
    already, slots past ``load_end`` are padding; a chunk read after a miss lands in blocks
    reported failed, so recomputed)."""

    def __init__(self, w: Any, spec: LoadSpec):
        super().__init__(w, spec)
        self.slots = w._load_slots(spec, spec.load_end)
        self.device = w._device()

    def fetch(self, keys: Any) -> int:
        # the scheduler's lookup leased these chunks on this rank: the leases guard the read
        return self.w.engine.retrieve(keys, into=self.chunk, extra=self.spec.extra, leased=True).num_tokens

    def chunk(self, chunk: Any, kv: torch.Tensor) -> Sequence[Future] | None:
        skip, w = self.spec.skip, self.w
        if chunk.end <= skip:
            return None
        buf = kv.view(len(w._layers), 1, *kv.shape[2:]) if w._split else kv  # the kernels' chunk form
        K.scatter(buf.to(self.device), w._layout, self.slots[chunk.start : chunk.end], w._layers,
                  max(0, skip - chunk.start))
        return None


class Blocks(Direct):
    """Whole-block entries (:mod:`.blocks`): each block of a chunk is one copy per layer from
    the pool into the request's block (some left running: retrieve waits for them)."""

    def chunk(self, chunk: Any, kv: torch.Tensor) -> Sequence[Future] | None:
        a, b = max(self.spec.skip, chunk.start), min(self.spec.load_end, chunk.end)
        return self.w._block_entries.load(kv, chunk.start, self.spec.block_ids, a, b) if a < b else None


class Staged(LoadSink):
    """The request into one host buffer (kept per ``role``), then one bulk scatter; shifted
    reuse extends an exact hit there before the scatter."""

    def __init__(self, w: Any, spec: LoadSpec, role: str | None):
        super().__init__(w, spec)
        self.buf, self.view = w._buffer(len(spec.token_ids), role)

    def fetch(self, keys: Any) -> int:
        return self.w.engine.retrieve(keys, out=self.view, extra=self.spec.extra).num_tokens

    def finish(self, got: int) -> int:
        spec, w = self.spec, self.w
        if spec.shifted and got == len(spec.exact_ids) and got < spec.load_end:
            got = load_shifted(w, spec, got, self.view)
        if min(got, spec.load_end) > spec.skip:
            K.scatter(self.buf.to(w._device()), w._layout, w._load_slots(spec, got), w._layers, spec.skip)
        return got


class Layerwise(LoadSink):
    """Layer by layer into a fresh buffer: :meth:`finish` hands the retrieve's handle to the
    worker, whose ``wait_for_layer_load`` scatters each layer as it lands."""

    def __init__(self, w: Any, spec: LoadSpec):
        super().__init__(w, spec)
        self.buf, self.view = w._buffer(len(spec.token_ids))
        self.handle: Any = None

    def fetch(self, keys: Any) -> int:
        self.handle = self.w.engine.retrieve_layerwise(keys, self.view, extra=self.spec.extra)
        return self.handle.num_tokens

    def finish(self, got: int) -> int:
        self.w._layer_loads.append((self.spec, self.handle, self.buf, self.w._load_slots(self.spec, got)))
        return got


__all__ = ["Blocks", "Direct", "Layerwise", "LoadSink", "Staged"]
