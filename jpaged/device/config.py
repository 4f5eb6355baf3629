"""Static configuration: frozen, hashable dataclasses (safe to close over in `jax.jit`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Every field is static under `jit`.

    Invariants: `num_heads % num_kv_heads == 0` (grouped-query attention: query head h reads
    KV head `h // (num_heads // num_kv_heads)`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
