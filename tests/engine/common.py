"""Shared by the engine tests: a tiny random-init GPT-2, its data, and one training loop run
through zerokern.initialize or deepspeed.initialize (the reference) on the same config."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Dict, List, Optional

import torch

VOCAB, SEQ, MICRO_BATCH = 128, 16, 2
MODEL_SEED, DATA_SEED = 1234, 99


def gpt2(seed: int = MODEL_SEED):
    """GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128): 45k params, random init."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tokens(step: int, micro: int, rank: int, batch: int = MICRO_BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(DATA_SEED + 7919 * step + 131 * micro + rank)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def base_config(stage: int, precision: str = "fp32", gas: int = 2, **zero) -> Dict[str, Any]:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.9],
                                                     "eps": 1e-6, "weight_decay": 0.1,
                                                     "torch_adam": True}},
           "gradient_clipping": 0.5, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage, **zero}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    return cfg


def launcher_env(rank: int) -> None:
    """What torchrun sets (the harness started the group itself)."""
    import torch.distributed as dist

    ws = dist.get_world_size() if dist.is_initialized() else 1
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws),
                      LOCAL_WORLD_SIZE=str(ws))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # The harness runs each rank at one intra-op thread; accelerate's state sets
    # torch.set_num_threads(cores / local ranks) when OMP_NUM_THREADS is unset (2 at N = 1).
    # With 2 threads the forward of a tiny GPT-2 gave another last bit now and then: the
    # clean-clone CI at 590146e failed test_accelerate_state's bitwise resume on the first loss
    # after a step (4.839353084 vs 4.839353561, every later loss equal), measured 2 of 33 fresh
    # processes with 2 threads and 0 of 60 with OMP_NUM_THREADS=1.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


@contextlib.contextmanager
def restore_linear():
    """DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process."""
    import torch.nn.functional as F

    saved = F.linear
    try:
        yield
    finally:
        F.linear = saved
        torch.nn.functional.linear = saved


def train(which: str, rank: int, config: Dict[str, Any], steps: int = 10,
          model=None, client_optimizer=None, client_scheduler=None,
          lrs: Optional[List[List[float]]] = None) -> List[float]:
    """Per-step losses (the mean over this rank's micro-batches of one step) of `steps`
    optimizer steps through `which` in {"zerokern", "deepspeed"}.

    client_optimizer(model) -> optimizer= ; client_scheduler(client optimizer or None) ->
    lr_scheduler= (a scheduler or a callable); lrs: gets engine.get_lr() after each step."""
    launcher_env(rank)
    model = gpt2() if model is None else model
    cfg = copy.deepcopy(config)
    if which == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN reports fp16 support; torch
        # runs fp16 on this CPU all the same, so the reference is allowed to run it.
        get_accelerator().is_fp16_supported = lambda: True
        ctx = restore_linear()
        init = deepspeed.initialize
    else:
        import zerokern

        ctx = contextlib.nullcontext()
        init = zerokern.initialize
    with ctx:
        opt = None if client_optimizer is None else client_optimizer(model)
        sched = None if client_scheduler is None else client_scheduler(opt)
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg,
                               optimizer=opt, lr_scheduler=sched)
        gas = engine.gradient_accumulation_steps()
        losses = []
        for s in range(steps):
            total = 0.0
            for m in range(gas):
                x = tokens(s, m, rank).to(engine.device)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            losses.append(total / gas)
            if lrs is not None:
                lrs.append([float(x) for x in engine.get_lr()])
        if which == "deepspeed":
            engine.destroy() if hasattr(engine, "destroy") else None
    return losses


def rel(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def train_ddp(rank: int, make_optimizer, steps: int = 10, gas: int = 1,
              clip: Optional[float] = None) -> List[float]:
    """The plain-torch reference: DDP + a torch optimizer, loss / gas, no_sync off-boundary,
    clip_grad_norm_(clip) before each step when clip is given."""
    import torch.distributed as dist

    model = gpt2()
    net = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = make_optimizer(model)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(gas):
            ctx = net.no_sync() if (m < gas - 1 and net is not model) else contextlib.nullcontext()
            with ctx:
                x = tokens(s, m, rank)
                loss = net(input_ids=x, labels=x).loss
                (loss / gas).backward()
            total += float(loss.detach())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return losses
