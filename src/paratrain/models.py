"""Small reference models used by the demo, ``bench``, ``verify`` and the examples."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.strategies.experts.moe import MoE
from paratrain.strategies.pipeline.layout import PipelineLayout

__all__ = ["GPT", "convnet", "gpt_bench"]


def convnet() -> nn.Sequential:
    """The classic 2-conv + pooling CNN for 28x28 grey images, 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1600, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v`` projections.

    They are separate so that a tensor-parallel plan can split each one colwise (whole
    heads per rank) and ``proj`` rowwise; a fused ``qkv`` split colwise would hand one
    rank all of q and part of k.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.q = nn.Linear(n_embd, n_embd)
        self.k = nn.Linear(n_embd, n_embd)
        self.v = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape

        # The head count follows the projection's width, so a tensor-parallel shard of
        # q/k/v (whole heads per rank) runs its local heads unchanged.
        def heads(linear: nn.Linear) -> torch.Tensor:
            return linear(x).view(batch, time, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q), heads(self.k), heads(self.v),
                                             is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, experts: int = 0,
                 top_k: int = 2) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout) if not experts else MoE(
            dim=n_embd, hidden=4 * n_embd, num_experts=experts, top_k=top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small decoder-only transformer (nanoGPT layout), returning logits ``(B, T, vocab)``.

    Parts: ``tok_emb`` + ``pos_emb`` -> ``blocks`` (a ``ModuleList``; each has
    ``attn.q``/``k``/``v``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``) -> ``ln_f`` -> ``head``. The
    head is not tied to the token embedding, so a pipeline can put them on different
    stages. A part set to ``None`` is skipped (see :meth:`pipeline_layout`). With
    ``experts`` > 0 each block's MLP is a mixture of that many experts, ``top_k`` per token
    (:class:`~paratrain.strategies.experts.moe.MoE`; add
    ``strategies.experts.moe.balance_loss(model)`` to the loss to keep the router even).

        model = GPT(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=128)
        logits = model(tokens)  # tokens: int64 (B, T) with T <= block_size
    """

    def __init__(self, *, vocab_size: int, block_size: int, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0, experts: int = 0,
                 top_k: int = 2) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                            ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(experts, int) or experts < 0:
            raise ValueError(f"experts must be an integer >= 0 (0: dense MLPs), got {experts!r}")
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, experts, top_k)
                                    for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by the depth keep the residual stream's variance.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # A pipeline stage holds only some parts: without the embeddings the input is
        # already the hidden state, without the head the hidden state is the output.
        # position_ids: the tokens' positions when x is a slice of a longer sequence
        # (context parallel); 0, 1, 2, ... by default.
        if self.tok_emb is not None:
            if x.shape[1] > self.block_size:
                raise ValueError(f"sequence of {x.shape[1]} tokens is longer than "
                                 f"block_size={self.block_size}")
            positions = (torch.arange(x.shape[1], device=x.device) if position_ids is None
                         else position_ids)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        return self.head(self.ln_f(x))

    def pipeline_layout(self) -> PipelineLayout:
        """How the ``pipeline`` strategy cuts this model into stages."""
        # A fixed, RNG-free sample: measuring must not change the seeded random stream.
        sample = torch.arange(4 * self.block_size).remainder(self.vocab_size)
        return PipelineLayout(before=("tok_emb", "pos_emb"), blocks="blocks",
                              after=("ln_f", "head"),
                              sample_input=sample.view(4, self.block_size))


def gpt_bench() -> GPT:
    """The small GPT of the tensor-parallel benchmarks, as a no-argument factory for a
    ``module:callable`` model string (``paratrain.models:gpt_bench``).

    4 blocks, width 256, 8 heads, 64 positions, vocabulary 512 (3.4M parameters). It
    takes int64 token ids ``(batch, 64)``: a bench job needs ``vocab_size=512`` and
    ``input_shape=(64,)``.
    """
    return GPT(vocab_size=512, block_size=64, n_layer=4, n_head=8, n_embd=256)
