"""The params' device against the process group's backend, checked when an optimizer is built.

[Note: the params' device and the backend]
zerokern's collectives carry the params' device's tensors over the optimizer's process group
(or its mesh's groups): NCCL carries CUDA tensors only, and zerokern's gloo paths (the
send/recv ring, shared memory between ranks: comm/ring.py, comm/shm.py) carry CPU tensors
only. A mismatch fails later and far from its cause: CPU params on an NCCL group at the first
collective, deep in a backward ("No backend type associated with device type cpu"); CUDA params
on a gloo group in gloo's CUDA staging path, a host copy per collective, if at all. The usual
cause is a script that never moves the model to the GPU (torchrun starts NCCL when CUDA is
available), or one that moves it under a gloo group. So the optimizer checks it at
construction, before anything changes, and names the argument and the fix (a ValueError).
A group with one backend per device type ("cpu:gloo,cuda:nccl", torch's default without a
backend) carries both; a backend zerokern does not know (mpi, ucc, a test's fake one) is not
checked.
"""

from __future__ import annotations

from typing import FrozenSet, List, Optional, Tuple

import torch
import torch.distributed as dist

# The device types whose tensors zerokern's collectives carry over each backend.
CARRIES = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"})}


def carried(backend: str) -> Optional[FrozenSet[str]]:
    """The device types a group of `backend` (dist.get_backend's string, e.g. "nccl" or
    "cpu:gloo,cuda:nccl") carries in zerokern's collectives; None for a backend not known."""
    out = set()
    for part in str(backend).lower().split(","):
        dev, _, name = part.strip().rpartition(":")
        kinds = CARRIES.get(name)
        if kinds is None:
            return None
        out |= kinds & {dev} if dev else kinds
    return frozenset(out)


def _groups(process_group, mesh) -> List[Tuple[str, object]]:
    """(the argument that names it, group) of every group the optimizer's collectives use."""
    out = []
    if process_group is not None:
        out.append(("process_group", process_group))
    if mesh is not None:
        out += [(f"mesh (its dim {d}'s group)", mesh.get_group(d))
                for d in range(mesh.mesh.ndim)]
    if not out:
        out.append(("the default process group (process_group=None)", dist.group.WORLD))
    return out


def check_params_backend(device: torch.device, process_group=None, mesh=None,
                         who: str = "ZeroAdamW") -> None:
    """Raise ValueError if the groups cannot carry tensors of the params' `device` (Note).

    Args:
        device: the params' device.
        process_group, mesh: the optimizer's arguments (None: the default group).
        who: the optimizer's class name, for the message.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    for what, group in _groups(process_group, mesh):
        backend = dist.get_backend(group)
        kinds = carried(backend)
        if kinds is None or device.type in kinds:
            continue
        if "cuda" in kinds:
            raise ValueError(
                f"{who}: params_or_model's params are on {device}, but {what} is an NCCL "
                f"group (backend {backend!r}), which carries CUDA tensors only. Move the model "
                f"to cuda before constructing {who} (model.to(torch.device('cuda', "
                "int(os.environ['LOCAL_RANK'])))), and the batches too; or, to train on "
                "CPUs, use a gloo group (zerokern.init_distributed() starts gloo where CUDA is "
                "not available)")
        raise ValueError(
            f"{who}: params_or_model's params are on {device}, but {what} is a gloo group "
            f"(backend {backend!r}): zerokern's gloo collectives (the send/recv ring, shared "
            "memory) carry CPU tensors only. For a model on the GPU use an NCCL group "
            "(torch.distributed.init_process_group('nccl'), or zerokern.init_distributed(), "
            f"which starts NCCL where CUDA is available) before constructing {who}; or keep "
            "the model on the CPU")
