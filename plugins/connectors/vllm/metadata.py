"""What crosses from the scheduler side of the vLLM connector to its workers (the connector
metadata vLLM sends with each step: :class:`LMCacheConnectorMetadata` of
:class:`LoadSpec` and :class:`SaveSpec`), and the scheduler's own per-request state
(:class:`_ReqState`, :class:`_Lookup`), which never leaves its process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache.keys import KeyExtra

if TYPE_CHECKING:
    from lmcache.plugins.services.lookup import LookupReply

    from .events import BlockInfo

__all__ = ["LMCacheConnectorMetadata", "LoadSpec", "SaveSpec"]


@dataclass
class LoadSpec:
    """Load ``token_ids[skip:load_end]`` into the request's blocks.

    ``token_ids`` are the tokens the scheduler's lookup hit (ending on a chunk boundary or
    the prompt's end, so their chunk keys match what was stored); ``skip`` tokens are
    already in vLLM's prefix cache; ``load_end`` (block aligned, below the prompt length)
    is how far vLLM was promised KV. ``exact`` of them are the exact prefix hit; with
    ``shifted``, the rest comes from shifted reuse (``approximate_reuse``).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int
    load_end: int
    #: loaded on the worker's I/O thread between steps (reported through ``get_finished``)
    is_async: bool = False
    exact: int = -1
    shifted: bool = False
    #: what besides the tokens keys the request's KV (cache salt, LoRA, images)
    extra: KeyExtra | None = None
    #: vLLM's block hashes of token_ids when vLLM publishes KV events (.events)
    blocks: BlockInfo | None = None

    @property
    def exact_ids(self) -> list[int]:
        return self.token_ids[: self.exact] if self.shifted else self.token_ids


@dataclass
class SaveSpec:
    """Store ``token_ids`` (a prompt prefix) from the request's blocks; ``skip`` tokens are
    known to be stored already."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip: int = 0
    extra: KeyExtra | None = None
    blocks: BlockInfo | None = None


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_end: int = 0
    extra: KeyExtra | None = None
    #: False when the request's key extra is unknown or cannot be built: nothing is stored
    keyed: bool = True
    #: vLLM's request (its block hashes, for KV events)
    request: Any = None


@dataclass
class _Lookup:
    """A scheduler lookup in flight or answered: ``seq`` on the channel (``None``: answered
    in process), the replies of every rank once in."""

    tokens: list[int]
    started: float
    extra: KeyExtra | None = None
    seq: int | None = None
    replies: list[LookupReply] | None = None
    pinned: bool = True
    #: tokens in vLLM's own prefix cache when the hit was offered, and whether it loads async
    local: int = 0
    is_async: bool = False
    #: reported to the metrics (once, when the answer is first used)
    counted: bool = False

    @property
    def hit(self) -> int:
        return min((r.hit for r in self.replies), default=0) if self.replies else 0

    def tier_of_chunk(self, i: int) -> int:
        """The deepest tier any rank holds hit chunk ``i`` in."""
        assert self.replies
        return max(r.tiers[i] if i < len(r.tiers) else 0 for r in self.replies)

