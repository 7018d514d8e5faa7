"""The demo job's corpus: the Python standard library's own source, byte-level, no download.

Every Python install ships its stdlib as `.py` files (`sysconfig.get_paths()["stdlib"]`), so
the default `zerokern train` has real text to learn from on a machine with no network. Tokens
are bytes (vocab 256), so there is no tokenizer to fetch either.

Determinism: the files are the top-level `*.py` of the stdlib directory (168 files, 4.7 MB on
CPython 3.11), read in sorted name order up to `max_bytes`. A batch is `batch` windows of
`seq + 1` bytes at offsets drawn from a generator seeded by (seed, rank, step): the same run
gets the same batches, every rank gets different ones, and a `--compare` run at another stage
replays exactly the same data.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from typing import List, Optional

import torch

VOCAB = 256  # byte-level
# 4 MB: more than the default run consumes (~1.3M tokens over 2 ranks) and read in ~10 ms;
# a larger corpus only costs start-up time.
DEFAULT_MAX_BYTES = 4 << 20


def corpus_files(stdlib: Optional[str] = None) -> List[str]:
    """The stdlib's top-level .py files in sorted order (the deterministic file choice)."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(root, "*.py")))


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, stdlib: Optional[str] = None
                ) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of at most `max_bytes` bytes.

    Raises:
        RuntimeError: the stdlib directory holds no .py source (some minimal installs ship
            only bytecode); the message names the directory.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    chunks, total = [], 0
    for path in corpus_files(stdlib):
        with open(path, "rb") as fh:
            data = fh.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        root = stdlib or sysconfig.get_paths()["stdlib"]
        raise RuntimeError(f"no Python source found under {root} (the stdlib's *.py files are "
                           "the training corpus); install the full Python stdlib")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class Batches:
    """Random windows of the corpus for one rank: `get(step)` -> (inputs, targets), int64.

    Args:
        corpus: 1-D uint8 tensor of tokens.
        batch, seq: per-rank batch size and sequence length.
        seed, rank: the generator seed of step s is a function of (seed, rank, s) only.
    """

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int, rank: int) -> None:
        if corpus.numel() < seq + 2:
            raise ValueError(f"the corpus ({corpus.numel()} bytes) is shorter than seq + 2 = "
                             f"{seq + 2}")
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.seed, self.rank = seed, rank
        self._arange = torch.arange(seq + 1)

    def get(self, step: int):
        g = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.rank * 7_919 + step * 104_729) % 2**63)
        starts = torch.randint(0, self.corpus.numel() - self.seq - 1, (self.batch, 1),
                               generator=g)
        win = self.corpus[starts + self._arange].long()  # (batch, seq + 1)
        return win[:, :-1], win[:, 1:]


class GlobalBatches:
    """`--global-batch G`: step s's batch is G windows drawn from a generator seeded by (seed,
    s) alone, the same at every world size; `get(step, micro)` -> this rank's `batch` of them
    for micro-step `micro` (rows (micro * world + rank) * batch onwards). A run resumed at
    another world size (elastic) so trains on the same global batches, in another split.

    Args:
        corpus: 1-D uint8 tensor of tokens.
        global_batch: G, a multiple of batch * world (TrainConfig's check).
        batch, seq: the micro-batch per rank and the sequence length.
        seed, rank, world: the run's seed, this rank and the world size.
    """

    def __init__(self, corpus: torch.Tensor, global_batch: int, batch: int, seq: int,
                 seed: int, rank: int, world: int) -> None:
        if corpus.numel() < seq + 2:
            raise ValueError(f"the corpus ({corpus.numel()} bytes) is shorter than seq + 2 = "
                             f"{seq + 2}")
        if global_batch % (batch * world):
            raise ValueError(f"global batch {global_batch} is not a multiple of batch {batch} x "
                             f"{world} ranks")
        self.corpus, self.global_batch, self.batch, self.seq = corpus, global_batch, batch, seq
        self.seed, self.rank, self.world = seed, rank, world
        self._arange = torch.arange(seq + 1)

    def get(self, step: int, micro: int = 0):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step * 104_729) % 2**63)
        starts = torch.randint(0, self.corpus.numel() - self.seq - 1, (self.global_batch, 1),
                               generator=g)
        row = (micro * self.world + self.rank) * self.batch
        win = self.corpus[starts[row:row + self.batch] + self._arange].long()
        return win[:, :-1], win[:, 1:]
