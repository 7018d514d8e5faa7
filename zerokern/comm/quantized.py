"""Quantized collectives (ZeRO++): qwZ's int8 param all-gather and qgZ's int8/int4 gradient
reduce-scatter, over the GroupComms of a `Comm` (groups.py).

The block codes follow zerokern.kernels.blockquant's contract ([Note: block quantization for
collectives]); this layer cannot import the kernels (pyproject's layers: kernels | comm), so the
optimizer hands in a `codec_for(device)` that returns a module with blockquant's
`quantize(x, block, bits)` / `dequantize(codes, scale, block, bits, dtype)` (the reference on
the CPU, Triton on CUDA tensors).

[Note: one payload per piece]
A piece of `c` elements (c a multiple of 128: every piece of partition's layouts is) travels as
one uint8 payload of `wire_bytes(c)` = c·bits/8 bytes of codes followed by the c/BLOCK fp32
scales (4-aligned: c·bits/8 is a multiple of 4), so one collective moves codes and scales, and
comm_stats() counts exactly these bytes (what was sent).

[Note: qwZ keeps the own piece exact]
The all-gather sends every rank's quantized piece; the receiver dequantizes the others' pieces
into `full` and copies its OWN piece from its exact source. So `write_back_` (which takes the
own piece back) never rounds a param, and the error of `full` is, per element of another
rank's block, at most absmax(block) / 254 (blockquant's bound). Only the forward/backward
gathers are quantized (stage3/runtime.py); gathered_params(), checkpoints, consolidation and
frozen_whole gather exactly.

[Note: qgZ reduces in fp32 after an all-to-all]
A reduce-scatter of N chunks becomes: quantize each chunk (one payload per destination), one
all-to-all, dequantize the N-1 received payloads and sum them in fp32 in rank order together
with this rank's own chunk, which is never sent and stays exact. Error per element: at most
sum over the other ranks r of absmax_r(block) / (2Q) (Q = 127 int8, 7 int4), plus fp32
rounding of the sum. Non-finite grads stay non-finite (an inf or nan makes the block's scale
non-finite, so every element of it dequantizes to inf or nan): the overflow skip still sees them.

[Note: qgZ hierarchical over nodes]
With hpZ the shard group is the whole 2-D mesh (m nodes x n ranks). Each link should carry
quantized bytes once, so the reduction runs in two hops (ZeRO++'s hierarchical all-to-all):
1. inside the node (n ranks): this rank's buffer is regrouped by the node-local index j of each
   chunk's owner; block j (the m chunks owned by ranks with local index j, by node) goes to
   local rank j. Received blocks are summed in fp32: local rank j now holds, for every node i,
   the node's sum of the chunk owned by (i, j).
2. across nodes (m ranks, the mesh column of this j): chunk i of that sum goes to node i;
   summed in fp32, this rank holds the world's sum of its own chunk.
Bytes per rank: (n-1)/n · E·w on the node link, (m-1)/(m·n) · E·w across nodes (w: wire bytes
per element, 1.03 for int8), against a plain ring reduce-scatter's (N-1)/N · E · 4 (fp32).
The error adds up over the two hops (the second quantizes partial sums).
HSDP (shard group = the node) quantizes the reduce-scatter inside the node; the all-reduce of
the reduced shard across nodes stays exact (its replicas must hold the same values: a
quantized all-gather that keeps each rank's own piece exact would make them differ).

[Note: qwZ over nodes]
With hpZ the primary shards span the whole 2-D mesh, and the forward gather would be a ring over
every rank: in a ring of R nodes x n ranks the cross-node links carry (N-1)/N of the unit's
payloads each. Instead each rank's int8 payload crosses nodes once: an all-gather over the
mesh column (R ranks, one per node: (R-1) payloads per rank across), then the R payloads are
all-gathered inside the node ((n-1)·R payloads per rank, node-internal). On 2 nodes x 2 this
sends 1 payload per rank across instead of the ring's 1.5 (rank average). The backward
re-gathers come from the hpZ secondary (exact, inside the node).

[Note: where the quantized ops run]
On a gloo ring group (CPU tensors) the whole op runs on that group's ring thread, in the
order of every other collective on it, and overlaps backward; elsewhere (NCCL, CUDA tensors)
the all-to-alls are issued at once on the caller's thread ([Note: qgZ issued async]).

[Note: qgZ issued async]
Off the ring every all-to-all of a reduce-scatter is issued by the call itself, with
async_op=True: a fixed point of the schedule, the same on every rank (never from wait(), which
ranks may reach at different points). The last hop's decode and sum run in the handle's wait(),
so the compute stream waits for the all-to-all only there, as for a plain reduce-scatter.
With hpZ's two hops the second one sends the first one's sum, so the first hop is waited for,
decoded and summed at the call: on a GPU on a side stream (one per device) that waited for the
compute stream, so the compute stream never waits for hop 1; wait() makes the compute stream
wait for an event recorded on the side stream after hop 2 was issued, and marks the tensors
made there as used by the compute stream (record_stream). The side stream only ever waits for
the compute stream at earlier points and for these all-to-alls: no cycle with the gather
stream ([Note: stage-3 gather stream]). On the CPU there is no stream: hop 1 is waited for on
the host at the call. The arithmetic is the ring's, bit for bit.
Index tensors (hop 1's chunk regrouping, qwZ's two-hop row order) are built once, at
construction, on the group's device (DeviceIndex): never from host memory inside a step.

[Note: qgZ on the CPU ring]
With the C++ codec (NativeCodec: CPU tensors on a gloo ring) a hop moves each byte once
(issue 40: the codec was ~11 ms and the copies around it ~9 ms of a 95 ms CPU step per rank on
the small GPT, 2x2):
- the other ranks' rows are quantized straight into the payload, chunk by chunk from the
  input (hop 1's regrouping is a list of views, not an index_select copy); this rank's own
  row is never quantized (it is not sent: it stays exact);
- over 2 ranks the all-to-all is one exchange, run as the ring's all-gather of a (2, P)
  buffer whose own row holds the row for the peer: shared memory on one host instead of
  gloo's all_to_all over TCP, the same bytes each way (comm_stats counts the payload rows
  sent, as before); over more ranks all_to_all_single;
- the received rows are decoded and added into one fp32 accumulator in rank order, the own
  row in its place (dequantize_add_, one pass each): bitwise the old decode then sum(0)
  (torch sums dim 0 row after row), the last hop straight into `out` when it is fp32 and
  apart from the input;
- with two hops, the second runs on its own group's ring thread (the cross-node split group,
  used by nothing else), queued by the first: hop 2 of one bucket overlaps hop 1 of the next.
  Every rank queues the same jobs in the same order (the first ring's order), and the handle
  waits for both (_AfterQueued).
The GPU path (OpCodec, NCCL) and the reference codec keep _Hop.

[Note: qwZ decodes on the ring]
On the gloo ring the other ranks' pieces are decoded on the ring thread, straight into their
rows of `full`, right after the gather: the decode overlaps the compute the gather was
prefetched under, instead of running in wait() on the step's thread. The own piece is quantized
straight into its payload row.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from zerokern.platform.device import handle

from .collectives import GroupComm, _all_gather, _Done
from .ring import FutureWork

BLOCK = 128
BITS_Q = {8: 127, 4: 7}


def wire_bytes(numel: int, bits: int = 8, block: int = BLOCK) -> int:
    """Bytes of one piece's payload: codes plus fp32 scales ([Note: one payload per piece])."""
    return numel * bits // 8 + (numel // block) * 4


def _check_piece(numel: int, block: int) -> None:
    if numel % block:
        raise ValueError(f"quantized collectives need pieces of a multiple of {block} "
                         f"elements, got {numel}")


def _check_device(gc: GroupComm, t: torch.Tensor) -> None:
    """CPU tensors never go to an NCCL group (its error would name neither the op nor why)."""
    if gc.backend == "nccl" and t.device.type == "cpu":
        raise ValueError("quantized collectives: a CPU tensor for an NCCL group; NCCL moves "
                         "CUDA tensors only (put the model on the GPU, or use gloo on the CPU)")


def _group_device(gc: GroupComm) -> torch.device:
    """Where a group's tensors live: the current CUDA device for NCCL (only that one: GPU
    checklist), else the CPU."""
    if gc.backend == "nccl":
        return handle("cuda").current_device()
    return torch.device("cpu")


class DeviceIndex:
    """A small index tensor (hpZ's chunk regrouping, qwZ's row order) built once per device: at
    construction on its group's device, at its first use on any other, never per call (a
    tensor made from a list, or a CPU tensor's .to(device), is a copy from pageable host
    memory that synchronizes the stream)."""

    def __init__(self, values: Sequence[int], device: torch.device) -> None:
        self.values = [int(v) for v in values]
        self._on: Dict[torch.device, torch.Tensor] = {}
        self.on(device)

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = torch.tensor(self.values, dtype=torch.int64, device=device)
        return t

    def __len__(self) -> int:
        return len(self.values)


def pack_(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Write codes then scales into the (k, P) uint8 payload rows `out` (codes (k, nc), scale
    (k, nb))."""
    k = out.shape[0]
    nc = codes.numel() // k
    out[:, :nc].copy_(codes.view(torch.uint8).view(k, nc))
    out[:, nc:].copy_(scale.view(k, -1).contiguous().view(torch.uint8).view(k, -1))


def unpack(payload: torch.Tensor, numel: int, bits: int, block: int = BLOCK):
    """(k, P) uint8 payload rows -> flat codes (int8, or packed uint8 for int4), flat fp32
    scales, in row order."""
    nc = numel * bits // 8
    codes = payload[:, :nc].contiguous().view(-1)
    if bits == 8:
        codes = codes.view(torch.int8)
    scale = payload[:, nc:].contiguous().view(torch.float32).view(-1)
    return codes, scale


def _encode(codec, x: torch.Tensor, k: int, bits: int, block: int) -> torch.Tensor:
    """(k·c,) values -> (k, P) payload rows, one per piece of c elements."""
    c = x.numel() // k
    codes, scale = codec.quantize(x.reshape(-1), block, bits)
    out = torch.empty(k, wire_bytes(c, bits, block), dtype=torch.uint8, device=x.device)
    pack_(out, codes, scale)
    return out


def _decode(codec, payload: torch.Tensor, c: int, bits: int, block: int,
            dtype: torch.dtype) -> torch.Tensor:
    """(k, P) payload rows -> (k, c) values in dtype."""
    codes, scale = unpack(payload, c, bits, block)
    return codec.dequantize(codes, scale, block, bits, dtype).view(payload.shape[0], c)


# ---- the CPU fast path ([Note: qgZ on the CPU ring]) ---------------------------------------------
def _fast(codec) -> bool:
    """The codec writes into given buffers and decodes-and-adds in one pass (the C++ kernel's
    NativeCodec, kernels/blockquant.py); the reference module and the Triton ops do not."""
    return hasattr(codec, "dequantize_add_")


def _row_parts(payload_row: torch.Tensor, sizes: Sequence[int], bits: int, block: int):
    """(codes, scales) views of one payload row holding pieces of `sizes` elements back to
    back ([Note: one payload per piece]: codes of the whole row, then its scales)."""
    L = sum(sizes)
    nc = L * bits // 8
    codes, scales = payload_row[:nc], payload_row[nc:].view(torch.float32)
    out, c0, s0 = [], 0, 0
    for n in sizes:
        out.append((codes[c0:c0 + n * bits // 8], scales[s0:s0 + n // block]))
        c0, s0 = c0 + n * bits // 8, s0 + n // block
    return out


def _quantize_row_(codec, payload_row: torch.Tensor, pieces: Sequence[torch.Tensor], bits: int,
                   block: int) -> None:
    """Quantize `pieces` (one destination's chunks, in order) straight into its payload row."""
    for x, (codes, scale) in zip(pieces, _row_parts(payload_row, [p.numel() for p in pieces],
                                                    bits, block)):
        codec.quantize_into(x, codes, scale, block, bits)


# ---- qwZ: the all-gather -------------------------------------------------------------------------
class _DequantizeOnWait:
    """The quantized all-gather's handle: wait() dequantizes the other ranks' pieces into
    full and copies the own piece exactly ([Note: qwZ keeps the own piece exact])."""

    def __init__(self, h, payload, full, src, rank, codec, block, order=None) -> None:
        self._h, self._payload, self._full, self._src = h, payload, full, src
        self._rank, self._codec, self._block, self._order = rank, codec, block, order

    def wait(self) -> bool:
        if self._payload is not None:
            self._h.wait()
            c = self._src.numel()
            payload = self._payload.view(-1, wire_bytes(c, 8, self._block))
            n = payload.shape[0]
            vals = _decode(self._codec, payload, c, 8, self._block, self._full.dtype)
            full = self._full.view(n, c)
            if self._order is None:
                full.copy_(vals)
            else:  # row k of the payload is world rank order[k]'s piece (on full's device)
                full.index_copy_(0, self._order, vals)
            _keep_own(full, self._rank, self._src)
            if self._payload.device.type != "cpu":  # used by this (the compute) stream
                self._payload.record_stream(
                    handle(self._payload).current_stream(self._payload.device))
            self._payload = None
        return True

    def is_completed(self) -> bool:
        return self._payload is None


def _keep_own(full: torch.Tensor, rank: int, src: torch.Tensor) -> None:
    """The own piece from its exact source ([Note: qwZ keeps the own piece exact])."""
    full[rank].copy_(src)


def all_gather_quantized_(gc: GroupComm, full: torch.Tensor, src: torch.Tensor, codec_for,
                          label: Optional[str] = None, block: int = BLOCK):
    """qwZ: full = every rank's src, the others' int8 block-quantized, this rank's exact.

    Args:
        gc: the group to gather over.
        full: (N·c,) output, model dtype.
        src: (c,) this rank's exact piece (c a multiple of `block`).
        codec_for: device -> codec module ([module docstring]).
        label: names the collective in the ZEROKERN_DEBUG_COLLECTIVES record.

    Returns:
        a handle; full is valid after its wait().
    """
    if gc.world_size == 1:
        return gc._local(full, src)
    _check_device(gc, src)
    c = src.numel()
    _check_piece(c, block)
    n = gc.world_size
    P = wire_bytes(c, 8, block)
    payload = torch.empty(n, P, dtype=torch.uint8, device=src.device)
    codec = codec_for(src.device)
    mine = payload[gc.rank:gc.rank + 1]
    if _fast(codec) and gc._ring_for(src) is not None:  # [Note: qwZ decodes on the ring]
        _quantize_row_(codec, payload[gc.rank], [src.contiguous()], 8, block)
        gc._record("all_gather", payload, label)
        gc.stats.add("all_gather", (n - 1) * P, gc.dim)
        return gc._on_ring(True, _gather_decode, gc.ring.all_gather, payload, full, src,
                           gc.rank, codec, block, None)
    pack_(mine, *codec.quantize(src, block, 8))
    h = gc.all_gather_(payload.view(-1), mine.view(-1), async_op=True, label=label)
    return _DequantizeOnWait(h, payload, full, src, gc.rank, codec, block)


def _gather_decode(gather, payload: torch.Tensor, full: torch.Tensor, src: torch.Tensor,
                   rank: int, codec, block: int, order: Optional[Sequence[int]]) -> None:
    """[Note: qwZ decodes on the ring] On the ring thread: gather(payload), then every other
    rank's row decoded straight into its piece of full (row k is world rank order[k]'s, or
    rank k's), the own piece copied exact ([Note: qwZ keeps the own piece exact])."""
    gather(payload)
    c = src.numel()
    rows = payload.view(-1, wire_bytes(c, 8, block))
    pieces = full.view(rows.shape[0], c)
    for k in range(rows.shape[0]):
        r = k if order is None else order[k]
        if r != rank:
            codes, scale = unpack(rows[k:k + 1], c, 8, block)  # views: one row
            codec.dequantize_into(codes, scale, pieces[r], block, 8)
    _keep_own(pieces, rank, src)


class HierGather:
    """qwZ's forward gathers with hpZ, in two hops so each payload crosses nodes once
    ([Note: qwZ over nodes]): an all-gather of the int8 payloads across nodes (mesh dim 0),
    then of the R payloads so gathered inside the node (a process group of its own, used only
    from the cross group's ring thread, so its order is that thread's)."""

    def __init__(self, world: GroupComm, cross: GroupComm, node: GroupComm,
                 node_ranks: Sequence[Sequence[int]]) -> None:
        self.world, self.cross, self.node = world, cross, node
        R, n = len(node_ranks), len(node_ranks[0])
        world_rank = {dist.get_global_rank(world.group, w): w for w in range(world.world_size)}
        # row j·R + i of the gathered payloads is the piece of world rank world_rank[(i, j)]
        self.order = [world_rank[node_ranks[i][j]] for j in range(n) for i in range(R)]

    @property
    def order(self) -> torch.Tensor:
        """The row order (on the CPU, to read; the gathers use the copy on their device)."""
        return self._order.on(torch.device("cpu"))

    @order.setter
    def order(self, values) -> None:
        self._order = DeviceIndex(values, _group_device(self.cross))

    def all_gather_(self, full: torch.Tensor, src: torch.Tensor, codec_for,
                    label: Optional[str] = None, block: int = BLOCK):
        """As all_gather_quantized_ over the world, in the two hops."""
        _check_device(self.cross, src)
        _check_device(self.node, src)
        c = src.numel()
        _check_piece(c, block)
        R, n = self.cross.world_size, self.node.world_size
        P = wire_bytes(c, 8, block)
        codec = codec_for(src.device)
        hop1 = torch.empty(R, P, dtype=torch.uint8, device=src.device)
        fast = _fast(codec) and self.cross._ring_for(src) is not None
        if fast:
            _quantize_row_(codec, hop1[self.cross.rank], [src.contiguous()], 8, block)
        else:
            pack_(hop1[self.cross.rank:self.cross.rank + 1], *codec.quantize(src, block, 8))
        out = torch.empty(n, R * P, dtype=torch.uint8, device=src.device)
        for gc, buf in ((self.cross, hop1), (self.node, out)):
            gc._record("all_gather", buf, label)
            gc.stats.add("all_gather", (gc.world_size - 1) * buf.numel() // gc.world_size,
                         gc.dim)
        if fast:  # [Note: qwZ decodes on the ring]
            return self.cross._on_ring(True, _gather_decode,
                                       lambda o: _two_gathers(self, hop1, o), out, full, src,
                                       self.world.rank, codec, block, self._order.values)
        if self.cross._ring_for(src) is not None:  # [Note: where the quantized ops run]
            h = self.cross._on_ring(True, _two_gathers, self, hop1, out)
        else:
            if self.cross.abort is not None:
                self.cross.abort.next_index()
            _two_gathers(self, hop1, out)
            h = _Done()
        return _DequantizeOnWait(h, out, full, src, self.world.rank, codec, block,
                                 self._order.on(src.device))


def _gather_on(gc: GroupComm, out: torch.Tensor, mine: torch.Tensor) -> None:
    """out (k·m,) = every rank's `mine` (m,) of gc, on the calling thread."""
    m = mine.numel()
    out[gc.rank * m:(gc.rank + 1) * m].copy_(mine)
    if gc.ring is not None and out.device.type == "cpu":
        gc.ring.all_gather(out)
    else:
        _all_gather(out, out[gc.rank * m:(gc.rank + 1) * m].clone(), group=gc.group)


def _two_gathers(hg: HierGather, hop1: torch.Tensor, out: torch.Tensor) -> None:
    _gather_on(hg.cross, hop1.view(-1), hop1[hg.cross.rank].clone())
    _gather_on(hg.node, out.view(-1), hop1.view(-1))


# ---- qgZ: the reduce-scatter ---------------------------------------------------------------------
class Level:
    """One hop of a quantized reduce-scatter: a group, and the order (by destination) in which
    the chunks of this hop's input are laid out (None: already in the group's rank order),
    with its index tensor built here, on the group's device (DeviceIndex)."""

    def __init__(self, gc: GroupComm, perm: Optional[List[int]] = None,
                 _index: Optional[DeviceIndex] = None) -> None:
        self.gc, self.perm = gc, perm
        self.index = _index
        if perm is not None and _index is None:
            self.index = DeviceIndex(perm, _group_device(gc))

    def split(self) -> Level:
        return Level(self.gc.split(), self.perm, self.index)

    def pieces(self, x: torch.Tensor, c: int) -> List[List[torch.Tensor]]:
        """x (N·c,) -> per destination rank of the group, the chunks of its row, in order: the
        rows of `rows` as views, without its regrouping copy ([Note: qgZ on the CPU ring])."""
        k = self.gc.world_size
        if self.index is None:
            rows = x.view(k, -1)
            return [[rows[d]] for d in range(k)]
        chunks = x.view(-1, c)
        per = len(self.perm) // k
        return [[chunks[self.perm[d * per + i]] for i in range(per)] for d in range(k)]

    def rows(self, x: torch.Tensor, c: int) -> torch.Tensor:
        """x (N·c,) -> (k, N·c/k): this hop's send rows, by destination rank of the group."""
        rows = x.view(-1, c)
        if self.index is not None:  # regroup the chunks by this hop's destination
            rows = rows.index_select(0, self.index.on(rows.device))
        return rows.reshape(self.gc.world_size, -1)


class _Hop:
    """One all-to-all of a quantized reduce-scatter, issued at construction; finish() decodes
    what arrived and sums it ([Note: qgZ reduces in fp32 after an all-to-all]).

    send (k, L): rows by destination rank of gc."""

    def __init__(self, gc: GroupComm, send: torch.Tensor, codec, bits: int, block: int,
                 async_op: bool) -> None:
        self.gc, self.send, self.codec, self.bits, self.block = gc, send, codec, bits, block
        self.work = self.payload = self.recv = None
        if send.shape[0] > 1:
            self.payload = _encode(codec, send, send.shape[0], bits, block)
            self.recv = torch.empty_like(self.payload)
            self.work = dist.all_to_all_single(self.recv, self.payload, group=gc.group,
                                               async_op=async_op)

    def finish(self) -> torch.Tensor:
        """(L,) fp32: the sum over the group of the rows this rank is the destination of; the
        own row exact. Waits for the all-to-all (on a GPU: the current stream waits)."""
        if self.recv is None:
            return self.send[0].float()
        if self.work is not None:
            self.work.wait()
        L = self.send.shape[1]
        vals = _decode(self.codec, self.recv, L, self.bits, self.block, torch.float32)
        vals[self.gc.rank].copy_(self.send[self.gc.rank])
        return vals.sum(dim=0)

    def tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.send, self.payload, self.recv) if t is not None]


def _account(gc: GroupComm, k: int, L: int, bits: int, block: int, label) -> None:
    payload_row = wire_bytes(L, bits, block)
    if gc.log is not None:  # ZEROKERN_DEBUG_COLLECTIVES: the payload's dtype and size
        gc._record("reduce_scatter", torch.empty(k * payload_row, dtype=torch.uint8), label)
    gc.stats.add("reduce_scatter", (k - 1) * payload_row, gc.dim)


def _reduce_levels(levels: Sequence[Level], out: torch.Tensor, inp: torch.Tensor, codec,
                   bits: int, block: int, label, box: Optional[list] = None) -> None:
    """The whole reduction, synchronously (on the gloo ring's thread); with the C++ codec the
    fast path, the hops after the first on their own ring threads (queued into `box`)
    ([Note: qgZ on the CPU ring])."""
    if _fast(codec):
        _reduce_fast(levels, out, inp, codec, bits, block, box)
        return
    x = inp
    for lv in levels:
        x = _Hop(lv.gc, lv.rows(x, out.numel()), codec, bits, block, False).finish()
    out.copy_(x)


def _reduce_fast(levels: Sequence[Level], out: torch.Tensor, x: torch.Tensor, codec,
                 bits: int, block: int, box: Optional[list]) -> None:
    """[Note: qgZ on the CPU ring] Hop by hop; the next hop on its group's ring thread when
    there is a box to hand its future back in, else here."""
    c = out.numel()
    for i, lv in enumerate(levels):
        last = i == len(levels) - 1
        dst = out if last and out.dtype == torch.float32 and out.is_contiguous() and \
            out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() else None
        acc = _hop_fast(lv, x, c, codec, bits, block, dst)
        if last:
            if acc is not out:
                out.copy_(acc)
            return
        nxt = levels[i + 1].gc.ring
        if box is not None and nxt is not None:  # hop i+1 overlaps hop i of the next bucket
            box.append(nxt.submit(_reduce_fast, levels[i + 1:], out, acc, codec, bits, block,
                                  None))
            return
        x = acc


def _hop_fast(lv: Level, x: torch.Tensor, c: int, codec, bits: int, block: int,
              dst: Optional[torch.Tensor]) -> torch.Tensor:
    """One hop with the C++ codec: quantize the other ranks' rows straight into the payload,
    exchange, then acc = the rows summed in rank order in fp32 (this rank's own row exact,
    the others decoded and added in one pass each); (L,) fp32, in dst when given."""
    gc = lv.gc
    k, me = gc.world_size, gc.rank
    pieces = lv.pieces(x, c)
    sizes = [p.numel() for p in pieces[me]]
    L = sum(sizes)
    P = wire_bytes(L, bits, block)
    if k == 2 and gc.ring is not None:
        # an all-to-all of 2 ranks is one exchange: each rank's row for the other, through
        # the ring's all-gather (shared memory on one host); buf[peer] is then the peer's
        # row for this rank, the same bytes all_to_all_single would bring
        buf = torch.empty(2, P, dtype=torch.uint8)
        _quantize_row_(codec, buf[me], pieces[1 - me], bits, block)
        gc.ring.all_gather(buf.view(-1))
        recv = buf
    else:
        payload = torch.empty(k, P, dtype=torch.uint8)
        for d in range(k):
            if d != me:  # this rank's own row is never sent: it stays exact
                _quantize_row_(codec, payload[d], pieces[d], bits, block)
        recv = torch.empty_like(payload)
        dist.all_to_all_single(recv, payload, group=gc.group)
    acc = dst if dst is not None else torch.empty(L, dtype=torch.float32)
    for q in range(k):  # rank order, this rank's row in its place (torch's sum(0) order)
        if q == me:
            o = 0
            for p in pieces[me]:
                a = acc[o:o + p.numel()]
                if q == 0:
                    a.copy_(p)
                else:
                    a.add_(p)
                o += p.numel()
        else:
            codes, scale = unpack(recv[q:q + 1], L, bits, block)  # views: one row
            if q == 0:
                codec.dequantize_into(codes, scale, acc, block, bits)
            else:
                codec.dequantize_add_(codes, scale, acc, block, bits)
    return acc


class _AfterQueued:
    """The handle of a reduction whose later hop was queued on another ring thread: wait()
    waits for the first job, then for the one it queued (watched on the first group's
    failure channel, at the first job's index)."""

    def __init__(self, h, box: list, abort) -> None:
        self._h, self._box, self._abort = h, box, abort

    def wait(self) -> bool:
        if self._h is not None:
            self._h.wait()
            for fut in self._box:
                FutureWork(fut, self._abort, self._h.index).wait()
            self._h = None
        return True

    def is_completed(self) -> bool:
        return self._h is None or (self._h.is_completed() and all(f.done() for f in self._box))


_SIDE_STREAMS: Dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    """The stream qgZ's first hops run on, one per CUDA device ([Note: qgZ issued async])."""
    if device.index is None:
        device = handle(device).current_device()
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = handle(device).stream(device)
    return _SIDE_STREAMS[device]


def _side_stream_for(levels: Sequence[Level], inp: torch.Tensor):
    """The side stream when hops run before the last one, on a GPU; else None."""
    if len(levels) > 1 and handle(inp).has_streams:
        return _side_stream(inp.device)
    return None


class _SumOnWait:
    """The handle of a reduce-scatter issued off the ring: wait() waits for the last hop's
    all-to-all, then decodes and sums it into out ([Note: qgZ issued async])."""

    def __init__(self, hop: _Hop, out: torch.Tensor, side_done=None) -> None:
        self._hop, self._out, self._side_done = hop, out, side_done

    def wait(self) -> bool:
        if self._hop is not None:
            hop, side_done = self._hop, self._side_done
            if side_done is not None:  # the first hops, on the side stream, are done
                handle(self._out).current_stream(self._out.device).wait_event(side_done)
            self._out.copy_(hop.finish())
            if side_done is not None:
                # made on the side stream, read here: their blocks go back to the side stream
                # only after this (the compute) stream is done with them
                cur = handle(self._out).current_stream(self._out.device)
                for t in hop.tensors():
                    t.record_stream(cur)
            self._hop = self._side_done = None
        return True

    def is_completed(self) -> bool:
        return self._hop is None


def _reduce_levels_async(levels: Sequence[Level], out: torch.Tensor, inp: torch.Tensor,
                         codec, bits: int, block: int) -> _SumOnWait:
    """Issue every hop now; the last one's decode and sum in the handle's wait()."""
    c = out.numel()
    side = _side_stream_for(levels, inp)
    if side is not None:
        side.wait_stream(handle(inp).current_stream(inp.device))  # inp is written there
        inp.record_stream(side)  # read there: the caller may drop it before wait()
    with handle(inp).use_stream(side):
        x = inp
        for lv in levels[:-1]:  # on the side stream on a GPU, on this host on the CPU
            x = _Hop(lv.gc, lv.rows(x, c), codec, bits, block, True).finish()
        last = _Hop(levels[-1].gc, levels[-1].rows(x, c), codec, bits, block, True)
        side_done = None
        if side is not None:
            side_done = handle(inp).recorded_event(side)
    return _SumOnWait(last, out, side_done)


def reduce_scatter_quantized_(levels: Sequence[Level], out: torch.Tensor, inp: torch.Tensor,
                              bits: int, codec_for: Callable, async_op: bool = False,
                              label: Optional[str] = None, block: int = BLOCK):
    """qgZ: out = this rank's chunk of the sum over every rank of inp, sent int8/int4
    block-quantized in one all-to-all per level, reduced in fp32 ([Note: qgZ reduces in fp32
    after an all-to-all], [Note: qgZ hierarchical over nodes]).

    Args:
        levels: the hops (one for a flat group; node then cross-node with hpZ); the product
            of their sizes is the number of chunks in inp.
        out: (c,) the reduced chunk (may alias inp's own chunk: stage 1 reduces in place).
        inp: (N·c,) this rank's contribution, chunk r for rank r of the flat layout; read
            until the handle's wait().
        bits: 8 or 4.
        codec_for: device -> codec module.

    Returns:
        a handle (async_op) or a completed one.
    """
    first = levels[0].gc
    if all(lv.gc.world_size == 1 for lv in levels):
        return first._local(out, inp)
    for lv in levels:
        _check_device(lv.gc, inp)
    _check_piece(out.numel(), block)
    codec = codec_for(inp.device)
    left = inp.numel()
    for lv in levels:  # count (and record) every hop now, in issue order
        k = lv.gc.world_size
        if k > 1:
            _account(lv.gc, k, left // k, bits, block, label)
        left //= k
    if first._ring_for(inp) is not None:  # [Note: where the quantized ops run]
        if len(levels) == 1 or not _fast(codec):
            return first._on_ring(async_op, _reduce_levels, levels, out, inp, codec, bits,
                                  block, label)
        box: list = []  # [Note: qgZ on the CPU ring]: the later hop's job, queued by the first
        h = _AfterQueued(first._on_ring(True, _reduce_levels, levels, out, inp, codec, bits,
                                        block, label, box), box, first.abort)
        if not async_op:
            h.wait()
            return _Done()
        return h
    for lv in levels[1:]:
        if lv.gc.ring is not None:
            lv.gc.ring.drain()
    if first.abort is not None:
        first.abort.next_index()
    h = _reduce_levels_async(levels, out, inp, codec, bits, block)
    if not async_op:
        h.wait()
        return _Done()
    return h


def hierarchical_levels(world: GroupComm, node: GroupComm, cross: GroupComm,
                        node_ranks: Sequence[Sequence[int]]) -> List[Level]:
    """The two hops of [Note: qgZ hierarchical over nodes] for a reduce-scatter over `world`.

    Args:
        world: the flat group the layout is sharded over (chunk w for its rank w).
        node, cross: this rank's node group (mesh dim 1) and cross-node group (mesh dim 0).
        node_ranks: the mesh as global ranks, node_ranks[i][j] (node i, local index j).
    """
    m, n = len(node_ranks), len(node_ranks[0])
    where = {g: (i, j) for i, row in enumerate(node_ranks) for j, g in enumerate(row)}
    me = where[dist.get_rank()]
    if dist.get_process_group_ranks(node.group) != list(node_ranks[me[0]]) or \
            dist.get_process_group_ranks(cross.group) != [row[me[1]] for row in node_ranks]:
        raise ValueError("mesh: its dim-1 and dim-0 groups do not list the ranks in mesh "
                         "order; qgZ's hierarchical reduce-scatter cannot place the chunks")
    owner = [where[dist.get_global_rank(world.group, w)] for w in range(world.world_size)]
    # hop 1: chunks grouped by the owner's local index j, by node i inside a group
    perm1 = sorted(range(world.world_size), key=lambda w: (owner[w][1], owner[w][0]))
    return [Level(node, perm1), Level(cross, None)] if m > 1 and n > 1 else \
        [Level(world, None)]


def check_quantized(quantized_weights, quantized_gradients, stage: int,
                    offload_params: Optional[str]):
    """Validate the ZeRO++ keywords before anything changes; (qwz: bool, grad bits or None).

    Raises:
        TypeError: quantized_weights not a bool, quantized_gradients not a bool or str.
        ValueError: quantized_weights at stage < 3 or with offload_params, quantized_gradients
            not one of False/True/"int8"/"int4" or at stage 0.
    """
    if not isinstance(quantized_weights, bool):
        raise TypeError("quantized_weights must be True or False, got "
                        f"{type(quantized_weights).__name__}")
    if quantized_weights and stage != 3:
        raise ValueError("quantized_weights=True (qwZ) quantizes stage 3's param all-gathers; "
                         f"stages 0-2 gather no params in forward, got stage={stage}")
    if quantized_weights and offload_params is not None:
        raise ValueError("quantized_weights=True does not support offload_params (got "
                         f"offload_params={offload_params!r})")
    if not isinstance(quantized_gradients, (bool, str)):
        raise TypeError('quantized_gradients must be False, True, "int8" or "int4", got '
                        f"{type(quantized_gradients).__name__}")
    bits = {False: None, True: 8, "int8": 8, "int4": 4}.get(quantized_gradients, "bad")
    if bits == "bad":
        raise ValueError('quantized_gradients must be False, True, "int8" or "int4", got '
                         f"{quantized_gradients!r}")
    if bits is not None and stage == 0:
        raise ValueError("quantized_gradients (qgZ) quantizes the gradient reduce-scatter of "
                         "stages 1-3; stage 0 all-reduces full gradients, got stage=0")
    return quantized_weights, bits
