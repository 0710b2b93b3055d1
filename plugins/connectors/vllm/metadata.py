"""What crosses between the scheduler side of the vLLM connector and its workers: the
connector metadata vLLM sends with each step (:class:`LMCacheConnectorMetadata` of
:class:`LoadSpec`, :class:`SaveSpec` and, in-band, :class:`LookupAsk` and the releases),
the worker metadata vLLM brings back from every rank, on any host
(:class:`LMCacheWorkerMetadata`: the in-band lookup answers), and the scheduler's own
per-request state (:class:`_ReqState`, :class:`_Lookup`), which never leaves its process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - a vLLM without worker metadata: in-band lookups unavailable
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

from lmcache.keys import KeyExtra
from lmcache.plugins.services.lookup import LookupReply

if TYPE_CHECKING:
    from .events import BlockInfo

__all__ = ["LMCacheConnectorMetadata", "LMCacheWorkerMetadata", "LoadSpec", "LookupAsk", "PDPlan", "PDSend", "PushTarget", "SaveSpec"]


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
    #: the in-band lookup whose pins this load consumes (the workers forget it)
    seq: int | None = None
    #: PD, vLLM's flow: pull this offer first (``{"offer", "endpoints", "tokens"}``, :mod:`.pd`)
    pull: dict[str, Any] | None = None
    #: the worker's :class:`lmcache.prompt.Prompt` of ``exact_ids``, built once per spec there
    #: (every engine call of the load takes it: no digest of the tokens per call); never sent
    prompt: Any = field(default=None, compare=False, repr=False)

    @property
    def exact_ids(self) -> list[int]:
        return self.token_ids[: self.exact] if self.shifted else self.token_ids

    def keyed(self, engine: Any) -> Any:
        """:attr:`exact_ids` with their chunk keys in ``engine`` (:attr:`prompt`, built once)."""
        if self.prompt is None:
            self.prompt = engine.prompt(self.exact_ids, self.extra, request=self.req_id)
        return self.prompt


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
    #: the worker's :class:`lmcache.prompt.Prompt` of ``token_ids`` (as :attr:`LoadSpec.prompt`)
    prompt: Any = field(default=None, compare=False, repr=False)

    def keyed(self, engine: Any) -> Any:
        """``token_ids`` with their chunk keys in ``engine`` (:attr:`prompt`, built once)."""
        if self.prompt is None:
            self.prompt = engine.prompt(self.token_ids, self.extra, request=self.req_id)
        return self.prompt


@dataclass
class PushTarget:
    """Where a prefiller pushes a request's chunks: ``host`` and one port per rank."""

    host: str
    ports: list[int]

    def url(self, rank: int) -> str:
        port = self.ports[rank] if rank < len(self.ports) else self.ports[0] + rank
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"


@dataclass
class PDPlan:
    """What PD does for one request (the scheduler's, from its kv_transfer_params)."""

    #: LMCache's protocol: push here, then notify the proxy with ``notify_id``
    target: PushTarget | None = None
    notify_id: str | None = None
    ret_first_tok: bool = False
    #: a fixed receiver (no disagg_spec): the push ends within the step
    static: bool = False
    #: vLLM's flow, prefiller: offer under this name
    offer: str | None = None
    #: vLLM's flow, decoder: pull this (``{"offer", "endpoints", "tokens"}``)
    pull: dict[str, Any] | None = None
    sent: bool = False
    loaded: bool = False


@dataclass
class PDSend:
    """PD, prefiller (:mod:`.pd`): once ``token_ids`` (the whole prompt) are stored, offer
    them as ``offer`` and/or push them to ``target``, then notify the proxy of ``notify_id``."""

    req_id: str
    token_ids: list[int]
    extra: KeyExtra | None = None
    offer: str | None = None
    target: PushTarget | None = None
    notify_id: str | None = None
    static: bool = False


@dataclass
class LookupAsk:
    """An in-band lookup (``vllm.lookup: inband``): every worker answers ``seq`` with its
    cached prefix of ``token_ids`` keyed with ``extra`` (pinning it) in its worker metadata."""

    seq: int
    token_ids: list[int]
    shifted: bool = False
    extra: KeyExtra | None = None
    #: the request asked about (the worker's engine keeps its prompt by this name)
    request: str | None = None


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: in-band lookups to answer this step
    asks: list[LookupAsk] = field(default_factory=list)
    #: in-band lookups whose pins each worker drops (not loaded)
    releases: list[int] = field(default_factory=list)
    #: PD: requests whose stored prompt each worker offers or pushes after the saves
    pd: list[PDSend] = field(default_factory=list)


@dataclass
class LMCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers send back in one step: ``answers[seq]`` holds one
    :class:`LookupReply` per rank that answered lookup ``seq``. vLLM merges the ranks'
    objects with :meth:`aggregate` (whatever host they run on) before the scheduler sees
    them; the scheduler counts a prefix as cached only where every rank has it."""

    answers: dict[int, list[LookupReply]] = field(default_factory=dict)

    def aggregate(self, other: Any) -> LMCacheWorkerMetadata:
        """Both objects' answers, rank lists joined (a new object; neither is changed)."""
        out = {seq: list(rs) for seq, rs in self.answers.items()}
        for seq, rs in getattr(other, "answers", {}).items():
            out.setdefault(seq, []).extend(rs)
        return LMCacheWorkerMetadata(out)


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    saved_end: int = 0
    extra: KeyExtra | None = None
    #: False when the request's key extra is unknown or cannot be built: nothing is stored
    keyed: bool = True
    #: the request's ``kv_transfer_params`` say ``lmcache.skip_save``: loaded, never stored
    skip_save: bool = False
    #: vLLM's request (its block hashes, for KV events)
    request: Any = None
    #: what PD does for it (:mod:`.pd`), from its kv_transfer_params
    pd: PDPlan | None = None


@dataclass
class _Lookup:
    """A scheduler lookup in flight or answered: ``seq`` on the channel (``None``: answered
    in process), the replies of every rank once in; in-band, ``sent`` is the scheduling
    pass whose metadata carried the question (``None``: not sent yet)."""

    tokens: list[int]
    started: float
    extra: KeyExtra | None = None
    #: the request looked up (in process and in-band, the workers keep its prompt by it)
    request: str | None = None
    seq: int | None = None
    replies: list[LookupReply] | None = None
    pinned: bool = True
    #: tokens in vLLM's own prefix cache when the hit was offered, and whether it loads async
    local: int = 0
    is_async: bool = False
    #: reported to the metrics (once, when the answer is first used)
    counted: bool = False
    inband: bool = False
    sent: int | None = None

    @property
    def hit(self) -> int:
        return min((r.hit for r in self.replies), default=0) if self.replies else 0

    def exact(self, chunk_size: int) -> int:
        """The exact (not shifted) part of the hit that every rank holds."""
        return min((r.exact(chunk_size) for r in self.replies), default=0) if self.replies else 0

    def tier_of_chunk(self, i: int) -> int:
        """The deepest tier any rank holds hit chunk ``i`` in."""
        assert self.replies
        return max(r.tiers[i] if i < len(r.tiers) else 0 for r in self.replies)

