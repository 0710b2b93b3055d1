"""A tiny Llama for tensor parallelism 2 on the CPU, with vLLM's dummy weights (seeded: the
same in every server): 4 KV heads of 64 (2 per rank; vLLM's CPU attention needs a head size
of 32 or more). Its tokenizer is SmolLM2's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
    "num_hidden_layers": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "torch_dtype": "float32", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
#: vLLM's arguments that load it (no weights on disk)
DUMMY_ARGS = ("--load-format", "dummy")


def tiny_llama(model: Path, dest: Path) -> Path:
    """Write the tiny Llama's directory at ``dest`` (config and ``model``'s tokenizer)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / f, dest / f)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    (dest / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": vocab}))
    return dest
