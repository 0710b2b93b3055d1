"""Opening a tier from its config: :func:`check_tier` loads and checks its plugins
(backend class, codec, policy) without opening anything, :func:`build_tier` opens its
backend and gives the :class:`~lmcache.tier.Tier`. The hierarchy builds its tiers with
them, and tools that inspect a config's persisted tiers (``lmcache ls``, ``config
validate``) use them alone; :mod:`lmcache.hierarchy` re-exports them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .codecs import ChainError, chain_names, load_codec
from .config import TierConfig
from .errors import ConfigError, PluginError
from .ledger import Ledger
from .memory import MemoryObj, MemoryPool
from .plugin_manager import Registries, get_registries
from .policies import EvictionPolicy, build_policy
from .storage import BackendContext, StorageBackend, check_backend_options
from .tier import Tier


@dataclass
class TierParts:
    """A tier's plugins, loaded and checked, before its backend is opened."""

    backend_cls: type[StorageBackend]
    codec: object
    policy: EvictionPolicy
    options: dict


def check_tier(
    i: int,
    tcfg: TierConfig,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    codec_for: Callable[..., object] | None = None,
) -> TierParts:
    """Load tier ``i``'s backend class, codec and policy and check its backend keys,
    opening nothing. Errors are :class:`ConfigError` naming ``tiers[i].<key>``."""
    regs = registries or get_registries()
    prefix = f"tiers[{i}]"
    options = dict(tcfg.options)
    codec_options = options.pop("codec_options", None)
    try:
        backend_cls = regs.backends.load(tcfg.backend)
    except Exception as exc:
        raise ConfigError(f"{prefix}.backend", str(exc), source) from exc
    try:
        for name in chain_names(tcfg.codec):
            regs.codecs.load(name)
    except Exception as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from exc
    try:
        codec = (codec_for or codec_cache(regs))(tcfg.codec, codec_options)
    except ChainError as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}.codec_options", str(exc), source) from None
    except ModuleNotFoundError as exc:  # imported lazily by a codec of the chain
        names = [n for n in chain_names(tcfg.codec) if n in regs.codecs]
        why = regs.codecs.missing(names[0], exc) if len(names) == 1 else exc
        raise ConfigError(f"{prefix}.codec", str(why), source) from exc
    except Exception as exc:
        raise ConfigError(f"{prefix}.codec", str(exc), source) from exc
    try:
        policy_cls = regs.policies.load(tcfg.policy)
    except Exception as exc:
        raise ConfigError(f"{prefix}.policy", str(exc), source) from exc
    try:
        policy = build_policy(policy_cls, tcfg.policy, tcfg.policy_options, tcfg.capacity)
    except PluginError as exc:
        raise ConfigError(f"{prefix}.policy", str(exc), source) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix}.policy_options", str(exc), source) from None
    try:
        check_backend_options(backend_cls, options, tcfg.capacity)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.{exc.key}", exc.problem, source) from None
    return TierParts(backend_cls, codec, policy, options)


def build_tier(
    i: int,
    tcfg: TierConfig,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    codec_for: Callable[..., object] | None = None,
    allocate: Callable[[Sequence[int], torch.dtype], MemoryObj] | None = None,
    clock: Callable[[], float] = time.monotonic,
    pool: MemoryPool | None = None,
    read_only: bool = False,
    trim: bool = True,
    parts: TierParts | None = None,
) -> Tier:
    """Open tier ``i`` of a config: its backend, codec and policy. Used by the hierarchy,
    and on its own by tools that inspect a config's persisted tiers (``lmcache ls``).
    Without ``allocate``, reads go to heap memory; without ``codec_for``, payloads of any
    registered codec are readable."""
    regs = registries or get_registries()
    codec_for = codec_for or codec_cache(regs)
    parts = parts or check_tier(i, tcfg, source=source, registries=regs, codec_for=codec_for)
    ctx = BackendContext(
        tier=tcfg.name,
        capacity=tcfg.capacity,
        options=parts.options,
        codec=parts.codec,  # type: ignore[arg-type]
        codec_lookup=codec_for,  # type: ignore[arg-type]
        allocate=allocate or MemoryPool.allocate_unpooled,
        clock=clock,
        pool=pool,
        read_only=read_only,
    )
    try:
        backend = parts.backend_cls(ctx)
    except ConfigError as exc:  # its class kept: a TierUnusableError lets an engine run without the tier
        raise type(exc)(f"tiers[{i}].{exc.key}", exc.problem, source) from None
    except ModuleNotFoundError as exc:  # a client library imported lazily: the same hint as at import
        raise ConfigError(f"tiers[{i}].backend", str(regs.backends.missing(tcfg.backend, exc)), source) from exc
    return Tier(tcfg, backend, Ledger(tcfg.name, tcfg.capacity, parts.policy), clock, trim=trim)


def codec_cache(regs: Registries) -> Callable[..., object]:
    """``codec(name, options=None)``: the codec (or chain) named ``name``, built once
    per name without options (a tier's reads look a payload's codec up per entry)."""
    cache: dict[str, object] = {}

    def codec(name: str, options: dict | None = None) -> object:
        if options:
            return load_codec(regs.codecs.load, name, options)
        if name not in cache:
            cache[name] = load_codec(regs.codecs.load, name)
        return cache[name]

    return codec
