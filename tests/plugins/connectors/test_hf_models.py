"""The SmolLM2 checkpoint export that vLLM serves from (``smollm2_checkpoint``)."""

from __future__ import annotations

import json


def test_a_late_converter_leaves_the_finished_checkpoint_alone(smollm2, tmp_path):
    """Two processes may convert at once (``lmcache demo vllm`` beside ``lmcache bench vllm``,
    or two test suites): the one that finishes second must not replace the first one's copy,
    which a ``vllm serve`` may already be reading. Its own copy is dropped, nothing is left
    behind, and the finished checkpoint is complete (vLLM needs the embedding written out)."""
    from safetensors import safe_open

    from lmcache.plugins.connectors import hf_models

    model, tok = smollm2
    target = tmp_path / "smollm2"
    marker = target / "lmcache-converted.json"
    gguf = hf_models.smollm2_gguf_path()
    hf_models._save(model, tok, target, marker, gguf)
    weights = target / "model.safetensors"
    first = weights.stat().st_ino
    with open(weights, "rb"):  # a reader of the first copy
        hf_models._save(model, tok, target, marker, gguf)
        assert weights.stat().st_ino == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]  # no temporary copy left
    assert json.loads(marker.read_text())["source"] == gguf.name
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    with safe_open(str(weights), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
