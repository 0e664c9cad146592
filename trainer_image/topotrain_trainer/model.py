"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal attention.

Layers live in a `ModuleDict` keyed "0".."n-1" so that a pipeline stage built by
deleting the layers it does not own keeps the full model's parameter names
(`layers.7.attention.wq.weight`): one distributed checkpoint then holds every
stage and loads back under any pipeline split. Stages without the embedding,
the final norm or the output projection simply have them set to None.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the shapes, torch-free (shapes.py), re-exported for the trainer's modules and tests
from topotrain_trainer.shapes import MODEL_CONFIGS as MODEL_CONFIGS
from topotrain_trainer.shapes import ModelConfig as ModelConfig
from topotrain_trainer.shapes import llama2 as llama2
from topotrain_trainer.shapes import llama3 as llama3
from topotrain_trainer.shapes import model_config as model_config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq, head_dim/2); real-valued so DTensor and bf16 need no complex dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x: (batch, seq, heads, head_dim)."""
    pairs = x.float().view(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.n_rep = config.n_heads // config.n_kv_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)
        # Recompute this block's activations in backward instead of storing them.
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = x + self.attention(self.attention_norm(x), cos, sin)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            out: torch.Tensor = torch.utils.checkpoint.checkpoint(
                self._forward, x, cos, sin, use_reentrant=False
            )
            return out
        return self._forward(x, cos, sin)


class Transformer(nn.Module):
    """The whole decoder, or one pipeline stage of it (see `keep_stage`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(config) for i in range(config.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        # Tied: the last stage projects with the token embedding itself (one parameter, so the
        # embedding lives on the last stage too: TrainingConfig.check_mesh refuses pipeline > 1).
        self.output: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states (later stages) -> logits or hidden."""
        h = tokens_or_hidden
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = rotary_tables(h.shape[1], self.config.head_dim, self.config.rope_theta, h.device)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
            if self.output is not None:
                h = self.output(h)
            elif self.tok_embeddings is not None:  # tied
                h = tied_projection(h, self.tok_embeddings.weight)
        return h

    def keep_stage(self, stage: int, num_stages: int) -> Transformer:
        """Delete what pipeline stage `stage` does not own; names stay those of the full model."""
        owned = set(stage_layers(self.config.n_layers, stage, num_stages))
        for name in list(self.layers.keys()):
            if int(name) not in owned:
                del self.layers[name]
        if stage > 0 and not self.config.tie_embeddings:
            self.tok_embeddings = None
        if stage < num_stages - 1:
            self.norm = None
            self.output = None
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic under the caller's torch seed; scaled like Llama/torchtitan."""
        depth_std = 0.02 / math.sqrt(2 * max(1, self.config.n_layers))
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.trunc_normal_(param, std=depth_std)
            else:
                nn.init.trunc_normal_(param, std=0.02)


def tied_projection(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits from the token embedding's weight; under tensor parallelism (a DTensor sharded by
    vocabulary row) the replicated hidden states meet the shards and the logits are gathered."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):
        spread = DTensor.from_local(h, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim)
        logits: torch.Tensor = F.linear(spread, weight).full_tensor()  # type: ignore[attr-defined]
        return logits
    return F.linear(h, weight)


def stage_layers(n_layers: int, stage: int, num_stages: int) -> range:
    """Layer indices of a pipeline stage: contiguous, the remainder spread over the first stages."""
    base, extra = divmod(n_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
