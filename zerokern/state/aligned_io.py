"""Aligned host buffers and whole-range positional file I/O for offload="nvme".

O_DIRECT moves bytes between the disk and user memory with no page cache in between, but the
buffer address, the file offset and the length must all be multiples of the device's logical
block size. `ALIGN` = 4096 covers every block size Linux exposes (512 and 4096) and the page
size, so one constant serves O_DIRECT, mmap views of the same files, and cudaHostRegister.

`pread_full` / `pwrite_full` loop until the whole range moved (a regular file may return fewer
bytes than asked, e.g. on a signal) and turn a read that reaches the end of the file early (a
truncated state file) into an OSError naming the path. Both call os.preadv / os.pwritev, which
release the GIL, so a thread pool of them overlaps I/O with the cpu kernel in the main thread.

[Note: direct I/O, chunk and depth, measured]
On this machine (ext4 on a virtio disk shared with other jobs, 2 cores), 1 GiB sequential
through a thread pool with q requests in flight, GB/s at (1 MiB, q4), (4 MiB, q4), (16 MiB, q2),
(16 MiB, q4):
    O_DIRECT        read 1.24, 1.24, 2.46, 2.36    read+write 1.66, 1.82, 2.06, 3.09
    buffered + fdatasync + fadvise(DONTNEED)
                    read 0.60, 1.43, 1.04, 0.59    read+write 0.60, 2.24, 1.05, 1.19
O_DIRECT wins or ties everywhere, needs no fdatasync to keep the state out of the page cache,
and costs only aligned buffers, so it is the default; buffered I/O with fadvise(DONTNEED) is
the fallback where O_DIRECT is refused (tmpfs before Linux 6.6, some network file systems).
The step sweep (`zerokern bench --offload --nvme-only`, GPT 20m, stage 2, bf16, 0.56 GB read +
written per step; benchmarks/results/offload-nvme-20m-s2-bf16.md, round-robin over the
configurations), step ms by MiB per request x buffer sets 2 / 4 / 8:
    1 MiB: 593 / 2151 / 1316;  4 MiB: 1631 / 689 / 346;  16 MiB: 345 / 201 / 246;
    32 MiB: 245 / 152 / 223      (an earlier run: 16 MiB 236 / 308 / 229, 32 MiB 256 / 281 / 285)
Small requests lose badly on this loaded VM (2 cores, 7-8 runnable jobs): each chunk is several
thread hand-offs, and each costs a scheduler slice. From 16 MiB on, depth and size move the step
less than the shared disk's run-to-run noise (32 MiB x 4 was fastest in the last run, 152 ms,
and 281 ms in the one before; the 100m sweep, offload-nvme-100m-s2-bf16.md, ranked them
differently again). 16 MiB x 4 took 201-308 ms (72-99% of the read+write floor) across runs
at half the pool of 32 MiB x 4, so CHUNK_NUMEL = 2^22 elements (16 MiB per file per request)
and QUEUE_DEPTH = 4 sets (3 requests each, 12 in flight at most; 4 x 64 MiB of host pool at
bf16). Small buffers get a smaller chunk (`pool_chunk`): a small model's pool stays small.
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Callable, Optional

import numpy as np
import torch

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor of `nbytes` whose address is a multiple of ALIGN; page-locked with
    cudaHostRegister when pin (zerokern.state.pinned does the registering and its accounting)."""
    if pin:
        from zerokern.state import pinned

        return pinned.empty(nbytes, torch.uint8, align=ALIGN)
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return torch.from_numpy(raw[off:off + nbytes])  # the view keeps `raw` alive


def open_state(path: str, direct: bool, create: bool) -> int:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)


def _oserror(err: int, what: str, path: str, offset: int, n: int) -> OSError:
    return OSError(err, f"zerokern offload='nvme': {what} of {n} bytes at offset {offset} of "
                        f"{path} failed: {os.strerror(err)}", path)


def pread_full(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Read len(buf) bytes at offset, or raise OSError naming the path (short read = EIO)."""
    done, n = 0, len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as e:
            raise _oserror(e.errno or errno.EIO, "read", path, offset, n) from e
        if got == 0:  # end of file inside the range: the file was truncated
            raise OSError(errno.EIO, f"zerokern offload='nvme': short read of {path}: "
                                     f"{done} of {n} bytes at offset {offset} (the state file "
                                     f"is {os.fstat(fd).st_size} bytes: truncated?)", path)
        done += got


def pwrite_full(fd: int, buf: memoryview, offset: int, path: str,
                fault: Optional[Callable[[str, int], None]] = None) -> None:
    """Write all of buf at offset, or raise OSError naming the path. `fault(path, offset)` is a
    test hook called first; it may raise (e.g. OSError(ENOSPC)) to inject a full disk."""
    n = len(buf)
    try:
        if fault is not None:
            fault(path, offset)
        done = 0
        while done < n:
            done += os.pwritev(fd, [buf[done:]], offset + done)
    except OSError as e:
        raise _oserror(e.errno or errno.EIO, "write", path, offset, n) from e


def drop_cache(fd: int) -> None:
    """Write back and drop the file's cached pages (after an mmap/buffered access)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def check_path(offload_path) -> str:
    """Validate offload_path at construction: an existing, writable directory (a probe file is
    created and removed, so read-only mounts and permissions are caught, also for root)."""
    if offload_path is None:
        raise ValueError("offload='nvme' needs offload_path=, a directory for the state files")
    if not isinstance(offload_path, (str, os.PathLike)):
        raise TypeError(f"offload_path must be a str or os.PathLike, got "
                        f"{type(offload_path).__name__}")
    path = os.path.abspath(os.fspath(offload_path))
    if not os.path.isdir(path):
        raise ValueError(f"offload_path {path!r} does not exist or is not a directory")
    probe = os.path.join(path, f".zerokern-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"offload_path {path!r} is not writable: {e.strerror}") from e
    return path


def direct_supported(path: str) -> bool:
    probe = os.path.join(path, f".zerokern-direct-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600))
        return True
    except OSError:  # EINVAL: the file system refuses O_DIRECT (tmpfs before Linux 6.6)
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def read_chunk(fd: int, buf, off: int, path: str, direct: bool) -> None:
    pread_full(fd, buf, off, path)
    if not direct:  # buffered fallback: keep no cached copy ([Note: direct I/O...] above)
        os.posix_fadvise(fd, off, len(buf), os.POSIX_FADV_DONTNEED)


def write_chunk(fd: int, buf, off: int, path: str, direct: bool, fault) -> None:
    pwrite_full(fd, buf, off, path, fault)
    if not direct:  # dirty pages are not dropped: write them back first
        os.fdatasync(fd)
        os.posix_fadvise(fd, off, len(buf), os.POSIX_FADV_DONTNEED)
