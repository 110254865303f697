"""A small DeepSeek-V4 attention configuration and its seeded random weights.

Weights are float64: the reference does its arithmetic in float64 and rounds
to float32 (then to the cache's storage format) exactly where a value becomes
a cache row, so two computations that differ only in summation order (dense
vs paged, one big batch vs many small ones) cannot flip a quantization
decision. See ``docs/reference.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridkv.models.deepseek_v4 import DEEPSEEK_V4_FP8_QUANT_BLOCK

SUPPORTED_LAYER_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation of the compressed layers' RoPE."""

    factor: float = 16.0
    original_max_position: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ReferenceConfig:
    """Shapes of the reference model (defaults: the small verification model)."""

    hidden_size: int = 64
    num_heads: int = 4
    head_dim: int = 128
    rope_dim: int = 64
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 32
    window_tokens: int = 16
    index_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 8
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling = field(default_factory=YarnScaling)
    norm_eps: float = 1e-6
    vocab_size: int = 1024
    layer_ratios: tuple[int, ...] = (0, 4, 128, 4)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "window_tokens", "index_heads", "index_head_dim", "index_topk",
                     "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        nope = self.head_dim - self.rope_dim
        if nope <= 0 or nope % DEEPSEEK_V4_FP8_QUANT_BLOCK:
            raise ValueError(
                f"head_dim - rope_dim must be a positive multiple of {DEEPSEEK_V4_FP8_QUANT_BLOCK}, "
                f"got {self.head_dim} - {self.rope_dim}"
            )
        if self.rope_dim % 2 or self.rope_dim > self.index_head_dim:
            raise ValueError(f"rope_dim must be even and <= index_head_dim, got {self.rope_dim}")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise ValueError(f"index_head_dim must be a power of two (Hadamard), got {self.index_head_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by o_groups={self.o_groups}")
        if not self.layer_ratios:
            raise ValueError("layer_ratios must name at least one layer")
        for ratio in self.layer_ratios:
            if ratio not in SUPPORTED_LAYER_RATIOS:
                raise ValueError(f"layer ratio must be one of {SUPPORTED_LAYER_RATIOS}, got {ratio!r}")

    def hf_config(self) -> dict:
        """A DeepSeek-V4 style ``config.json`` dict (the MTP layer's trailing 0 included)."""
        return {
            "model_type": "deepseek_v4",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": len(self.layer_ratios),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_tokens,
            "index_n_heads": self.index_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_scaling": {
                "type": "yarn",
                "factor": self.yarn.factor,
                "original_max_position_embeddings": self.yarn.original_max_position,
                "beta_fast": self.yarn.beta_fast,
                "beta_slow": self.yarn.beta_slow,
            },
            "compress_ratios": [*self.layer_ratios, 0],
            "num_nextn_predict_layers": 1,
            "vocab_size": self.vocab_size,
        }


@dataclass(frozen=True)
class CompressorWeights:
    """Gated pooling of ``ratio`` tokens into one ``head_dim`` entry.

    ``wkv``/``wgate``/``ape`` have ``coff * head_dim`` columns, ``coff`` = 2 for
    the overlapping ratio 4 (first half pools into the next entry, second half
    into the token's own entry) and 1 otherwise.
    """

    ratio: int
    head_dim: int
    wkv: np.ndarray
    wgate: np.ndarray
    ape: np.ndarray
    norm: np.ndarray

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def state_width(self) -> int:
        """Floats of one ``[C | Z]`` state row."""
        return 2 * self.coff * self.head_dim


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: np.ndarray  # [q_lora_rank, index_heads * index_head_dim]
    weights_proj: np.ndarray  # [hidden, index_heads]
    compressor: CompressorWeights


@dataclass(frozen=True)
class LayerWeights:
    ratio: int
    attn_norm: np.ndarray  # [hidden]
    wq_a: np.ndarray  # [hidden, q_lora_rank]
    q_norm: np.ndarray  # [q_lora_rank]
    wq_b: np.ndarray  # [q_lora_rank, heads * head_dim]
    wkv: np.ndarray  # [hidden, head_dim]
    kv_norm: np.ndarray  # [head_dim]
    attn_sink: np.ndarray  # [heads]
    wo_a: np.ndarray  # [o_groups, o_lora_rank, heads * head_dim / o_groups]
    wo_b: np.ndarray  # [o_groups * o_lora_rank, hidden]
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


@dataclass(frozen=True)
class ReferenceModel:
    config: ReferenceConfig
    embedding: np.ndarray  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]


def _dense(rng: np.random.Generator, fan_in: int, *shape: int) -> np.ndarray:
    return rng.standard_normal((fan_in, *shape)) / np.sqrt(fan_in)


def _norm_weight(rng: np.random.Generator, dim: int) -> np.ndarray:
    return 1.0 + 0.1 * rng.standard_normal(dim)


def _compressor(rng: np.random.Generator, config: ReferenceConfig, ratio: int, head_dim: int) -> CompressorWeights:
    coff = 2 if ratio == 4 else 1
    return CompressorWeights(
        ratio=ratio,
        head_dim=head_dim,
        wkv=_dense(rng, config.hidden_size, coff * head_dim),
        wgate=_dense(rng, config.hidden_size, coff * head_dim),
        ape=0.5 * rng.standard_normal((ratio, coff * head_dim)),
        norm=_norm_weight(rng, head_dim),
    )


def _layer(rng: np.random.Generator, config: ReferenceConfig, ratio: int) -> LayerWeights:
    c = config
    heads_dim = c.num_heads * c.head_dim
    compressor = _compressor(rng, c, ratio, c.head_dim) if ratio else None
    indexer = None
    if ratio == 4:
        indexer = IndexerWeights(
            wq_b=_dense(rng, c.q_lora_rank, c.index_heads * c.index_head_dim),
            weights_proj=_dense(rng, c.hidden_size, c.index_heads),
            compressor=_compressor(rng, c, ratio, c.index_head_dim),
        )
    return LayerWeights(
        ratio=ratio,
        attn_norm=_norm_weight(rng, c.hidden_size),
        wq_a=_dense(rng, c.hidden_size, c.q_lora_rank),
        q_norm=_norm_weight(rng, c.q_lora_rank),
        wq_b=_dense(rng, c.q_lora_rank, heads_dim),
        wkv=_dense(rng, c.hidden_size, c.head_dim),
        kv_norm=_norm_weight(rng, c.head_dim),
        attn_sink=rng.standard_normal(c.num_heads),
        wo_a=rng.standard_normal((c.o_groups, c.o_lora_rank, heads_dim // c.o_groups))
        / np.sqrt(heads_dim // c.o_groups),
        wo_b=_dense(rng, c.o_groups * c.o_lora_rank, c.hidden_size),
        compressor=compressor,
        indexer=indexer,
    )


def build_model(config: ReferenceConfig | None = None, seed: int = 0) -> ReferenceModel:
    """Seeded random weights for every layer of ``config`` (same seed, same weights)."""
    config = config or ReferenceConfig()
    rng = np.random.default_rng(seed)
    embedding = rng.standard_normal((config.vocab_size, config.hidden_size))
    layers = tuple(_layer(rng, config, ratio) for ratio in config.layer_ratios)
    return ReferenceModel(config=config, embedding=embedding, layers=layers)
