"""How much memory a model needs, from its transformers config. Plain code, no grpc.

weights   = parameters x bytes per parameter (dtype or quantization)
KV cache  = 2 x layers x KV heads x head dim x bytes x context length x sequences (inference)
training  = weights + gradients + AdamW moments (fp32) [+ fp32 master weights in mixed
            precision] + activations (Korthikanti et al. 2022: ~34 x s x b x h bytes per layer
            with 16-bit activations) — plus runtime overhead in both cases.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpumarket.proto.errors import InvalidArgument

BYTES_PER_PARAM = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
                   "int8": 1.0, "int4": 0.5}
GATED_MLP = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
             "olmo", "olmo2", "granite", "cohere", "deepseek_v3", "starcoder2"}
OVERHEAD_BYTES = 512 * 2**20      # CUDA context, allocator slack, workspace
OVERHEAD_FRACTION = 0.05


@dataclass(frozen=True)
class ModelShape:
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


def _get(cfg: dict, *names: str, default=None):
    for n in names:
        if isinstance(cfg.get(n), int) and not isinstance(cfg.get(n), bool):
            return cfg[n]
    if default is not None:
        return default
    raise InvalidArgument(f"model config: no {names[0]}")


def shape(cfg: dict) -> ModelShape:
    """The parameter count and attention shape of a decoder-only transformers config."""
    if not isinstance(cfg, dict):
        raise InvalidArgument("model config: not a JSON object")
    cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
    h = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=h // heads)
    inter = _get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    vocab = _get(cfg, "vocab_size")
    if min(h, layers, heads, kv, head_dim, inter, vocab) <= 0:
        raise InvalidArgument("model config: sizes must be positive")
    gated = cfg.get("model_type") in GATED_MLP
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    mlp = (3 if gated else 2) * h * inter
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1
    per_layer = attn + mlp * int(experts) + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    params = layers * per_layer + embed + h
    return ModelShape(params, layers, h, heads, kv, head_dim, vocab)


def bytes_per_param(dtype: str) -> float:
    try:
        return BYTES_PER_PARAM[dtype]
    except KeyError as exc:
        raise InvalidArgument(f"dtype: {dtype!r} is not one of {sorted(BYTES_PER_PARAM)}") from exc


def weights_bytes(s: ModelShape, dtype: str) -> int:
    return int(s.params * bytes_per_param(dtype))


def kv_cache_bytes(s: ModelShape, context: int, sequences: int, kv_dtype: str = "bf16") -> int:
    return int(2 * s.layers * s.kv_heads * s.head_dim * bytes_per_param(kv_dtype)
               * context * sequences)


def _with_overhead(n: float) -> int:
    return int(n * (1 + OVERHEAD_FRACTION) + OVERHEAD_BYTES)


def inference_bytes(s: ModelShape, dtype: str, context: int, sequences: int) -> int:
    """Weights (dtype or quantization) + a 16-bit KV cache + overhead."""
    kv_dtype = "fp8" if dtype == "fp8" else "bf16"
    return _with_overhead(weights_bytes(s, dtype) + kv_cache_bytes(s, context, sequences, kv_dtype))


def training_bytes(s: ModelShape, dtype: str, batch: int, seq_len: int) -> int:
    """Weights + gradients + AdamW state (+ fp32 master weights when training in 16 bits)
    + activations + overhead, for one device holding the whole model."""
    b = bytes_per_param(dtype)
    per_param = b + b + 8 + (4 if b < 4 else 0)
    act_bytes = 34 * seq_len * batch * s.hidden * s.layers * (b / 2)
    logits = 4 * batch * seq_len * s.vocab
    return _with_overhead(s.params * per_param + act_bytes + logits)


def training_flops(s: ModelShape, tokens: int) -> float:
    """Forward + backward: about 6 FLOPs per parameter per token."""
    return 6.0 * s.params * tokens
