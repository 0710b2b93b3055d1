"""A retrieve's hits read straight into the caller's ``out`` (issue 47): one copy.

A file tier's hit otherwise makes two copies: the file into pool memory (checked as it
lands), then pool memory into ``out``. When the caller gives ``out`` and the highest tier
holding a chunk is a tier whose backend ``reads_into`` (the disk tier, ``raw`` entries),
the chunk's file is read straight into the chunk's ``(layer, k/v)`` slices of ``out`` and
checked there. The chunk is then promoted into the tiers above as before, but off the
request: the file is read again, from the page cache, into pool memory on the tier's I/O
threads once the retrieve has its bytes (``out`` is the caller's from the moment the
retrieve returns, so the promotion cannot copy from it).

:func:`fetch_direct` is called by :meth:`lmcache.chunks.ChunkGateway.fetch`; what it does
not read (a chunk held higher up, an entry of another codec or shape, a miss) goes the
usual way through :meth:`lmcache.hierarchy.StorageHierarchy.get`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .memory import MemoryObj

if TYPE_CHECKING:
    from .hierarchy import StorageHierarchy
    from .tier import Tier

log = logging.getLogger(__name__)

#: what the caller gives for chunk ``j``: ``(shape, dtype name, byte segments, the object
#: that stands for the chunk once its bytes are in place)``, or ``None`` (read it as usual)
Direct = Callable[[int], "tuple[Sequence[int], str, Sequence[memoryview], MemoryObj] | None"]


def fetch_direct(hierarchy: StorageHierarchy, keys: Sequence[str], direct: Direct) -> dict[int, tuple[MemoryObj, Tier]]:
    """The chunks of ``keys`` read straight into the caller's memory: ``{j: (the
    caller's object for chunk j, the tier it came from)}``. The caller holds pins or
    leases on ``keys`` (as for :meth:`~lmcache.hierarchy.StorageHierarchy.get`)."""
    tiers = hierarchy.tiers
    found: dict[int, tuple[MemoryObj, Tier]] = {}
    if not any(getattr(t.backend, "reads_into", False) for t in tiers):
        return found
    todo: list[int] = list(range(len(keys)))
    made: dict[int, Any] = {}
    for i, tier in enumerate(tiers):
        if not todo:
            break
        if not getattr(tier.backend, "reads_into", False):
            # held here: read as usual (this tier's copy is the one to serve)
            todo = [j for j, held in zip(todo, tier.exists([keys[j] for j in todo])) if not held]
            continue
        for j in todo:  # the caller's segments, made only for chunks a file tier may read
            if j not in made:
                made[j] = direct(j)
        todo = [j for j in todo if made[j] is not None]
        got = _read_into(tier, [(keys[j], *made[j][:3]) for j in todo])
        for j, ok in zip(todo, got):
            if ok is True:
                found[j] = (made[j][3], tier)
                if i:
                    _promote_later(hierarchy, i, keys[j])
        todo = [j for j, ok in zip(todo, got) if ok is None]  # False: read as usual
    return found


def _read_into(tier: Tier, items: list[tuple[str, Sequence[int], str, Sequence[memoryview]]]) -> list[bool | None]:
    """:meth:`read_into` of ``tier``'s backend with the tier's accounting (hits, misses,
    recency, backoff on an error), as :meth:`lmcache.tier.Tier.get` keeps it."""
    if not tier.available:
        return [False] * len(items)  # the usual path serves the misses and counts them
    t0 = time.perf_counter()
    try:
        got = tier.backend.read_into(items)
    except Exception as exc:
        tier._failed("read", exc)
        return [False] * len(items)
    tier._ok()
    with tier._lock:
        tier.stats.get_seconds += time.perf_counter() - t0
        for (key, _, _, segments), ok in zip(items, got):
            if ok is True:
                tier.stats.hits += 1
                tier.stats.hit_bytes += sum(len(s) for s in segments)
                tier.ledger.access([key])
    return got


def _promote_later(hierarchy: StorageHierarchy, found_at: int, key: str) -> None:
    """Promote ``key`` from tier ``found_at`` into the tiers above, on that tier's I/O
    threads: a second read of its file (from the page cache) into pool memory."""
    backend = hierarchy.tiers[found_at].backend
    pool = getattr(backend, "_io_pool", None)
    if pool is None:
        return

    def promote() -> None:
        if hierarchy._closed:
            return
        try:  # the backend's read: the tier counted this hit already
            obj = backend.get_one(key)
        except Exception:  # a failing tier: the next request's read notices it
            log.debug("reading %s again to promote it failed", key, exc_info=True)
            return
        if obj is None:  # evicted or removed meanwhile
            return
        try:
            obj = hierarchy._promote(key, obj, found_at)
        except Exception:  # the read was served; a promotion that fails costs a later hit only
            log.debug("promoting %s after a direct read failed", key, exc_info=True)
        finally:
            obj.unref()

    try:
        pool().submit(promote)
    except RuntimeError:  # the pool is shut down: the engine is closing
        pass


def into_out(out: Any, chunks: Sequence[Any], spec: Any) -> tuple[Direct, dict[int, MemoryObj]] | None:
    """What :func:`fetch_direct` needs to read chunks into ``out`` (a CPU tensor of
    ``(layers, 2, tokens, heads, head_size)`` whose last three dims are contiguous, as an
    engine's KV buffer is): the ``direct`` callable, and the objects it made (by chunk
    index), which stand for ``out``'s slices; ``None`` when ``out`` is laid out otherwise."""
    import torch

    if out.device.type != "cpu" or out.dim() != 5 or out.requires_grad:
        return None
    _, _, _, heads, size = out.shape
    if out.stride(4) != 1 or out.stride(3) != size or out.stride(2) != heads * size:
        return None
    inference = out.is_inference()
    with torch.inference_mode(inference):
        arr = out.view(torch.uint8).numpy()
    made: dict[int, MemoryObj] = {}

    def direct(j: int) -> tuple[Sequence[int], str, Sequence[memoryview], MemoryObj]:
        c = chunks[j]
        shape = spec.chunk_shape(c.num_tokens)
        with torch.inference_mode(inference):
            region = out[:, :, c.start : c.end]
        made[j] = MemoryObj(None, 0, 0, shape, out.dtype, region)
        return shape, spec.dtype, segments_of(arr, c.start, c.end), made[j]

    return direct, made


def segments_of(arr: Any, start: int, end: int) -> list[memoryview]:
    """The ``(layer, k/v)`` byte segments of tokens ``start:end`` of ``arr`` (a uint8
    numpy view of a ``(layers, 2, tokens, heads, head_size * itemsize)`` tensor whose
    last three dims are contiguous), in the order of a chunk's body."""
    return [memoryview(arr[layer, kv, start:end]).cast("B")
            for layer in range(arr.shape[0]) for kv in range(arr.shape[1])]


__all__ = ["Direct", "fetch_direct", "into_out", "segments_of"]
