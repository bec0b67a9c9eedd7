"""A small GPT-style language model for the demo, and its FSDP2 sharding.

The model is a plain pre-LayerNorm decoder: token and learned position embeddings, ``n_layer``
blocks of causal self-attention and a GELU MLP, a final LayerNorm and a language-model head.
Dropout is applied to the embeddings, inside attention and on both residual branches, so the
global RNG state is part of what a checkpoint must capture for bit-exact resumption.

Weight tying: by default the head reuses the token-embedding matrix by calling
:func:`torch.nn.functional.linear` on ``tok_emb.weight`` inside :meth:`GPT.forward`. There is no
second module holding a shared :class:`~torch.nn.Parameter`, so FSDP2, ``Module.to_empty`` and
Distributed Checkpoint all see exactly one parameter and one state-dict key
(``tok_emb.weight``). Both embeddings and the head belong to the root FSDP2 unit, which
all-gathers them for the root's forward.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`.

    Attributes:
        vocab_size: Number of token ids (byte tokens use ids 0..255).
        seq_len: Longest supported sequence (size of the position table), in tokens.
        d_model: Width of the residual stream.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``d_model``.
        dropout: Dropout probability used everywhere (embeddings, attention, residuals).
        tie_weights: Use the token-embedding matrix as the output head.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 6
    dropout: float = 0.1
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for field_name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @classmethod
    def demo(cls) -> GPTConfig:
        """Small byte-level preset for CPU runs.

        1,853,568 parameters, so fp32 params + AdamW ``exp_avg`` + ``exp_avg_sq`` are ~22 MB
        (the smallest width/depth that keeps the training state in the 20-40 MB band). A
        training step at batch 8 x seq_len 128 is ~12 GFLOP (forward + backward).
        """
        return cls(vocab_size=256, seq_len=128, d_model=192, n_layer=4, n_head=6, dropout=0.1)

    @classmethod
    def gpt2_small(cls) -> GPTConfig:
        """GPT-2 small shape (124M parameters with the tied head); byte tokens use ids < 256."""
        return cls(vocab_size=50257, seq_len=1024, d_model=768, n_layer=12, n_head=12, dropout=0.1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; input and output shape ``(B, T, d_model)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(batch, steps, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, steps, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer ``d_model -> 4 d_model -> d_model`` with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        config: Model shape. Construct under ``torch.device("meta")`` to get shapes without
            memory; then ``to_empty(device=...)`` and :meth:`init_weights`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head: nn.Linear | None = (
            None if config.tie_weights else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise all parameters GPT-2 style, drawing from the global torch RNG.

        Linear and embedding weights ~ N(0, 0.02), biases 0, LayerNorm (1, 0); the output
        projections of the residual branches use std ``0.02 / sqrt(2 * n_layer)``.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, if ``targets`` is given, the mean cross-entropy.

        Args:
            idx: Token ids, int64 of shape ``(B, T)`` with ``T <= config.seq_len``.
            targets: Token ids to predict, int64 of shape ``(B, T)``, or None.

        Returns:
            ``(logits, loss)``: logits of shape ``(B, T, vocab_size)`` and a scalar loss
            (None without targets).

        Raises:
            ValueError: ``idx`` is not 2-D, ``T`` exceeds ``seq_len``, or the target shape
                differs from ``idx``.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        steps = idx.shape[1]
        if steps > self.config.seq_len:
            raise ValueError(f"sequence length {steps} exceeds seq_len {self.config.seq_len}")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx {tuple(idx.shape)}")
        positions = torch.arange(steps, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.lm_head is None:
            logits = F.linear(x, self.tok_emb.weight)
        else:
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def shard_model(model: GPT, mesh: DeviceMesh, *, reshard_after_forward: bool = True) -> GPT:
    """Shard ``model`` in place with FSDP2: one unit per block, then the root.

    The root unit holds the embeddings, the final LayerNorm and the (tied) head. Afterwards every
    parameter is a DTensor sharded on dim 0 over ``mesh`` and the model's class is a subclass of
    :class:`torch.distributed.fsdp.FSDPModule`. FSDP2 does not broadcast parameters: every rank
    must have initialised the same values (same seed) before calling this.

    Args:
        model: The model, with parameters on the mesh's device type (``cpu`` for gloo).
        mesh: A 1-D device mesh, e.g. ``init_device_mesh("cpu", (world_size,))``.
        reshard_after_forward: Passed to ``fully_shard`` for the blocks.

    Returns:
        The same ``model`` object.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    logger.debug("sharded %d blocks and root over %s", len(model.blocks), mesh)
    return model


def num_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (global sizes for sharded DTensor parameters)."""
    return sum(p.numel() for p in model.parameters())
