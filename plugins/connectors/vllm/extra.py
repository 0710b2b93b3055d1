"""What of a vLLM request, besides its token ids, goes into its chunk keys.

vLLM keeps requests apart in its own prefix cache by folding "extra keys" into its block
hashes (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``): the
request's ``cache_salt`` (in its first block, so in every block by the chain), its LoRA
adapter (name and path, in every block) and the hash of each multimodal item in the blocks
its placeholder tokens cover. lmcache does the equivalent with a
:class:`~lmcache.keys.KeyExtra`: the salt and the adapter (name, id and path) are hashed
into its ``scope``, which seeds the whole chain; each multimodal item becomes an item of
it, which alters the chain from the first chunk it overlaps. A request with none of them
has no extra, so its keys are exactly those of its tokens.

LMCache's vLLM adapter also reads per-request ``lmcache.*`` entries of the request's
``kv_transfer_params`` (``extra_args.kv_transfer_params`` of its sampling params, which
vLLM copies to ``Request.kv_transfer_params``): :func:`request_params` returns them. Its
``lmcache.tag.<name>`` entries are part of LMCache's cache keys (a request only hits KV
stored under the same tags); here they go into the scope too, so tagged requests share
no key with requests of other tags or none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from lmcache.keys import KeyExtra

__all__ = ["PARAM_PREFIX", "SKIP_SAVE", "TAG_PREFIX", "request_extra", "request_params"]

#: the prefix of LMCache's per-request entries in ``kv_transfer_params``
PARAM_PREFIX = "lmcache."
#: ``lmcache.tag.<name>: <value>``: the request's KV is keyed under these tags
TAG_PREFIX = "lmcache.tag."
#: ``lmcache.skip_save: true``: the request's KV is looked up and loaded but not stored
SKIP_SAVE = "lmcache.skip_save"


def _digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).digest()


def request_params(request: Any) -> dict[str, Any]:
    """The ``lmcache.*`` entries of a vLLM request's ``kv_transfer_params`` (empty when it
    has none, or when they are not a mapping)."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None:
        extra_args = getattr(getattr(request, "sampling_params", None), "extra_args", None)
        if isinstance(extra_args, Mapping):
            params = extra_args.get("kv_transfer_params")
    if not isinstance(params, Mapping):
        return {}
    return {k: v for k, v in params.items() if isinstance(k, str) and k.startswith(PARAM_PREFIX)}


def request_extra(request: Any) -> KeyExtra | None:
    """The key extra of a vLLM ``Request`` (``None`` when it has none).

    Raises ``ValueError`` naming why the request cannot be keyed safely at all: prompt
    embeddings (their KV depends on tensors behind sentinel token ids; such a request is
    neither looked up nor stored), a multimodal item with no identifier, or more items
    than a key extra holds."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise ValueError("a request with prompt embeddings is not cached by lmcache")
    parts: list[list[str]] = []
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(["cache_salt", str(salt)])
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        path = getattr(lora, "lora_path", None) or getattr(lora, "lora_local_path", None) or ""
        parts.append(["lora", str(lora.lora_name), str(lora.lora_int_id), str(path)])
    # tags in name order: the order of a JSON object's keys does not change its KV
    for name, value in sorted((k[len(TAG_PREFIX):], str(v)) for k, v in request_params(request).items()
                              if k.startswith(TAG_PREFIX)):
        parts.append(["tag", name, value])
    scope = _digest(json.dumps(parts), 32) if parts else b""
    items = []
    for i, feature in enumerate(getattr(request, "mm_features", None) or ()):
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if not ident:
            raise ValueError(f"multimodal item {i} of the request has no identifier")
        pos = feature.mm_position
        items.append((int(pos.offset), int(pos.length), _digest(str(ident), 16)))
    extra = KeyExtra(scope, tuple(items))
    return extra if extra else None
