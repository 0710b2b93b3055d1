"""The torch reference implementation of gather/scatter: vectorized, any device, any dtype.

This is the path used on CPU (and on GPUs without Triton). It works on the
:meth:`KVLayout.canonical` view of each layer, ``(num_kv, num_blocks, block_size, heads,
dim)``. When a block's stride is a multiple of the offset stride (every built-in layout,
and most views of them) blocks and offsets fold into one strided "row" axis and a single
``index_select`` / ``index_copy_`` moves all tokens of a layer; otherwise it indexes block
and offset together with advanced indexing. There is one Python iteration per layer and
none per token.

Arguments arrive validated by :mod:`lmcache.kernels.ops`: ``layers`` are per-layer
tensors of ``layout``, ``chunk`` is ``(L, num_kv, T, heads, dim)``, ``slots`` is a 1-D
int64 tensor of length ``T`` on the same device, and negative slots are padding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .layouts import KVLayout


class _Tokens:
    """Which chunk tokens move (``tok``: ``None`` means all of ``skip:``) and their slots."""

    __slots__ = ("tok", "slots", "skip", "_rows")

    def __init__(self, slots: torch.Tensor, skip: int):
        sub = slots[skip:]
        valid = sub >= 0
        if bool(valid.all()):
            self.tok: torch.Tensor | None = None
            self.slots = sub
        else:
            self.tok = valid.nonzero().squeeze(1) + skip
            self.slots = sub[valid]
        self.skip = skip
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return int(self.slots.numel())

    def split(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets in block) of the moving slots."""
        return torch.div(self.slots, block_size, rounding_mode="floor"), self.slots % block_size

    def rows(self, block_size: int, ratio: int) -> torch.Tensor:
        """Row ``block * ratio + offset`` of each moving slot (cached per geometry)."""
        key = (block_size, ratio)
        r = self._rows.get(key)
        if r is None:
            if ratio == block_size:
                r = self.slots
            else:
                blk, off = self.split(block_size)
                r = blk * ratio + off
            self._rows[key] = r
        return r


_WIDE = (torch.int64, torch.int32, torch.int16, torch.int8)
_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of its width (same strides): copies become bit-exact
    for every dtype, NaN payloads and float8 included, and every index op supports them."""
    wide = _SAME_WIDTH.get(t.element_size())
    return t if wide is None or t.dtype == wide else t.view(wide)


def _row_view(canon: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``canon`` as ``(num_kv, rows, heads, dim)`` and the rows per block, or ``None``.

    When a block's stride is a whole number ``ratio`` of offset strides, slot ``s`` is row
    ``(s // block_size) * ratio + s % block_size`` of one strided view whose row stride is
    the offset stride, so one ``index_select`` / ``index_copy_`` moves every token. The
    view may alias (rows of K and V interleave in block-major layouts); only rows of real
    slots are ever touched. ``ratio == block_size`` is the plain reshape.
    """
    kv, nb, bs, h, d = canon.shape
    s_kv, s_nb, s_bs, s_h, s_d = canon.stride()
    if nb == 1:
        step, ratio = s_bs, bs  # rows are the offsets
    elif bs == 1:
        step, ratio = s_nb, 1  # rows are the blocks
    elif s_bs > 0 and s_nb % s_bs == 0:
        step, ratio = s_bs, s_nb // s_bs
    else:
        return None
    num_rows = (nb - 1) * ratio + bs
    sizes = (kv, num_rows, h, d)
    strides = tuple(0 if n == 1 else st for n, st in zip(sizes, (s_kv, step, s_h, s_d)))
    return canon.as_strided(sizes, strides, canon.storage_offset()), ratio


def _widen(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` reinterpreted as the widest integers both allow (same bytes).

    Index kernels move one element per step, so moving 8-byte words instead of 2-byte
    halves is several times faster; reinterpreting also makes the copy bit-exact by
    construction. Falls back to the tensors themselves.
    """
    a = _unit_strides(a)
    b = _unit_strides(b)
    size = a.element_size()
    for wide in _WIDE:
        width = torch.empty((), dtype=wide).element_size()
        if width < size or width % size:
            continue
        try:
            return a.view(wide), b.view(wide)
        except RuntimeError:
            continue
    return a, b


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of its length-1 axes set to 0 (they are never stepped)."""
    if all(n != 1 or st == 0 for n, st in zip(t.shape, t.stride())):
        return t
    return t.as_strided(t.shape, tuple(0 if n == 1 else st for n, st in zip(t.shape, t.stride())), t.storage_offset())


def gather(
    layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, skip: int
) -> None:
    toks = _Tokens(slots, skip)
    if not len(toks):
        return
    chunk = _as_bits(chunk)
    for i, layer in enumerate(layers):
        canon = layout.canonical(_as_bits(layer))
        dst = chunk[i]  # (num_kv, T, heads, dim)
        rv = _row_view(canon)
        if rv is None:  # advanced indexing on (block, offset)
            blk, off = toks.split(canon.shape[2])
            values = canon[:, blk, off]
            if toks.tok is None:
                dst[:, skip:].copy_(values)
            else:
                dst.index_copy_(1, toks.tok, values)
            continue
        view, ratio = rv
        rows = toks.rows(canon.shape[2], ratio)
        if toks.tok is None:
            src, out = _widen(view, dst[:, skip:])
            # (rows, kv, h, d) -> (n, kv, h, d): index_select along dim 0 copies whole rows
            torch.index_select(src.transpose(0, 1), 0, rows, out=out.transpose(0, 1))
        else:
            src, out = _widen(view, dst)
            out.transpose(0, 1).index_copy_(0, toks.tok, src.transpose(0, 1).index_select(0, rows))


def scatter(
    layout: KVLayout, layers: Sequence[torch.Tensor], slots: torch.Tensor, chunk: torch.Tensor, skip: int
) -> None:
    toks = _Tokens(slots, skip)
    if not len(toks):
        return
    chunk = _as_bits(chunk)
    for i, layer in enumerate(layers):
        canon = layout.canonical(_as_bits(layer))
        src = chunk[i][:, skip:] if toks.tok is None else chunk[i].index_select(1, toks.tok)
        rv = _row_view(canon)
        if rv is None:
            blk, off = toks.split(canon.shape[2])
            canon[:, blk, off] = src
            continue
        view, ratio = rv
        dst, values = _widen(view, src)
        dst.transpose(0, 1).index_copy_(0, toks.rows(canon.shape[2], ratio), values.transpose(0, 1))
