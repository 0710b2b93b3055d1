"""Shifted reuse in a vLLM load (``approximate_reuse``, docs/truncation.md): the part of a
load past the exact prefix hit, from the content index, keys re-rotated to their positions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .metadata import LoadSpec


def load_shifted(self: Any, spec: LoadSpec, start: int, view: torch.Tensor) -> int:
    """``self``: the :class:`~.worker.ConnectorWorker`. Shifted reuse after the exact part (``view[:, :, :start]``): the chunks the
    content index has for the next tokens, their keys re-rotated to these positions,
    without a gap; returns how far they reach. The request's KV from ``start`` on is
    approximate: its saves go under shifted keys (:meth:`.save_sources.Staged._store`)."""
    from lmcache.kernels import rope

    assert self.engine is not None
    svc = self.engine.services.get("approximate_reuse")
    if svc is None or self._inv_freq is None or spec.extra:  # (its index has no keyed chunks)
        return start
    with self._async_lock:
        self._shifted_from[spec.req_id] = start
    run = svc.cover(spec.token_ids, start, len(spec.token_ids))
    at = start
    for m, kv in zip(run, svc.fetch(run)):
        if kv is None or m.start != at:
            break  # a chunk gone since the lookup: vLLM computes from here
        kv = kv.to(view.dtype)
        view[:, 0, at : at + m.length] = rope.rerotate(kv[:, 0], m.delta, self._inv_freq)
        view[:, 1, at : at + m.length] = kv[:, 1]
        at += m.length
    return at


__all__ = ["load_shifted"]
