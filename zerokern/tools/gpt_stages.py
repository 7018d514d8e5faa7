"""The demo GPT (tools/gpt.py) split into pipeline stages by layers.

[Note: a GPT pipeline stage]
Stage s of P holds blocks `stage_layers(n_layers, P)[s]` (as even as possible, the first stages
one more), the embeddings (tok, pos) on the first stage and the final norm and head on the
last. Each stage keeps the whole model's param names (torchtitan's split): its blocks are
registered under their index in the whole model, so stage 1's first block is `blocks.3.*` as in
`GPT`, and a checkpoint of the stages loads by name at any other split
(checkpoint/parts.py [Note: a checkpoint in parts]). With P = 1 the stage is the whole model,
names and tied embedding included. With P > 1 the head's weight is its own param on the last
stage (the embedding is on the first): the tie cannot cross ranks, so the pipelined model has
vocab x d_model more params than `GPT` (Megatron keeps the two in step with an all-reduce of
their grads; here they are simply two params). So the stages differ in size: the first holds
the embeddings, the last the head.
The blocks' container is a ModuleList (`_Layers`) whose children keep those indices as their
names (torchtitan keeps them in a ModuleDict): stage 3's default unit policy makes each child
of a ModuleList a unit (stage3/units.py), so every block is gathered on its own, as in `GPT`,
where a ModuleDict would leave one unit for the whole stage.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from .gpt import PRESETS, Block, GPTConfig


class _Layers(nn.ModuleList):
    """A ModuleList of blocks named by their index in the whole model ("3", "4", ...): it is
    iterated, never indexed ([Note: a GPT pipeline stage])."""

    def __init__(self, blocks) -> None:
        super().__init__()
        for i, b in blocks:
            self.add_module(str(i), b)


def stage_layers(n_layers: int, num_stages: int) -> List[range]:
    """The block indices of each of num_stages stages (the first stages take one more).

    Raises:
        ValueError: num_stages is not in [1, n_layers].
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or \
            not 1 <= num_stages <= n_layers:
        raise ValueError(f"pp: the GPT's {n_layers} layers split into 1 to {n_layers} pipeline "
                         f"stages, got {num_stages!r}")
    base, extra = divmod(n_layers, num_stages)
    out, at = [], 0
    for s in range(num_stages):
        n = base + (s < extra)
        out.append(range(at, at + n))
        at += n
    return out


class GPTStage(nn.Module):
    """Pipeline stage `stage` of `num_stages` of the demo GPT ([Note: a GPT pipeline stage]).

    Args:
        config: the GPT's config (tools/gpt.py).
        stage: this stage's index.
        num_stages: the number of pipeline stages.

    The forward takes token ids (batch, seq) on the first stage, the previous stage's
    activations (batch, seq, d_model) on the others; the last returns the logits.
    """

    def __init__(self, config: GPTConfig, stage: int, num_stages: int) -> None:
        super().__init__()
        layers = stage_layers(config.n_layers, num_stages)  # ValueError
        if not (isinstance(stage, int) and 0 <= stage < num_stages):
            raise ValueError(f"stage must be in [0, {num_stages}), got {stage!r}")
        self.config, self.stage, self.num_stages = config, stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        c = config
        if self.first:
            self.tok = nn.Embedding(c.vocab, c.d_model)
            self.pos = nn.Embedding(c.seq, c.d_model)
        self.blocks = _Layers((i, Block(c)) for i in layers[stage])
        if self.last:
            self.ln_f = nn.LayerNorm(c.d_model)
            self.head = nn.Linear(c.d_model, c.vocab, bias=False)
            if self.first:
                self.head.weight = self.tok.weight  # the whole model: tied, as GPT
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.shape[1]
            x = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for blk in self.blocks:
            x = blk(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x

    def probe_input(self, batch: int, seq: int, device=None) -> torch.Tensor:
        """An input of the right kind for this stage: token ids on the first, activations on
        the others (what `zerokern estimate` runs on the meta device)."""
        if self.first:
            return torch.zeros(batch, seq, dtype=torch.long, device=device)
        return torch.zeros(batch, seq, self.config.d_model, device=device)


def gpt_stages(size: str, num_stages: int, seed: int = 0) -> List[GPTStage]:
    """Every stage of a preset GPT ("tiny", "small", "20m", ...), built in order from one seed
    (each rank builds only its own with `GPTStage(PRESETS[size], s, P)`).

    Raises:
        ValueError: an unknown preset, or num_stages not in [1, n_layers].
    """
    if size not in PRESETS:
        raise ValueError(f"model size must be one of {tuple(PRESETS)}, got {size!r}")
    torch.manual_seed(seed)
    return [GPTStage(PRESETS[size], s, num_stages) for s in range(num_stages)]
