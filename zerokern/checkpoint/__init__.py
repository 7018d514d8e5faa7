"""Checkpoints of ZeroAdamW training: save at one world size and stage, load at any other.

    zk.checkpoint.save(path, model, opt)     # collective
    h = zk.checkpoint.save(path, model, opt, async_save=True)  # staged; written meanwhile
    h.wait()  /  zk.checkpoint.wait()        # collective: committed, or its error raised
    zk.checkpoint.latest(dir)                # newest complete checkpoint under dir
    zk.checkpoint.load(path, model, opt)     # collective; any world size, stage, precision
    zk.checkpoint.consolidate(path)          # full fp32 state dict for model.load_state_dict
    zk.checkpoint.recover_from_replica(model, opt)  # HSDP: a replica's state from a live one
    zk.checkpoint.ReplicaJob(quorum, build).join()  # HSDP: a restarted replica joins the job
    zerokern consolidate DIR OUT             # the same, to a .pt or .safetensors file

The format is in format.py [Note: checkpoint format, version 1], the atomic replace in
writer.py [Note: atomic replace], the load rules in reader.py [Note: load is all-or-nothing],
everything read from the optimizer in views.py, asynchronous saves in async_save.py
[Note: asynchronous saves], and the choice of the newest complete one in latest.py
[Note: latest], and an HSDP replica's recovery from a live replica (no checkpoint) in
replica.py [Note: recovery from a live replica]. A pipelined or tensor-parallel job writes one
checkpoint per (stage, tp rank) and loads by param name at any other layout: parts.py
[Note: a checkpoint in parts].
"""

from .async_save import AsyncSave, SaveState, wait
from .consolidate import consolidate, verify
from .format import (
    VERSION,
    CheckpointError,
    ChecksumError,
    MissingFileError,
    ModelMismatchError,
    VersionError,
)
from .latest import latest
from .reader import load
from .replica import recover_from_replica
from .replica_join import Quorum, ReplicaJob, ReplicaJobError
from .saving import save

__all__ = ["save", "load", "consolidate", "verify", "latest", "wait", "recover_from_replica",
           "ReplicaJob", "ReplicaJobError", "Quorum",
           "AsyncSave", "SaveState",
           "VERSION", "CheckpointError", "ChecksumError", "MissingFileError",
           "ModelMismatchError", "VersionError"]
