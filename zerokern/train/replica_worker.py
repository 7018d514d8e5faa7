"""One rank of the replica-join run (zerokern/bench/replica_join.py [Note: the replica-join
run]): GPT tiny on a (replicate, shard) mesh with seeded data, `--mode join` as one replica's
torchrun meeting the others at a lighthouse (checkpoint/replica_join.py `ReplicaJob`), or
`--mode restart` as one torchrun of every rank resuming from its checkpoints. Each rank logs
its events ($ZEROKERN_TRAIN_EVENTS, events.py): start, joined, step, lost, torn, resumed,
final.

    python -m zerokern.train.replica_worker --mode join --lighthouse HOST:PORT --replica R ...
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

VOCAB = 256


def _batch(seed: int, step: int, rank: int, batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=g)


def _build(args, mesh):
    import zerokern as zk
    from zerokern.tools.gpt import build_gpt

    model = build_gpt(args.model_size, seed=args.seed, vocab=VOCAB, seq=args.seq)
    opt = zk.ZeroAdamW(model, lr=1e-3, weight_decay=0.01, stage=args.stage,
                       mesh=mesh, backend=args.backend)
    return model, opt


def _train_step(model, opt, tokens) -> float:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def _save(out: Path, step: int, model, opt, **kw) -> None:
    import zerokern as zk

    zk.checkpoint.save(str(out / "ck" / f"step{step:08d}"), model, opt, **kw)


def _state_crc(model, opt) -> int:
    """crc32 of this rank's whole training state (what a join moves): equal on every replica
    of one shard rank."""
    from zerokern.checkpoint.replica import _crc, _state_tensors
    from zerokern.checkpoint.views import model_extras, optimizer_view

    view = optimizer_view(model, opt)
    return _crc(_state_tensors(view, model_extras(model, view)))


def worker(args) -> int:
    """One rank: `--mode join` (a replica's torchrun, at the lighthouse) or `--mode restart`
    (one torchrun of every rank, resuming from its checkpoints)."""
    import torch
    import torch.distributed as dist

    from zerokern.comm.errors import RankAborted
    from zerokern.train import events

    torch.manual_seed(0)
    out = Path(args.out)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local, local_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.mode == "join":
        from zerokern.checkpoint.replica_join import ReplicaJob, ReplicaJobError
        from zerokern.comm import quorum

        q = quorum.Quorum(quorum.connect(args.lighthouse), replica=args.replica,
                          replicas=args.replicas, shards=local_world, shard_rank=local)
        rank = q.rank
        events.record("start", rank=rank, replica=args.replica, restart=restart)
        job = ReplicaJob(q, lambda mesh: _build(args, mesh))
        try:
            objects, state = job.join()
        except ReplicaJobError as torn:  # [Note: the step's agreement comes first]: every rank
            events.record("torn", rank=rank, error=str(torn)[:400])
            raise
        events.record("joined", rank=rank, **job.joins[-1])
        step = 0 if state is None else state["step"]
        while step < args.steps:
            try:
                _train_step(objects[0], objects[1],
                            _batch(args.seed, step, rank, args.batch, args.seq))
            except Exception as e:  # noqa: BLE001 - survivable ones only (job.recover)
                events.record("lost", rank=rank, names=getattr(e, "origin", None),
                              survived=job.survivable(e), error=f"{type(e).__name__}: {e}"[:400])
                try:
                    objects, state = job.recover(objects, e, {"step": step})
                except ReplicaJobError as torn:  # no whole replica: the launchers restart all
                    events.record("torn", rank=rank, error=str(torn)[:400])
                    raise
                step = state["step"]
                events.record("joined", rank=rank, **job.joins[-1])
                continue
            step += 1
            events.record("step", step=step, rank=rank)
        _save(out, step, objects[0], objects[1])
        events.record("final", rank=rank, replica=args.replica, crc=_state_crc(*objects[:2]))
        dist.destroy_process_group()
        return 0
    # --mode restart: every rank in one torchrun job
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    import zerokern as zk
    from zerokern.tools.spawn import PG_TIMEOUT_ENV, _env_s
    from zerokern.train.launch import PG_TIMEOUT_S, attempt_store

    # zerokern train's store per attempt and timeout: a restart must not read the last
    # attempt's keys
    store = attempt_store(datetime.timedelta(seconds=_env_s(PG_TIMEOUT_ENV, PG_TIMEOUT_S)))
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=local, world_size=local_world)
    rank = dist.get_rank()
    events.record("start", rank=rank, restart=restart)
    mesh = init_device_mesh("cpu", (args.replicas, local_world // args.replicas),
                            mesh_dim_names=("replicate", "shard"))
    model, opt = _build(args, mesh)
    step = 0
    path = zk.checkpoint.latest(str(out / "ck"), verify=False)
    if path is not None:
        step = zk.checkpoint.load(path, model, opt)["client_state"]["step"]
        events.record("resumed", rank=rank, step=step)
    try:
        while step < args.steps:
            _train_step(model, opt, _batch(args.seed, step, rank, args.batch, args.seq))
            step += 1
            events.record("step", step=step, rank=rank)
            if step % args.save_every == 0 or step == args.steps:
                _save(out, step, model, opt, client_state={"step": step})
    except RankAborted as e:
        events.record("lost", rank=rank, names=getattr(e, "origin", None))
        raise
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    w = argparse.ArgumentParser(prog="python -m zerokern.train.replica_worker")
    w.add_argument("--mode", choices=("join", "restart"), required=True)
    w.add_argument("--lighthouse")
    w.add_argument("--replica", type=int, default=0)
    w.add_argument("--replicas", type=int, required=True)
    w.add_argument("--steps", type=int, required=True)
    w.add_argument("--seq", type=int, default=32)
    w.add_argument("--batch", type=int, default=4)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--stage", type=int, default=2)
    w.add_argument("--save-every", type=int, default=10)
    w.add_argument("--out", required=True)
    w.add_argument("--backend", default="auto")
    w.add_argument("--model-size", default="tiny")
    args = w.parse_args(argv)
    return worker(args)


if __name__ == "__main__":  # a torchrun rank: cli.py [Note: leaving a torchrun rank]
    from zerokern.comm.exit_guard import leave_rank

    leave_rank(main)
