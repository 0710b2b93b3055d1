"""Whole-block entries for vLLM's CPU attention backend.

vLLM's CPU attention (``vec`` kernels) keeps, per block and head, the block's keys
transposed (``[head_size, block_size]``) and then its values (``[block_size, head_size]``)
in one ``[num_blocks, heads, block_size, 2 * head_size]`` tensor per layer. Moving such a
block per token (each key element to its own place) ran at a fraction of ``memcpy``
(docs/benchmarks.md#measurements-behind-the-code). So, when the chunk size is a whole number of blocks, a chunk's entry
holds each of its full blocks as the backend lays it out, per layer, and only a last
partial block (the prompt's unfull last chunk) per token; a load or a save is then one
contiguous copy per block and layer.

Such entries are not per-token KV, so they are keyed apart: the KV signature's layout is
``vllmcpu_vec_b<block_size>`` (:func:`block_entries_layout`), shared only by vLLM CPU
engines with the same kernels and block size, never read by another engine, by shifted
reuse or by a layer-wise load. The backend's other kernels (``vec16``, ``amx``, ...) pack
their blocks otherwise; their entries are keyed apart too (``vllmcpu_<isa>_rows_b<N>``)
and hold whole blocks only.

One entry of ``T`` tokens (``f = T // N`` full blocks of ``N`` tokens, ``r = T - f * N``
left) is, per layer, the ``2 * T * H * D`` elements of the engine's ``(L, 2, T, H, D)``
chunk shape: the ``f`` blocks whole (``H * N * 2D`` elements each, the backend's bytes),
then the ``r`` tokens as ``(2, r, H, D)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmcache import kernels as K

from .layout import VLLM_CPU_VEC, _slots

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from lmcache.config import Config

    from .metadata import SaveSpec

log = logging.getLogger(__name__)

__all__ = ["COPY_THREADS", "ROWS", "BlockEntries", "block_entries_layout", "packed_rows", "savable"]

#: threads copying the blocks of one chunk (at most torch's own thread count)
COPY_THREADS = 2


def _cpu_list(text: str) -> set[int]:
    """``0-3,6`` as ``{0, 1, 2, 3, 6}``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out


def _spare_cpus() -> set[int]:
    """The CPUs this process's threads run on together, less the calling thread's own when
    others are left. vLLM's CPU worker binds each of its OpenMP threads, the main one
    included, to one core; a thread started from the main thread would inherit that one
    core and copy on it by turns with the main thread (no faster than one thread), so the copy threads go to the worker's other cores."""
    cpus: set[int] = set()
    try:
        for status in Path("/proc/self/task").glob("*/status"):
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cpus |= _cpu_list(line.split(":", 1)[1])
            except (OSError, ValueError):  # a thread gone meanwhile
                continue
        own = os.sched_getaffinity(0)
    except (OSError, AttributeError):  # not Linux
        return set()
    return (cpus - own) or cpus


def _run_on(cpus: set[int]) -> None:
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.debug("lmcache: copy thread stays on its CPUs (%s)", exc)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A 2-D contiguous tensor's rows as a numpy byte array (the same memory)."""
    return t.view(torch.uint8).numpy()


def block_entries_layout(vllm_config: VllmConfig, block_size: int, head_size: int, config: Config,
                         is_mla: bool) -> str | None:
    """The KV signature's layout name of this worker's entries when they are not
    per-token KV, else ``None`` (per-token entries, layout ``lt2hd``):

    - ``vllmcpu_vec_b<N>``: whole blocks of vLLM's CPU ``vec`` kernels (:class:`BlockEntries`),
      where a chunk is a whole number of blocks, loads are bulk (not ``vllm.layerwise``),
      reuse is exact (``approximate_reuse`` moves per-token keys) and ``vllm.entries`` is
      not ``tokens``;
    - ``vllmcpu_<isa>_rows_b<N>``: any other kernels of vLLM's CPU backend (``vec16``,
      ``amx``, ``neon``, or kernels this vLLM does not name: ``unknown``). They pack a
      block in an order of their own (``vec16`` puts 5 tokens' keys in rows 0-10 of the
      block), so the rows of the ``[B, H, N, 2D]`` view hold a block's bytes only as a
      whole: such entries hold whole blocks only (:func:`packed_rows`), and only an engine
      with the same kernels and block size may read them, whatever ``vllm.entries`` says.

    Decided from the configuration alone, before any tensor is seen, so that every
    worker of a kind decides alike."""
    if is_mla or block_size <= 0:
        return None
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
    except Exception:  # no vLLM platform: not its CPU backend
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = str(_get_attn_isa(vllm_config.model_config.dtype, block_size, head_size,
                                getattr(vllm_config.cache_config, "cache_dtype", None)))
    except Exception:  # another vLLM: kernels of unknown packing, never read per token
        isa = "unknown"
    if isa != "vec":
        return f"vllmcpu_{re.sub(r'[^A-Za-z0-9]', '', isa) or 'unknown'}{ROWS}b{block_size}"
    if config.vllm.entries == "tokens" or config.vllm.layerwise or config.approximate_reuse.enabled:
        return None
    if config.chunk_size % block_size:
        return None
    return f"vllmcpu_vec_b{block_size}"


#: in a layout name: entries of packed CPU kernels' block rows (:func:`block_entries_layout`)
ROWS = "_rows_"


def packed_rows(layout: str) -> bool:
    """Whether entries of this KV layout hold rows of packed CPU kernels' blocks: whole
    blocks only, stored and loaded as such."""
    return layout.startswith("vllmcpu_") and ROWS in layout


def savable(spec: SaveSpec, layout: str, block_size: int) -> SaveSpec | None:
    """``spec`` as the worker may store it under ``layout``: for packed CPU kernels' rows
    (:func:`packed_rows`) cut to its whole blocks (``None`` if it has none: a partial
    block's first rows do not hold its tokens), else as it is. vLLM loads whole blocks
    only (the scheduler rounds a hit down), so nothing stored is then left unread."""
    if not packed_rows(layout):
        return spec
    n = len(spec.token_ids) // block_size * block_size
    if n == len(spec.token_ids):
        return spec
    return dataclasses.replace(spec, token_ids=spec.token_ids[:n], skip=min(spec.skip, n), prompt=None) if n else None


class BlockEntries:
    """Loads and saves of whole-block entries (see the module doc) for one worker's layers.

    ``tensors``: the backend's per-layer ``[B, H, N, 2D]`` tensors (contiguous); ``views``:
    the two :data:`~.layout.VLLM_CPU_VEC` views (keys, values) of each, for the tokens of a
    partial block."""

    def __init__(self, tensors: list[torch.Tensor], views: list[torch.Tensor], block_size: int) -> None:
        if not tensors or any(not t.is_contiguous() or t.dim() != 4 for t in tensors):
            raise ValueError("lmcache: whole-block entries need contiguous [B, H, N, 2D] layer tensors")
        B, H, N, D2 = tensors[0].shape
        if N != block_size or D2 % 2:
            raise ValueError(f"lmcache: layer tensor {tuple(tensors[0].shape)} does not hold blocks of {block_size}")
        self.rows = [t.view(B, -1) for t in tensors]  # one row per block: its bytes as the kernels keep them
        # the same rows as bytes, for numpy's copies: single-threaded, GIL released, bounds-checked
        self._byte_rows = [_bytes(r) for r in self.rows]
        self.views = views
        self.N, self.H, self.D = N, H, D2 // 2
        self.E = H * N * D2  # elements of one block of one layer
        #: layers split among this many threads per chunk (two copy faster than one: docs/benchmarks.md#measurements-behind-the-code)
        self.threads = max(1, min(COPY_THREADS, torch.get_num_threads()))
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _copy(self, pairs: list[tuple[int, int]], regions: torch.Tensor, to_blocks: bool,
              wait: bool = True) -> list[Future]:
        """Copy whole blocks, every layer: ``(block of the entry, block id)`` of ``pairs``
        between ``regions`` (the entry, ``(L, elements)``) and the layers' rows. This
        thread copies its share of the layers; with ``wait=False`` the other threads'
        shares may still run when this returns: their futures (one handoff per request,
        not per chunk: docs/benchmarks.md#measurements-behind-the-code)."""
        if not pairs:
            return []
        src = _bytes(regions)
        eb = self.E * regions.element_size()

        def run(layers: range) -> None:
            for i in layers:
                rows, reg = self._byte_rows[i], src[i]
                for j, bid in pairs:
                    if to_blocks:
                        np.copyto(rows[bid], reg[j * eb : (j + 1) * eb])
                    else:
                        np.copyto(reg[j * eb : (j + 1) * eb], rows[bid])

        L = len(self.rows)
        if self.threads == 1:
            run(range(L))
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="lmcache-vllm-blocks",
                                            initargs=(_spare_cpus(),), initializer=_run_on)
        parts = [range(k, L, self.threads) for k in range(self.threads)]
        futures = [self._pool.submit(run, part) for part in parts[1:]]
        try:
            run(parts[0])
        except BaseException:
            futures_wait(futures)  # none may go on reading past this error
            raise
        if not wait:
            return futures
        for f in futures:
            f.result()
        return []

    def _tail(self, region: torch.Tensor, f: int, r: int) -> torch.Tensor:
        """The ``(2, r, H, D)`` per-token part of one layer's region of an entry."""
        return region[f * self.E : f * self.E + 2 * r * self.H * self.D].view(2, r, self.H, self.D)

    def load(self, kv: torch.Tensor, start: int, block_ids: list[int], lo: int, hi: int) -> list[Future]:
        """Put one entry's tokens ``[lo, hi)`` (absolute positions; the entry's first is
        ``start``) into the request's blocks ``block_ids``. A whole block inside the range
        is one copy per layer; the tokens of a block cut by ``lo`` or ``hi``, per token.
        Returns the copies left running on other threads (``kv`` is read until they end)."""
        L = len(self.rows)
        T = kv.shape[2]
        f, r = divmod(T, self.N)
        regions = kv.reshape(L, -1)
        whole: list[tuple[int, int]] = []  # (block of the entry, block id)
        cut: list[tuple[int, int]] = []  # token ranges loaded per token
        for j in range(f + (1 if r else 0)):
            a, b = start + j * self.N, start + min((j + 1) * self.N, T)
            a2, b2 = max(a, lo), min(b, hi)
            if a2 >= b2:
                continue
            if j < f and (a2, b2) == (a, b):
                whole.append((j, block_ids[a // self.N]))
            else:
                cut.append((a2, b2))
        running = self._copy(whole, regions, to_blocks=True, wait=False)
        try:
            for a, b in cut:
                slots = _slots(block_ids, self.N, b)[a:]
                j = (a - start) // self.N
                for i, region in enumerate(regions):
                    if j < f:  # part of a whole block of the entry: its tokens read through the views
                        tokens = self._block_tokens(region, j)[:, a - start - j * self.N : b - start - j * self.N]
                    else:
                        tokens = self._tail(region, f, r)[:, a - start - f * self.N : b - start - f * self.N]
                    K.scatter_layer(tokens[0:1], VLLM_CPU_VEC, slots, self.views[2 * i])
                    K.scatter_layer(tokens[1:2], VLLM_CPU_VEC, slots, self.views[2 * i + 1])
        except BaseException:
            futures_wait(running)  # nothing may read kv once the caller has it back
            raise
        return running

    def _block_tokens(self, region: torch.Tensor, j: int) -> torch.Tensor:
        """Block ``j`` of one layer's region as ``(2, N, H, D)`` per-token KV."""
        blk = region[j * self.E : (j + 1) * self.E].view(self.H, 2, self.N * self.D)
        keys = blk[:, 0].view(self.H, self.D, self.N).permute(2, 0, 1)
        values = blk[:, 1].view(self.H, self.N, self.D).permute(1, 0, 2)
        return torch.stack((keys, values))

    def save(self, out: torch.Tensor, start: int, end: int, block_ids: list[int]) -> None:
        """Write tokens ``[start, end)`` of a request owning ``block_ids`` into ``out`` (one
        entry, contiguous, ``(L, 2, end - start, H, D)`` elements); ``start`` is a block
        boundary (chunks are whole numbers of blocks)."""
        L = len(self.rows)
        f, r = divmod(end - start, self.N)
        regions = out.view(L, -1)
        first = start // self.N
        self._copy([(j, block_ids[first + j]) for j in range(f)], regions, to_blocks=False)
        if r:
            a = start + f * self.N
            slots = _slots(block_ids, self.N, end)[a:]
            for i, region in enumerate(regions):
                tail = self._tail(region, f, r)
                K.gather_layer(self.views[2 * i], VLLM_CPU_VEC, slots, tail[0:1])
                K.gather_layer(self.views[2 * i + 1], VLLM_CPU_VEC, slots, tail[1:2])
