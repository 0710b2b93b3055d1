"""KV memory layouts: one small object per layout, and a registry of named layouts.

A :class:`KVLayout` says which axis of *one layer's* KV tensor holds what:

- ``block_axis``: the block (page) id; ``None`` for an unpaged tensor, where the slot is
  simply the index along ``offset_axis``;
- ``offset_axis``: the token's position inside its block (the block size is this axis's
  length);
- ``kv_axis``: K (index 0) or V (index 1), length 2; ``None`` when there is one vector per
  token (MLA's latent) rather than a K and a V;
- ``heads_axis``: the KV head; ``None`` when there are no heads (MLA);
- ``dim_axis``: the element within a head (head size, or MLA's latent size).

Every axis of the tensor has exactly one role, so ``ndim`` is the number of roles that
are not ``None``. A token with slot ``s`` lives in block ``s // block_size`` at offset
``s % block_size``. Nothing here assumes contiguity: kernels read the tensor's strides.

The contiguous chunk buffer that kernels gather into and scatter from is always
``(num_layers, num_kv, num_tokens, num_heads, head_size)``, with ``num_kv`` = 2 (K, V) or 1
(no ``kv_axis``) and ``num_heads`` = 1 when there is no ``heads_axis``; MLA's chunk is thus
``(num_layers, 1, num_tokens, 1, latent_size)``.

Adding a layout is adding one object: ``register_layout(KVLayout(...))``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from lmcache.errors import KVShapeError

__all__ = [
    "KVLayout",
    "LAYOUTS",
    "register_layout",
    "get_layout",
    "VLLM_FLASH_ATTN",
    "BLOCKS_FIRST",
    "FLASHINFER_NHD",
    "FLASHINFER_HND",
    "MLA",
    "CONTIGUOUS",
]

_ROLES = ("kv_axis", "block_axis", "offset_axis", "heads_axis", "dim_axis")


@dataclass(frozen=True)
class KVLayout:
    """Where each role lives among the axes of one layer's KV tensor (see module doc)."""

    name: str
    offset_axis: int
    dim_axis: int
    block_axis: int | None = None
    kv_axis: int | None = None
    heads_axis: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"KVLayout name must be a non-empty string, got {self.name!r}")
        axes = {role: getattr(self, role) for role in _ROLES if getattr(self, role) is not None}
        for role, axis in axes.items():
            if not isinstance(axis, int) or isinstance(axis, bool):
                raise ValueError(f"KVLayout {self.name!r}: {role} must be an int or None, got {axis!r}")
        if sorted(axes.values()) != list(range(len(axes))):
            raise ValueError(
                f"KVLayout {self.name!r}: the axes {axes} must be distinct and cover 0..{len(axes) - 1} "
                "(every axis of the tensor has exactly one role)"
            )

    # ------------------------------------------------------------ derived facts
    @property
    def ndim(self) -> int:
        """Number of axes of one layer's tensor."""
        return sum(getattr(self, role) is not None for role in _ROLES)

    @property
    def paged(self) -> bool:
        return self.block_axis is not None

    @property
    def num_kv(self) -> int:
        """Length of the chunk buffer's second axis: 2 (K, V) or 1 (one vector per token)."""
        return 1 if self.kv_axis is None else 2

    def describe_shape(self) -> str:
        """The per-layer shape in words, e.g. ``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
        words = {
            "kv_axis": "2",
            "block_axis": "num_blocks",
            "offset_axis": "block_size" if self.paged else "num_tokens",
            "heads_axis": "num_kv_heads",
            "dim_axis": "latent_size" if self.heads_axis is None else "head_size",
        }
        names = [""] * self.ndim
        for role in _ROLES:
            axis = getattr(self, role)
            if axis is not None:
                names[axis] = words[role]
        return "(" + ", ".join(names) + ")"

    # ------------------------------------------------------------ tensors
    def check_layer(self, t: torch.Tensor, what: str = "kv layer") -> None:
        """Raise :class:`KVShapeError` unless ``t`` can be one layer in this layout."""
        if not isinstance(t, torch.Tensor):
            raise KVShapeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != self.ndim:
            raise KVShapeError(
                f"{what} has shape {tuple(t.shape)} ({t.dim()} axes) but layout {self.name!r} expects "
                f"{self.ndim} axes {self.describe_shape()}"
            )
        if self.kv_axis is not None and t.shape[self.kv_axis] != 2:
            raise KVShapeError(
                f"{what} has shape {tuple(t.shape)}: axis {self.kv_axis} is the K/V axis of layout "
                f"{self.name!r} {self.describe_shape()} and must have length 2"
            )
        if any(s == 0 for s in t.shape):
            raise KVShapeError(f"{what} has shape {tuple(t.shape)} with an empty axis")

    def block_size(self, t: torch.Tensor) -> int:
        return int(t.shape[self.offset_axis])

    def num_slots(self, t: torch.Tensor) -> int:
        """How many token slots one layer's tensor holds (valid slots are ``0 .. num_slots-1``)."""
        n = self.block_size(t)
        return n * int(t.shape[self.block_axis]) if self.block_axis is not None else n

    def num_heads(self, t: torch.Tensor) -> int:
        return 1 if self.heads_axis is None else int(t.shape[self.heads_axis])

    def head_size(self, t: torch.Tensor) -> int:
        return int(t.shape[self.dim_axis])

    def chunk_shape(self, t: torch.Tensor, num_layers: int, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the chunk buffer holding ``num_tokens`` tokens of ``num_layers`` layers like ``t``."""
        return (num_layers, self.num_kv, num_tokens, self.num_heads(t), self.head_size(t))

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """A view (never a copy) of one layer's tensor as ``(num_kv, num_blocks, block_size, heads, dim)``.

        Missing roles become axes of length 1; writing into the view writes into ``t``.
        """
        v = t
        order: list[int] = []
        for role in _ROLES:
            axis = getattr(self, role)
            if axis is None:
                v = v.unsqueeze(-1)  # a new length-1 axis at the end, index v.dim()-1
                order.append(v.dim() - 1)
            else:
                order.append(axis)
        return v.permute(order)


class _Registry(Mapping[str, KVLayout]):
    """Named layouts; a name is registered once (a clash fails, naming both)."""

    def __init__(self) -> None:
        self._layouts: dict[str, KVLayout] = {}
        self._lock = threading.RLock()
        self._from_plugins = False

    def _load_plugins(self) -> None:
        """On first use: every layout the plugins register (``lmcache_register_layouts``,
        the built-ins included), so that nothing is registered at import time."""
        if self._from_plugins:
            return
        with self._lock:
            if self._from_plugins:
                return
            self._from_plugins = True
            from lmcache.plugin_manager import get_registries

            reg = get_registries().layouts
            for name in reg.names():
                layout = reg.load(name)
                if not isinstance(layout, KVLayout) or layout.name != name:
                    raise ValueError(f"layout {name!r} of plugin {reg.entry(name).plugin!r} is not a KVLayout named {name!r}")
                self.add(layout)

    def __getitem__(self, name: str) -> KVLayout:
        self._load_plugins()
        return self._layouts[name]

    def __iter__(self) -> Iterator[str]:
        self._load_plugins()
        return iter(list(self._layouts))

    def __len__(self) -> int:
        self._load_plugins()
        return len(self._layouts)

    def add(self, layout: KVLayout, *, replace: bool = False) -> KVLayout:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"register_layout takes a KVLayout, got {type(layout).__name__}")
        with self._lock:
            old = self._layouts.get(layout.name)
            if old is not None and old != layout and not replace:
                raise ValueError(
                    f"a different layout is already registered as {layout.name!r}: {old!r}; "
                    f"refusing to replace it with {layout!r} (pass replace=True to do so)"
                )
            self._layouts[layout.name] = layout
        return layout

    def remove(self, name: str) -> None:
        with self._lock:
            self._layouts.pop(name, None)

    def __repr__(self) -> str:
        return f"LAYOUTS({', '.join(self._layouts)})"


#: Every named layout (those the plugins register through ``lmcache_register_layouts``, on
#: first use, and those given to :func:`register_layout`); ``get_layout(name)`` looks here.
LAYOUTS = _Registry()


def register_layout(layout: KVLayout, *, replace: bool = False) -> KVLayout:
    """Make ``layout`` available by name. Registering an equal layout again is a no-op."""
    return LAYOUTS.add(layout, replace=replace)


def get_layout(layout: str | KVLayout) -> KVLayout:
    """The layout itself, or the registered layout of that name (``ValueError`` if unknown)."""
    if isinstance(layout, KVLayout):
        return layout
    try:
        return LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV layout {layout!r}; known layouts: {', '.join(sorted(LAYOUTS))}") from None


VLLM_FLASH_ATTN = KVLayout(
    "vllm_flash_attn",
    kv_axis=0, block_axis=1, offset_axis=2, heads_axis=3, dim_axis=4,
    description="vLLM FlashAttention backend, one tensor per layer",
)  # fmt: skip
BLOCKS_FIRST = KVLayout(
    "blocks_first",
    block_axis=0, kv_axis=1, offset_axis=2, heads_axis=3, dim_axis=4,
    description="K and V of a block side by side (vLLM FlashInfer and other block-major backends)",
)  # fmt: skip
FLASHINFER_NHD = KVLayout(
    "flashinfer_nhd",
    block_axis=0, kv_axis=1, offset_axis=2, heads_axis=3, dim_axis=4,
    description='FlashInfer paged KV cache, kv_layout="NHD"',
)  # fmt: skip
FLASHINFER_HND = KVLayout(
    "flashinfer_hnd",
    block_axis=0, kv_axis=1, heads_axis=2, offset_axis=3, dim_axis=4,
    description='FlashInfer paged KV cache, kv_layout="HND"',
)  # fmt: skip
MLA = KVLayout(
    "mla",
    block_axis=0, offset_axis=1, dim_axis=2,
    description="multi-head latent attention: one latent vector per token (chunk: (L, 1, T, 1, latent))",
)  # fmt: skip
CONTIGUOUS = KVLayout(
    "contiguous",
    kv_axis=0, offset_axis=1, heads_axis=2, dim_axis=3,
    description="unpaged per-layer KV; the slot is the token index",
)  # fmt: skip
