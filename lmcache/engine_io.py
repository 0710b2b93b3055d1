"""What goes into and comes out of a :class:`lmcache.CacheEngine`: the KV a store is
given (one tensor, or one ``(key, value)`` pair per layer, any strides), the results of a
store and a retrieve, and a layer-wise retrieve in progress."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .config import KVSpec
from .dtypes import dtype_from_name, dtype_name
from .errors import KVShapeError
from .keys import Chunk

_log = logging.getLogger("lmcache.engine")


#: numpy integer types of each element size: a copy moves bits, whatever the dtype
#: (numpy has no bfloat16)
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def copy_off_main(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a copy made on an I/O thread while others copy too: between
    CPU tensors of one shape and dtype it is one numpy copy of their bits, single-threaded
    with the GIL released, instead of a torch copy that asks torch's intra-op threads for
    help from every I/O thread at once (more threads than cores: each chunk's copy then
    waits for a busy one; docs/benchmarks.md#measurements-behind-the-code)."""
    width = _BITS.get(src.element_size())
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape
            or width is None or dst.requires_grad):
        dst.copy_(src)
        return
    import numpy as np

    bits = getattr(torch, width)
    np.copyto(dst.view(bits).numpy(), src.detach().view(bits).numpy(), casting="no")


@dataclass
class RetrieveResult:
    """What :meth:`CacheEngine.retrieve` found.

    ``kv`` holds the first ``num_tokens`` tokens' KV (or is ``None`` on a total miss
    when no ``out`` was given); ``tiers`` names, per retrieved chunk, the tier it came
    from.
    """

    num_tokens: int
    kv: torch.Tensor | None
    tiers: list[str] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class StoreResult:
    stored_tokens: int  # tokens in chunks newly written
    skipped_tokens: int  # tokens in chunks already cached
    dropped_tokens: int  # tokens not stored (no memory)


def _check_out_dtype(out: torch.Tensor, spec: KVSpec) -> None:
    want = dtype_from_name(spec.dtype)
    if out.dtype != want:
        raise KVShapeError(
            f"out is {dtype_name(out.dtype)} but this engine's KV is {spec.dtype} ({spec.signature}); "
            f"pass an out of dtype {spec.dtype} (KV is never converted on the way out)"
        )


def _check_out(out: torch.Tensor, n: int, spec: KVSpec) -> None:
    if out.dim() != 5 or out.shape[2] < n or tuple(out.shape[:2]) + tuple(out.shape[3:]) != (
        spec.num_layers, 2, spec.num_kv_heads, spec.head_size
    ):
        raise KVShapeError(f"out of shape {tuple(out.shape)} cannot hold {n} tokens of {spec.signature}")


class LayerwiseRetrieval:
    """A retrieve in progress: layers land in ``out`` in order (see
    :meth:`CacheEngine.retrieve_layerwise`)."""

    def __init__(self, got: list, num_tokens: int, out: torch.Tensor, num_layers: int,
                 on_done: Callable[[], None] | None, timeout: float):
        self.num_tokens = num_tokens
        self.kv = out
        self.tiers = [t.name for _, _, t in got]
        self.chunks = [c for c, _, _ in got]
        self.timeout = timeout
        self._got = got
        self._on_done = on_done
        self._error: BaseException | None = None
        self._events = [threading.Event() for _ in range(num_layers)]
        if got:
            self._thread = threading.Thread(target=self._run, name="lmcache-layerwise", daemon=True)
            self._thread.start()
        else:
            for e in self._events:
                e.set()
            if on_done:
                on_done()

    def _run(self) -> None:
        try:
            # a buffer made under inference_mode may only be written under it
            with torch.inference_mode(self.kv is not None and self.kv.is_inference()):
                self._copy_layers()
        except BaseException as exc:  # reported to whoever waits
            self._error = exc
        finally:
            for _, obj, _ in self._got:
                obj.unref()
            self._got = []
            if self._on_done:
                self._on_done()
            for e in self._events:
                e.set()

    def _copy_layers(self) -> None:
        for layer, ev in enumerate(self._events):
            dst = self.kv[layer]
            for chunk, obj, _ in self._got:
                dst[:, chunk.start : chunk.end].copy_(obj.tensor[layer])
            ev.set()

    def wait(self, layer: int) -> None:
        """Block until layer ``layer`` is in ``kv``."""
        if not self._events[layer].wait(self.timeout):
            raise TimeoutError(f"layer {layer} of a layer-wise retrieve not ready after {self.timeout}s")
        if self._error is not None:
            raise self._error

    def wait_all(self) -> None:
        for i in range(len(self._events)):
            self.wait(i)


class KVGather:
    """KV a store reads where the engine keeps it (a paged cache), chunk by chunk, instead
    of from one tensor: ``fill(start, end, out)`` writes tokens ``[start, end)`` into
    ``out``, a contiguous ``(num_layers, 2, end - start, num_kv_heads, head_size)`` tensor
    of ``dtype`` in the cache's memory pool. So a store copies each chunk once, from the
    engine's memory into the pool, and only the chunks not cached already. ``fill`` runs
    on the storing thread, in chunk order; an exception from it ends the store (the chunk's
    memory is given back, the chunks stored before it stay)."""

    def __init__(self, fill: Callable[[int, int, torch.Tensor], None], *, num_tokens: int, num_layers: int,
                 num_kv_heads: int, head_size: int, dtype: torch.dtype):
        self.fill = fill
        self.num_tokens, self.num_layers, self.num_kv_heads, self.head_size = num_tokens, num_layers, num_kv_heads, head_size
        self.dtype = dtype


class _KV:
    """A KV source: a 5-D tensor, per-layer (key, value) pairs of (T, H, D), or a
    :class:`KVGather`."""

    def __init__(self, tensor: torch.Tensor | None, layers: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 gather: KVGather | None = None):
        self.tensor = tensor
        self.layers = layers
        self.gather = gather
        if gather is not None:
            self.num_layers, self.num_tokens = gather.num_layers, gather.num_tokens
            self.num_kv_heads, self.head_size, self.dtype = gather.num_kv_heads, gather.head_size, gather.dtype
        elif tensor is not None:
            self.num_layers, _, self.num_tokens, self.num_kv_heads, self.head_size = tensor.shape
            self.dtype = tensor.dtype
        else:
            assert layers
            k0 = layers[0][0]
            self.num_layers = len(layers)
            self.num_tokens, self.num_kv_heads, self.head_size = k0.shape
            self.dtype = k0.dtype

    @classmethod
    def wrap(cls, kv: Any) -> _KV:
        if isinstance(kv, KVGather):
            return cls(None, None, kv)
        if isinstance(kv, torch.Tensor):
            if kv.dim() != 5 or kv.shape[1] != 2:
                raise KVShapeError(
                    f"kv must have shape (num_layers, 2, num_tokens, num_kv_heads, head_size), got {tuple(kv.shape)}"
                )
            return cls(kv, None)
        layers = list(kv)
        if not layers:
            raise KVShapeError("kv has no layers")
        shape = dtype = None
        for i, pair in enumerate(layers):
            if len(pair) != 2:
                raise KVShapeError(f"layer {i}: expected a (key, value) pair")
            for t in pair:
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    raise KVShapeError(f"layer {i}: key and value must be (num_tokens, heads, head_size) tensors")
                shape = shape or tuple(t.shape)
                dtype = dtype or t.dtype
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise KVShapeError(f"layer {i}: {tuple(t.shape)} {t.dtype} differs from layer 0's {shape} {dtype}")
        return cls(None, [tuple(p) for p in layers])  # type: ignore[misc]

    def copy_chunk(self, start: int, end: int, out: torch.Tensor) -> None:
        if self.gather is not None:
            self.gather.fill(start, end, out)
            return
        if self.tensor is not None:
            out.copy_(self.tensor[:, :, start:end])
            return
        for i, (k, v) in enumerate(self.layers):  # type: ignore[union-attr]
            out[i, 0].copy_(k[start:end])
            out[i, 1].copy_(v[start:end])

    def spec(self) -> KVSpec:
        return KVSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                      dtype=dtype_name(self.dtype))

    def check_matches(self, spec: KVSpec) -> None:
        got = (self.num_layers, self.num_kv_heads, self.head_size, dtype_name(self.dtype))
        if got != (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype):
            raise KVShapeError(
                f"kv of {self.num_layers} layers x (T, {self.num_kv_heads}, {self.head_size}) {dtype_name(self.dtype)} "
                f"does not match this engine's kv_spec ({spec.num_layers}, 2, T, {spec.num_kv_heads}, "
                f"{spec.head_size}) {spec.dtype}"
            )


def _default_instance_id() -> str:
    import socket
    import uuid

    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname()) or "host"
    return f"{host.lstrip('._-') or 'host'}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _fits(out: torch.Tensor, n: int, spec: KVSpec) -> bool:
    try:
        _check_out(out, n, spec)
    except KVShapeError:
        return False
    return True


def _length(tokens: Any) -> int:
    return len(tokens) if not hasattr(tokens, "shape") else int(tokens.shape[0])


def spec_in_tiers(tiers: Any, namespace: str, model: str) -> KVSpec | None:
    """The kv spec of ``namespace`` and ``model``'s entries in ``tiers`` if they hold
    exactly one; ``KVShapeError`` saying to set ``kv_spec`` if they hold several; ``None``
    if none (or its signature is not one this version reads)."""
    from .errors import LMCacheError
    from .keys import CacheKey

    found: set[str] = set()
    for tier in tiers:
        for key, _ in tier.keys():
            try:
                k = CacheKey.parse(key)
            except ValueError:
                continue
            if k.namespace == namespace and k.model == model:
                found.add(k.signature)
        if len(found) > 1:
            raise KVShapeError(
                f"this engine has no kv_spec and its tiers hold KV of several shapes for namespace "
                f"{namespace!r}, model {model!r} ({', '.join(sorted(found)[:4])}); "
                f"set kv_spec in the config (or store once) to say which"
            )
    if not found:
        return None
    try:
        return KVSpec.from_signature(found.pop())
    except (ValueError, LMCacheError):
        return None


def store_chunks(hierarchy: Any, src: _KV, spec: KVSpec, chunks: list[Chunk], keys: list[str],
                 present: list[bool], pool: Any, in_flight: int) -> StoreResult:
    """Copy each chunk not ``present`` out of ``src`` into pool memory and put it into the
    hierarchy: on ``pool``'s threads when given (at most ``in_flight`` puts held), and
    inside ``hierarchy.storing()``, so the lower tiers' writes wait until the copies are
    done. A chunk the memory pool cannot take is dropped, not waited for forever."""
    stored = skipped = dropped = 0
    dtype = dtype_from_name(spec.dtype)
    todo = sum(1 for here in present if not here)
    pending: list[Any] = []

    def put(key: str, obj: Any) -> None:
        try:
            hierarchy.put_one(key, obj)
        finally:
            obj.unref()

    storing = hierarchy.storing() if todo and len(hierarchy.tiers) > 1 else contextlib.nullcontext()
    with storing:
        try:
            for chunk, key, here in zip(chunks, keys, present):
                if here:
                    skipped += chunk.num_tokens
                    continue
                obj = hierarchy.allocate(spec.chunk_shape(chunk.num_tokens), dtype)
                if obj is None and pending:  # wait for the writes in flight to give memory back
                    for f in pending:
                        f.result()
                    pending.clear()
                    obj = hierarchy.allocate(spec.chunk_shape(chunk.num_tokens), dtype)
                if obj is None:
                    dropped += chunk.num_tokens
                    _log.debug("memory pool exhausted: not storing chunk %s", key)
                    continue
                try:
                    src.copy_chunk(chunk.start, chunk.end, obj.tensor)
                except BaseException:
                    obj.unref()
                    raise
                if pool is not None:
                    pending.append(pool.submit(put, key, obj))
                    if len(pending) >= in_flight:
                        pending.pop(0).result()
                else:
                    put(key, obj)
                stored += chunk.num_tokens
        finally:
            for f in pending:  # the store returns when every chunk is in the top tier
                f.result()
    return StoreResult(stored, skipped, dropped)
