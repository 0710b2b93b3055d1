"""The SGLang connector: lmcache as a HiCache storage backend (SGLang's L3 tier).

SGLang's hierarchical cache keeps KV pages in GPU memory (L1) and in a host memory pool
(L2) and asks a ``HiCacheStorage`` (L3) to keep pages beyond that: it writes pages of the
host pool under their page hash (``batch_set_v1`` / ``batch_set``), asks how many leading
pages of a prefix exist (``batch_exists``) and reads them back into host pool pages
(``batch_get_v1`` / ``batch_get``). This class is that backend, on lmcache's storage
hierarchy::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "lmcache",
            "module_path": "lmcache.plugins.connectors.sglang",
            "class_name": "LMCacheHiCacheStorage", "interface_v1": 1,
            "lmcache_config_file": "/etc/lmcache.yaml"}'

Each SGLang page (``page_size`` tokens of K and V for every layer of this rank) is one
lmcache entry. Its key is a canonical lmcache key: the namespace and model, a KV signature
naming dtype, layers, heads, head size, MHA vs MLA, the page size and this rank's shard
(tensor-parallel rank and size; pipeline, context-parallel and decode-context-parallel
shards when used), and a 128-bit digest of SGLang's page hash. Pages are stored in one
layout whatever the host pool's layout: ``(layers, 2, page_size, heads, head_dim)`` for MHA
(lmcache's own chunk layout) and ``(layers, 1, page_size, 1, kv_dim)`` for MLA, so a page
written from a ``page_first`` host pool is read correctly into a ``layer_first`` one.

MLA KV is the same on every tensor-parallel rank: its pages are keyed without the rank
(``tp0of1``, unsharded), every rank reads them and only SGLang's storage writer rank writes.

Configuration (the ``extra_config`` mapping, besides SGLang's own keys):

- ``lmcache_config_file``: an lmcache YAML file (default: ``$LMCACHE_CONFIG_FILE``, else
  lmcache's defaults: one 1 GiB CPU tier);
- ``lmcache``: a mapping of lmcache config overrides, and/or flat ``"lmcache.<key>"`` keys
  (``"lmcache.namespace": "tenant-a"``), which win over the file;
- the lmcache ``model`` defaults to SGLang's served model name.

Pages go in and out through the engine's :class:`~lmcache.chunks.ChunkGateway` with this
pool's page layout. A page that cannot be read (missing, from a tier that errors, failing
its checksum, or of a shape or dtype other than this pool's: then dropped and counted in its
tier's ``corrupt``) is a miss: SGLang recomputes it.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Mapping, Sequence

import torch

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"lmcache's SGLang connector needs sglang ({exc}); install it with "
        "`pip install sglang` or build the test venv with requirements/setup-sglang.sh"
    ) from exc

from lmcache.chunks import ChunkGateway, PageLayout
from lmcache.config import KVSpec
from lmcache.dtypes import dtype_name
from lmcache.engine import CacheEngine
from lmcache.keys import CacheKey

log = logging.getLogger(__name__)

#: extra_config keys that belong to SGLang (or to this class), never lmcache overrides
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "lmcache_config_file", "lmcache"}
_KEY_DOMAIN = b"sglang-hicache-page\0"


def page_digest(page_key: str) -> str:
    """The 32-hex-digit chunk hash of an SGLang page key (blake2b-128, domain-separated
    from lmcache's token-chain hashes)."""
    return hashlib.blake2b(_KEY_DOMAIN + page_key.encode(), digest_size=16).hexdigest()


class _PageFormat:
    """How one host pool's pages map to the stored layout.

    ``host_shape`` is the shape of ``host_pool.get_data_page(i, flat=False)``;
    ``to_stored`` permutes such a page view into the stored layout and ``from_stored``
    the stored tensor back into a host page view's order.
    """

    def __init__(self, pool: Any, is_mla: bool):
        self.pool = pool
        self.is_mla = is_mla
        self.layout = pool.layout
        self.dtype = pool.dtype
        self.page_size = pool.page_size
        self.num_layers = pool.layer_num
        P, L = self.page_size, self.num_layers
        if is_mla:
            D = pool.kv_cache_dim
            self.heads, self.head_dim = 1, D
            # host page views (sglang pool_host/mla.py get_data_page)
            perms = {
                "layer_first": ((L, P, 1, D), lambda t: t.unsqueeze(1)),  # (L,P,1,D)
                "page_first": ((P, L, 1, D), lambda t: t.permute(1, 0, 2, 3).unsqueeze(1)),
                "page_first_direct": ((1, L, P, 1, D), lambda t: t[0].unsqueeze(1)),
            }
            self.stored_shape = (L, 1, P, 1, D)
        else:
            H, D = pool.head_num, pool.head_dim
            if getattr(pool, "v_head_dim", D) != D:
                raise ValueError(
                    f"K head size {D} != V head size {pool.v_head_dim}: pages of asymmetric MHA pools are not supported"
                )
            self.heads, self.head_dim = H, D
            # host page views (sglang pool_host/mha.py get_data_page)
            perms = {
                "layer_first": ((2, L, P, H, D), lambda t: t.permute(1, 0, 2, 3, 4)),
                "page_first": ((2, P, L, H, D), lambda t: t.permute(2, 0, 1, 3, 4)),
                "page_first_direct": ((2, 1, L, P, H, D), lambda t: t[:, 0].permute(1, 0, 2, 3, 4)),
                "page_head": ((2, 1, H, P, L, D), lambda t: t[:, 0].permute(3, 0, 2, 1, 4)),
            }
            self.stored_shape = (L, 2, P, H, D)
        if self.layout not in perms:
            raise ValueError(
                f"host pool layout {self.layout!r} is not supported by lmcache's SGLang connector "
                f"(supported: {', '.join(perms)})"
            )
        self.host_shape, self._view = perms[self.layout]
        probe = pool.get_data_page(0, flat=False)
        if tuple(probe.shape) != self.host_shape:
            raise ValueError(f"{type(pool).__name__} {self.layout} page is {tuple(probe.shape)}, expected {self.host_shape}")

    def stored_view(self, host_page: torch.Tensor) -> torch.Tensor:
        """A view of a host-ordered page (``host_shape``) in the stored layout."""
        return self._view(host_page)

    def host_page(self, index: int) -> torch.Tensor:
        """The host pool's page starting at token slot ``index`` (a view, writable)."""
        return self.pool.get_data_page(index, flat=False)

    @property
    def page_numel(self) -> int:
        n = 1
        for d in self.stored_shape:
            n *= d
        return n


class LMCacheHiCacheStorage(HiCacheStorage):
    """An SGLang ``HiCacheStorage`` on lmcache's tier hierarchy.

    SGLang builds it as ``LMCacheHiCacheStorage(storage_config, kwargs)`` (the ``dynamic``
    backend factory) and then calls :meth:`register_mem_pool_host` with its host KV pool.
    ``engine`` lets a caller hand in a ready :class:`~lmcache.engine.CacheEngine` instead
    of building one from the extra config.
    """

    def __init__(
        self,
        storage_config: HiCacheStorageConfig,
        kwargs: Mapping[str, Any] | None = None,
        *,
        engine: CacheEngine | None = None,
    ):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        self._owns_engine = engine is None
        if engine is None:
            overrides = dict(extra.get("lmcache") or {})
            for k, v in extra.items():
                if isinstance(k, str) and k.startswith("lmcache."):
                    overrides[k[len("lmcache."):]] = v
            engine = CacheEngine.from_config(extra.get("lmcache_config_file"), **overrides)
        self.engine = engine
        self.hierarchy = engine.hierarchy
        self._gateway = ChunkGateway.of(engine)
        self._pages: ChunkGateway | None = None  # the gateway for this pool's pages
        cfg = engine.config
        self.namespace = cfg.namespace
        model = cfg.model
        if cfg.source_of("model") == "default" and storage_config.model_name:
            model = storage_config.model_name
        self.model = model
        self.is_mla = bool(storage_config.is_mla_model)
        self._fmt: _PageFormat | None = None
        self.signature: str | None = None
        log.info(
            "lmcache HiCache storage: namespace %s, model %s, tp %d/%d%s, tiers %s",
            self.namespace, self.model, storage_config.tp_rank, storage_config.tp_size,
            " (MLA)" if self.is_mla else "", ", ".join(t.name for t in self.hierarchy.tiers),
        )

    # ------------------------------------------------------------------ setup
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Called by SGLang with its host KV pool before any transfer."""
        super().register_mem_pool_host(mem_pool_host)
        self._fmt = _PageFormat(mem_pool_host, self.is_mla)
        self.signature = self._signature(self._fmt)
        self._pages = self._gateway.with_layout(PageLayout(self._fmt.stored_shape, dtype_name(self._fmt.dtype)))

    def _signature(self, fmt: _PageFormat) -> str:
        sc = self.storage_config
        if self.is_mla:  # replicated over tensor parallelism: one copy for every rank
            spec = KVSpec(fmt.num_layers, 1, fmt.head_dim, dtype_name(fmt.dtype), "mla", 0, 1)
        else:
            spec = KVSpec(
                fmt.num_layers, fmt.heads, fmt.head_dim, dtype_name(fmt.dtype), "lt2hd", sc.tp_rank, sc.tp_size
            )
        sig = f"{spec.signature}-pg{fmt.page_size}"
        if sc.pp_size > 1:
            sig += f"-pp{sc.pp_rank}of{sc.pp_size}"
        if sc.attn_cp_size > 1:
            sig += f"-cp{sc.attn_cp_rank}of{sc.attn_cp_size}"
        if getattr(sc, "dcp_size", 1) > 1:
            sig += f"-dcp{sc.dcp_rank}of{sc.dcp_size}"
        tag = getattr(fmt.pool, "storage_format_tag", None)
        if tag:
            sig += "-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in tag)
        return sig

    def key_of(self, page_key: str) -> str:
        """The canonical lmcache key of one SGLang page key."""
        if self.signature is None:
            raise RuntimeError("register_mem_pool_host() must be called before any transfer")
        return CacheKey(self.namespace, self.model, self.signature, page_digest(page_key)).to_string()

    def _keys(self, page_keys: Sequence[str]) -> list[str]:
        return [self.key_of(k) for k in page_keys]

    @property
    def _writer(self) -> bool:
        return getattr(self.storage_config, "is_storage_writer", True)

    # ------------------------------------------------------------------ core
    def _store(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store host-ordered page views (``host_shape``) under lmcache keys; per key
        whether it is held now."""
        fmt, gateway = self._fmt, self._pages
        assert fmt is not None and gateway is not None
        return gateway.store(keys, [fmt.stored_view(p) for p in pages]).held

    def _load(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Read entries into host-ordered page views; a bad or missing entry is ``False``."""
        fmt, gateway = self._fmt, self._pages
        assert fmt is not None and gateway is not None
        out = [False] * len(keys)
        with gateway.found(keys, prefix=False) as got:
            for i, (key, page, r) in enumerate(zip(keys, pages, got)):
                if r is None:
                    continue
                try:
                    fmt.stored_view(page).copy_(r[0].tensor)
                    out[i] = True
                except Exception:
                    log.exception("loading page %s", key)
        return out

    def _page_indices(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        fmt = self._fmt
        assert fmt is not None
        if host_indices.numel() != n * fmt.page_size:
            log.error("%d host indices for %d pages of %d tokens", host_indices.numel(), n, fmt.page_size)
            return None
        flat = host_indices.reshape(-1)
        return [int(flat[i * fmt.page_size]) for i in range(n)]

    # ------------------------------------------------------------------ zero-copy (interface_v1)
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool pages at ``host_indices`` (``len(keys) * page_size`` token
        slots, one page per key); one success flag per key."""
        if not keys:
            return []
        if not self._writer:
            return [True] * len(keys)
        idx = self._page_indices(host_indices, len(keys))
        if idx is None:
            return [False] * len(keys)
        try:
            return self._store(self._keys(keys), [self._fmt.host_page(i) for i in idx])  # type: ignore[union-attr]
        except Exception:
            log.exception("batch_set_v1")
            return [False] * len(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; one success flag per key."""
        if not keys:
            return []
        idx = self._page_indices(host_indices, len(keys))
        if idx is None:
            return [False] * len(keys)
        try:
            return self._load(self._keys(keys), [self._fmt.host_page(i) for i in idx])  # type: ignore[union-attr]
        except Exception:
            log.exception("batch_get_v1")
            return [False] * len(keys)

    # ------------------------------------------------------------------ tensors (generic path)
    def _as_host_page(self, t: torch.Tensor) -> torch.Tensor | None:
        fmt = self._fmt
        if fmt is None:
            raise RuntimeError("register_mem_pool_host() must be called before any transfer")
        if t.numel() != fmt.page_numel or t.dtype != fmt.dtype:
            log.error("a page of %d %s values does not fit this pool's %s pages of %s",
                      t.numel(), t.dtype, fmt.host_shape, fmt.dtype)
            return None
        return t.reshape(fmt.host_shape)

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """The page of ``key`` as a flat tensor in the host pool's page order (written
        into ``target_location`` when given), or ``None``."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        if not keys:
            return []
        fmt = self._fmt
        if fmt is None:
            raise RuntimeError("register_mem_pool_host() must be called before any transfer")
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        flats: list[torch.Tensor | None] = []
        for t in targets:
            if t is None:
                t = torch.empty(fmt.page_numel, dtype=fmt.dtype)
            flats.append(t)
        views = [self._as_host_page(t) if t is not None else None for t in flats]
        ok_idx = [i for i, v in enumerate(views) if v is not None]
        res = [False] * len(keys)
        try:
            got = self._load(self._keys([keys[i] for i in ok_idx]), [views[i] for i in ok_idx])  # type: ignore[misc]
            for i, g in zip(ok_idx, got):
                res[i] = g
        except Exception:
            log.exception("batch_get")
        return [flats[i] if res[i] else None for i in range(len(keys))]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one page given as a tensor in the host pool's page order (flat or not)."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store pages (host page order); ``True`` only if every page was stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            log.error("batch_set: %d keys but %s values", len(keys), None if values is None else len(values))
            return False
        if not self._writer:
            return True
        views = [self._as_host_page(v) for v in values]
        if any(v is None for v in views):
            return False
        try:
            return all(self._store(self._keys(keys), views))  # type: ignore[arg-type]
        except Exception:
            log.exception("batch_set")
            return False

    # ------------------------------------------------------------------ lookups
    def exists(self, key: str) -> bool:
        try:
            return self._gateway.exists([self.key_of(key)])[0]
        except RuntimeError:
            raise
        except Exception:
            log.exception("exists")
            return False

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading ``keys`` are stored (SGLang loads that prefix)."""
        if not keys:
            return 0
        try:
            return len(self._gateway.exists_prefix(self._keys(keys)))
        except RuntimeError:
            raise
        except Exception:
            log.exception("batch_exists")
            return 0

    # ------------------------------------------------------------------ admin
    def clear(self) -> bool:
        """Remove this pool's pages (this namespace, model and signature) from every tier."""
        if self.signature is None:
            return True
        prefix = CacheKey(self.namespace, self.model, self.signature, "0" * 32).to_string()[:-32]
        try:
            self.hierarchy.flush()
            for tier in self.hierarchy.tiers:
                mine = [e.key for e, _ in tier.entries() if e.key.startswith(prefix)]
                tier.delete(mine)
            return True
        except Exception:
            log.exception("clearing lmcache HiCache storage")
            return False

    def get_stats(self):
        return None

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
