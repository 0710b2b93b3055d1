"""Public gather/scatter entry points: validate, then run the torch reference or Triton.

``gather`` copies tokens from an engine's paged KV memory into a contiguous chunk buffer;
``scatter`` copies a chunk buffer back into paged memory. Both go through a slot mapping
(``slot = block_id * block_size + offset``, one slot per chunk token) and leave the first
``skip`` tokens alone. ``*_layer`` variants move one layer.

Negative slots are padding (vLLM pads slot mappings with -1): their tokens are skipped in
both directions, exactly like vLLM's own ``reshape_and_cache`` kernels do. Gather leaves
their rows of the chunk buffer untouched; scatter writes nothing for them.

Backend: ``backend=None`` picks Triton when the tensors are on a CUDA (or ROCm) device
and ``triton`` imports, else the torch reference. ``"torch"`` or ``"triton"`` force one;
Triton on CPU tensors works only in interpreter mode (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests check it.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Sequence, Union

import torch

from lmcache.errors import KVShapeError

from . import reference
from .layouts import KVLayout, get_layout

log = logging.getLogger(__name__)

__all__ = [
    "SlotMappingError",
    "gather",
    "scatter",
    "gather_layer",
    "scatter_layer",
    "chunk_shape",
    "num_slots",
    "triton_available",
    "select_backend",
]

PagedLayers = Union[torch.Tensor, Sequence[torch.Tensor]]
BACKENDS = ("torch", "triton")


class SlotMappingError(KVShapeError):
    """The slot mapping is malformed, out of range, or (for scatter) repeats a slot."""


# --------------------------------------------------------------------------- backends
@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works (imported on first call only)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        log.debug("triton is not usable: %s", exc)
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that runs for tensors on ``device`` (``backend`` forces one)."""
    if backend is None:
        return "triton" if device.type == "cuda" and not _triton_broken and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "triton":
        if not triton_available():
            raise ImportError("the triton backend needs the 'triton' package: pip install triton")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(
                f"the triton backend needs CUDA tensors, got {device.type} tensors; on CPU it runs only "
                "in interpreter mode (set TRITON_INTERPRET=1 before triton is imported)"
            )
    return backend


_triton_broken = False


def _run(op: str, backend: str | None, device: torch.device, *args: object) -> None:
    global _triton_broken
    chosen = select_backend(device, backend)
    with torch.no_grad():
        if chosen == "triton":
            from . import triton_kernels

            try:
                getattr(triton_kernels, op)(*args)
                return
            except Exception:
                if backend is not None:
                    raise
                # automatic choice: never fail a copy that torch can do; say so once
                _triton_broken = True
                log.warning("triton %s kernel failed; using the torch reference from now on", op, exc_info=True)
        getattr(reference, op)(*args)


# --------------------------------------------------------------------------- validation
def _as_layers(paged_layers: PagedLayers, layout: KVLayout) -> list[torch.Tensor]:
    if isinstance(paged_layers, torch.Tensor):
        if paged_layers.dim() == layout.ndim + 1:
            if paged_layers.shape[0] == 0:
                raise KVShapeError(f"paged_layers has shape {tuple(paged_layers.shape)}: no layers")
            layers = list(paged_layers.unbind(0))
        elif paged_layers.dim() == layout.ndim:
            raise KVShapeError(
                f"paged_layers has shape {tuple(paged_layers.shape)}, one layer of layout {layout.name!r}; "
                "pass a list of layers, a stacked (num_layers, ...) tensor, or use gather_layer/scatter_layer"
            )
        else:
            raise KVShapeError(
                f"paged_layers has shape {tuple(paged_layers.shape)}; layout {layout.name!r} expects a list "
                f"of {layout.describe_shape()} tensors or one stacked (num_layers, ...) tensor of those"
            )
        what = "paged_layers[{}]"
    elif isinstance(paged_layers, (list, tuple)):
        if not paged_layers:
            raise KVShapeError("paged_layers is empty: no layers to move")
        layers = list(paged_layers)
        what = "paged_layers[{}]"
    else:
        raise KVShapeError(f"paged_layers must be a tensor or a list of tensors, got {type(paged_layers).__name__}")
    first = layers[0]
    layout.check_layer(first, what.format(0))
    for i, t in enumerate(layers[1:], 1):
        layout.check_layer(t, what.format(i))
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise KVShapeError(
                f"{what.format(i)} is {tuple(t.shape)} {t.dtype} on {t.device} but {what.format(0)} is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; all layers must match"
            )
    return layers


def _check_chunk(
    chunk: torch.Tensor, name: str, layers: list[torch.Tensor], layout: KVLayout, num_tokens: int, layerwise: bool
) -> None:
    if not isinstance(chunk, torch.Tensor):
        raise KVShapeError(f"{name} must be a torch.Tensor, got {type(chunk).__name__}")
    ref = layers[0]
    want = layout.chunk_shape(ref, len(layers), num_tokens)
    if layerwise:
        want = want[1:]
    if tuple(chunk.shape) != want:
        form = (
            "(num_kv, num_tokens, heads, head_size)"
            if layerwise
            else "(num_layers, num_kv, num_tokens, heads, head_size)"
        )
        raise KVShapeError(
            f"{name} has shape {tuple(chunk.shape)} but {len(layers)} layer(s) of layout {layout.name!r} "
            f"shaped {tuple(ref.shape)} with {num_tokens} slots in slot_mapping need {want} {form}"
        )
    if chunk.dtype != ref.dtype:
        raise KVShapeError(
            f"{name} has dtype {chunk.dtype} but the paged KV has dtype {ref.dtype}; kernels never convert"
        )
    if chunk.device != ref.device:
        raise KVShapeError(
            f"{name} is on {chunk.device} but the paged KV is on {ref.device}; gather into a buffer on "
            f"{ref.device} and copy it, or copy the chunk there first"
        )


def _slots(slot_mapping: object, device: torch.device) -> torch.Tensor:
    if not isinstance(slot_mapping, torch.Tensor):
        try:
            slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise SlotMappingError(f"slot_mapping must be a 1-D integer tensor: {exc}") from None
    s = slot_mapping
    if s.dim() != 1:
        raise SlotMappingError(f"slot_mapping must be 1-D (one slot per token), got shape {tuple(s.shape)}")
    if s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool:
        raise SlotMappingError(f"slot_mapping must hold integers, got dtype {s.dtype}")
    return s.to(device=device, dtype=torch.int64)


def _check_skip(skip: object, num_tokens: int) -> int:
    if not isinstance(skip, int) or isinstance(skip, bool):
        raise KVShapeError(f"skip must be an int, got {type(skip).__name__}")
    if not 0 <= skip <= num_tokens:
        raise KVShapeError(f"skip={skip} is outside [0, {num_tokens}] for {num_tokens} tokens")
    return skip


def _check_slots(slots: torch.Tensor, skip: int, capacity: int, layout: KVLayout, unique: bool) -> None:
    sub = slots[skip:]
    if not sub.numel():
        return
    hi = int(sub.max())
    if hi >= capacity:
        bad = int((sub >= capacity).nonzero()[0, 0]) + skip
        raise SlotMappingError(
            f"slot_mapping[{bad}] = {int(slots[bad])} is out of range: layout {layout.name!r} memory holds "
            f"{capacity} slots (0..{capacity - 1}); negative slots are padding"
        )
    if unique:
        valid = sub[sub >= 0]
        if torch.unique(valid).numel() != valid.numel():
            uniq, counts = torch.unique(valid, return_counts=True)
            dup = int(uniq[counts > 1][0])
            raise SlotMappingError(
                f"slot {dup} appears more than once in slot_mapping[{skip}:]; scatter would write it twice "
                "(which copy wins is undefined)"
            )


def _prepare(
    paged: PagedLayers,
    layout: str | KVLayout,
    slot_mapping: object,
    chunk: torch.Tensor,
    skip: int,
    *,
    chunk_name: str,
    layerwise: bool,
    unique: bool,
    check_slots: bool,
) -> tuple[KVLayout, list[torch.Tensor], torch.Tensor, torch.Tensor, int]:
    lay = get_layout(layout)
    if layerwise:
        lay.check_layer(paged, "paged")  # type: ignore[arg-type]
        layers = [paged]  # type: ignore[list-item]
    else:
        layers = _as_layers(paged, lay)
    device = layers[0].device
    slots = _slots(slot_mapping, device)
    num_tokens = int(slots.numel())
    _check_chunk(chunk, chunk_name, layers, lay, num_tokens, layerwise)
    skip = _check_skip(skip, num_tokens)
    if check_slots:
        _check_slots(slots, skip, lay.num_slots(layers[0]), lay, unique)
    return lay, layers, slots, (chunk.unsqueeze(0) if layerwise else chunk), skip


# --------------------------------------------------------------------------- API
def gather(
    paged_layers: PagedLayers,
    layout: str | KVLayout,
    slot_mapping: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    skip: int = 0,
    *,
    backend: str | None = None,
    check_slots: bool = True,
) -> torch.Tensor:
    """Copy the KV of every layer from paged memory into the chunk buffer ``out``.

    ``paged_layers``: a list of per-layer tensors in ``layout``, or one stacked tensor whose
    leading axis is the layer. ``out``: ``(num_layers, num_kv, len(slot_mapping), heads,
    head_size)`` (see :meth:`KVLayout.chunk_shape`). Token ``i >= skip`` with slot
    ``slot_mapping[i] >= 0`` is copied into ``out[:, :, i]``; other rows of ``out`` are not
    touched. ``check_slots=False`` skips the range check (it reads the slots back to the
    host). Returns ``out``.
    """
    lay, layers, slots, chunk, skip = _prepare(
        paged_layers,
        layout,
        slot_mapping,
        out,
        skip,
        chunk_name="out",
        layerwise=False,
        unique=False,
        check_slots=check_slots,
    )
    _run("gather", backend, chunk.device, lay, layers, slots, chunk, skip)
    return out


def scatter(
    chunk: torch.Tensor,
    layout: str | KVLayout,
    slot_mapping: torch.Tensor | Sequence[int],
    paged_layers: PagedLayers,
    skip: int = 0,
    *,
    backend: str | None = None,
    check_slots: bool = True,
) -> None:
    """Copy the chunk buffer ``chunk`` into paged memory, every layer.

    Token ``i >= skip`` with slot ``slot_mapping[i] >= 0`` is written to that slot; nothing
    else in ``paged_layers`` changes. With ``check_slots`` (default) the slots must also be
    distinct, since two tokens writing one slot would race.
    """
    lay, layers, slots, chunk5, skip = _prepare(
        paged_layers,
        layout,
        slot_mapping,
        chunk,
        skip,
        chunk_name="chunk",
        layerwise=False,
        unique=True,
        check_slots=check_slots,
    )
    _run("scatter", backend, chunk5.device, lay, layers, slots, chunk5, skip)


def gather_layer(
    paged: torch.Tensor,
    layout: str | KVLayout,
    slot_mapping: torch.Tensor | Sequence[int],
    out: torch.Tensor,
    skip: int = 0,
    *,
    backend: str | None = None,
    check_slots: bool = True,
) -> torch.Tensor:
    """Like :func:`gather` for one layer: ``paged`` is one layer's tensor and ``out`` one
    layer of the chunk buffer, ``(num_kv, num_tokens, heads, head_size)`` (e.g. ``chunk[i]``)."""
    lay, layers, slots, chunk, skip = _prepare(
        paged, layout, slot_mapping, out, skip, chunk_name="out", layerwise=True, unique=False, check_slots=check_slots
    )
    _run("gather", backend, chunk.device, lay, layers, slots, chunk, skip)
    return out


def scatter_layer(
    chunk: torch.Tensor,
    layout: str | KVLayout,
    slot_mapping: torch.Tensor | Sequence[int],
    paged: torch.Tensor,
    skip: int = 0,
    *,
    backend: str | None = None,
    check_slots: bool = True,
) -> None:
    """Like :func:`scatter` for one layer: ``chunk`` is ``(num_kv, num_tokens, heads,
    head_size)`` (e.g. ``chunk_buffer[i]``) and ``paged`` that layer's tensor."""
    lay, layers, slots, chunk5, skip = _prepare(
        paged,
        layout,
        slot_mapping,
        chunk,
        skip,
        chunk_name="chunk",
        layerwise=True,
        unique=True,
        check_slots=check_slots,
    )
    _run("scatter", backend, chunk5.device, lay, layers, slots, chunk5, skip)


def chunk_shape(paged_layers: PagedLayers, layout: str | KVLayout, num_tokens: int) -> tuple[int, int, int, int, int]:
    """Shape of the chunk buffer for ``num_tokens`` tokens of ``paged_layers``."""
    lay = get_layout(layout)
    layers = _as_layers(paged_layers, lay)
    return lay.chunk_shape(layers[0], len(layers), num_tokens)


def num_slots(paged: torch.Tensor, layout: str | KVLayout) -> int:
    """How many token slots one layer's tensor in ``layout`` holds."""
    lay = get_layout(layout)
    lay.check_layer(paged, "paged")
    return lay.num_slots(paged)
