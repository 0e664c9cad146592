"""The bundled trainer's model shapes: torch-free, so that the pod's supervisor (which
validates `training.model` before starting any rank) never imports torch.

`model.py` builds the modules from these; it re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    # the published vocabulary; a job's model takes its dataset's tokenizer's (data.model_vocab)
    vocab_size: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the output projection is the token embedding (Llama 3.2 1B/3B)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.n_kv_heads * self.head_dim
        layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        return self.n_layers * layer + embeddings + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward): 6 per weight of every matmul (the
        output projection included, the embedding lookup not) plus attention's scores and
        values, 12 * layers * width * sequence (as PaLM's appendix counts them)."""
        attn = self.dim * self.dim * 2 + 2 * self.dim * self.n_kv_heads * self.head_dim
        matmul_weights = self.n_layers * (attn + 3 * self.dim * self.ffn_dim) + self.vocab_size * self.dim
        return 6.0 * matmul_weights + 12.0 * self.n_layers * self.dim * seq_len


def llama3(dim: int, layers: int, heads: int, ffn: int, *, tied: bool = False) -> ModelConfig:
    """A Llama 3 shape: 8 kv heads, the 128,256-token vocabulary, RoPE theta 500,000."""
    return ModelConfig(dim, layers, heads, 8, ffn, vocab_size=128256, rope_theta=500000.0,
                       tie_embeddings=tied)  # fmt: skip


def llama2(dim: int, layers: int, heads: int, ffn: int) -> ModelConfig:
    """A Llama 2 shape: multi-head attention, the 32,000-token vocabulary, RoPE theta 10,000."""
    return ModelConfig(dim, layers, heads, heads, ffn, vocab_size=32000, rope_theta=10000.0)


# tiny/small run on CPU in tests; the rest are the published shapes (Llama 3.2 1B and 3B, Llama 3
# and 3.1 8B and 70B, Llama 2 7B and 13B). Llama 3.1/3.2's long-context RoPE frequency scaling
# is not implemented: importing weights whose config asks for it is refused (hf.py).
MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "small": ModelConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=688),
    "1B": llama3(2048, 16, 32, 8192, tied=True),
    "3B": llama3(3072, 28, 24, 8192, tied=True),
    "8B": llama3(4096, 32, 32, 14336),
    "70B": llama3(8192, 80, 64, 28672),
    "7B": llama2(4096, 32, 32, 11008),
    "13B": llama2(5120, 40, 40, 13824),
}


def model_config(name: str, vocab_size: int | None = None) -> ModelConfig:
    config = MODEL_CONFIGS[name]
    return replace(config, vocab_size=vocab_size) if vocab_size else config
