"""A small GPT (tied embeddings, pre-norm blocks) for benchmarks, the demo job and tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    seq: int = 128
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8

    @property
    def approx_params(self) -> int:
        d = self.d_model
        return self.vocab * d + self.seq * d + self.n_layers * (12 * d * d + 13 * d) + 2 * d


PRESETS = {
    "tiny": GPTConfig(vocab=256, seq=32, d_model=64, n_layers=2, n_heads=4),      # ~0.1M
    "small": GPTConfig(vocab=512, seq=64, d_model=192, n_layers=4, n_heads=6),    # ~1.9M
    "20m": GPTConfig(vocab=8192, seq=128, d_model=512, n_layers=6, n_heads=8),    # ~23M
    "100m": GPTConfig(vocab=16384, seq=256, d_model=768, n_layers=14, n_heads=12),  # ~112M
    # ZeRO-Infinity's headline (benchmarks/bench_infinity.py): fp32 master + m + v = 25.6 GB,
    # more than the 24 GiB of RAM of the 2-core machines this project runs on.
    "2b": GPTConfig(vocab=32768, seq=256, d_model=2560, n_layers=26, n_heads=20),  # ~2.13B
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_heads = c.n_heads
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: stored once by ZeroAdamW
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build_gpt(size: str = "20m", seed: int = 0, **overrides) -> GPT:
    if size not in PRESETS:
        raise ValueError(f"model size must be one of {tuple(PRESETS)}, got {size!r}")
    cfg = PRESETS[size]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    return GPT(cfg)
