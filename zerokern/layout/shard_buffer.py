"""What every flat buffer shares, stage 0 to 3: `ShardBuffer`, the base of `FlatGroup` (stages
0-2, the whole flat buffer resident) and `stage3.ShardedFlat` (stage 3, only the shard).

A buffer owns one param group's (at stage 3: one unit's) params laid out by `partition` and
answers, through its `StagePattern`, which flat range its optimizer state covers for bucket k
(`state_range`), where that lies in the state buffers (`state_slice`) and how much of it is
padding. The state itself (fp32 master, the rule's states and the step counters; a
`rule.RuleState`) is made by the optimizer's placement (`placement.py`: on the device,
`offload.py`: host memory, `offload_nvme.py`: files) and read through `master` /
`rule_states` (name -> tensor, in the rule's order; each also as an attribute by its name) /
`steps`, so no caller knows where it lives. The masters are filled from the params' original
values, before the cast to the model dtype (issue 3), by `fill_master_`, one state range at a time,
so a placement on disk can stream them without holding the whole master in memory.

What the reports and the checkpoint see is asked here too: `device_buffers` (memory_report),
`value_pieces` / `step_params` / `layout_meta` (checkpoint/views.py).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch

from zerokern.geometry.dtensor_params import local
from zerokern.geometry.partition import FlatLayout
from zerokern.kernels.param_codec import ParamCodec
from zerokern.layout.stages import StagePattern


class ShardBuffer:
    params: List[torch.nn.Parameter]
    dtype: torch.dtype
    rank: int
    pattern: StagePattern
    layout: FlatLayout
    group_index: int  # index into opt.param_groups; -1 for stage 3's frozen buffers
    device: torch.device

    def _init_buffer(self, params, dtype, rank: int, pattern: StagePattern, layout: FlatLayout,
                     group_index: int) -> None:
        self.params = params
        self.dtype = dtype
        self.rank = rank
        self.pattern = pattern
        self.stage = pattern.stage
        self.layout = layout
        self.group_index = group_index
        self.device = params[0].device if params else torch.device("cpu")
        self.state = None  # the placement's state object (none for stage 3's frozen buffers)

    # -- coordinates (partition.py does the math; the pattern picks the ranges) ---------------
    def state_range(self, k: int) -> Tuple[int, int]:
        """Flat range whose optimizer state this rank holds for bucket k."""
        return self.pattern.state_range(self.layout, self.rank, k)

    def state_slice(self, k: int) -> slice:
        """Bucket k's part of the state buffers (the master and the rule's states)."""
        lo, hi = self.state_range(k)
        off = self.pattern.state_offset(self.layout, k)
        return slice(off, off + hi - lo)

    def state_spans(self, i: int) -> Iterator[Tuple[int, int]]:
        """Where param slot i's elements lie among this rank's state (and grad shard): one
        [lo, hi) per bucket that holds some of them."""
        s = self.layout.slots[i]
        for k in self.layout.buckets_of_slot(i):
            lo, hi = self.state_range(k)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                off = self.state_slice(k).start
                yield off + a - lo, off + b - lo

    @property
    def state_numel(self) -> int:
        return self.pattern.state_numel(self.layout)

    @property
    def state_padding(self) -> int:
        """Padding elements among this rank's state."""
        return self.pattern.state_padding(self.layout, self.rank)

    def zero_padding_(self, view: torch.Tensor, lo: int) -> None:
        """Zero the padding among flat elements [lo, lo + len(view)) held by `view` (a grad
        staging buffer whose param regions get their grads): the tail, and the gaps of
        block-aligned slots (partition.py [Note: block-aligned slots]), which hold zero grads
        as the tail does. Gaps: one index_fill_ per buffer and range, its index made once."""
        hi = lo + view.numel()
        if self.layout.slot_align == 1:  # padding only at the tail: one slice
            view[max(self.layout.end - lo, 0):].zero_()
            return
        cache = self.__dict__.setdefault("_pad_index", {})
        key = (lo, hi, view.device)
        if key not in cache:
            ranges = self.layout.pad_ranges(lo, hi)
            # made on the device (arange there): no host->device copy on the backward path,
            # which the fake-CUDA run flagged (tests/gpu_control, stage2-8bit)
            dev = view.device
            cache[key] = torch.cat([torch.arange(a - lo, b - lo, device=dev) for a, b in ranges]
                                   + [torch.zeros(0, dtype=torch.int64, device=dev)])
        if cache[key].numel():
            view.index_fill_(0, cache[key], 0)

    def copy_params_(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """Copy the params' values of flat range [lo, hi) into out (padding left as it is)."""
        for i, a, b in self.layout.overlaps(lo, hi):
            s = self.layout.slots[i]
            src = local(self.params[i]).detach().reshape(-1)  # a DTensor's local shard
            out[a - lo:b - lo].copy_(src[a - s.offset:b - s.offset])

    def fill_master_(self, out: torch.Tensor, s_lo: int = 0) -> None:
        """Write the params' values into out, which holds state elements [s_lo, s_lo + len):
        any piece of the state, so a placement can fill it chunk by chunk (offload_nvme)."""
        s_hi = s_lo + out.numel()
        for k in range(self.layout.n_buckets):
            sl = self.state_slice(k)
            a, b = max(s_lo, sl.start), min(s_hi, sl.stop)
            if a < b:
                flo = self.state_range(k)[0] - sl.start  # flat index = state index + flo
                self.copy_params_(out[a - s_lo:b - s_lo], a + flo, b + flo)

    # -- the state, wherever the placement keeps it ---------------------------------------------
    @property
    def master(self) -> Optional[torch.Tensor]:
        """(state_numel,) fp32; None at fp32 on the device (the params are the master)."""
        return None if self.state is None else self.state.master

    @property
    def rule_states(self) -> Dict[str, torch.Tensor]:
        """The rule's state tensors by name ((state_numel,) each, in the rule's order); {} for
        stage 3's frozen buffers."""
        return {} if self.state is None else self.state.states

    def __getattr__(self, name: str):
        # A rule's state by its name (`getattr(g, name)`): the names come from the rule.
        st = self.__dict__.get("state")
        if st is not None and name in st.states:
            return st.states[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def steps(self) -> Optional[torch.Tensor]:
        """(n_buckets,) int64: each bucket is its own adam_step_ call, and every call advances
        the step it is given."""
        return None if self.state is None else self.state.steps

    # -- per-bucket views handed to the kernels -------------------------------------------------
    def param_values(self, lo: int, hi: int) -> torch.Tensor:
        """The resident model-dtype values of flat range [lo, hi) (a view)."""
        raise NotImplementedError

    def master_piece(self, k: int) -> torch.Tensor:
        if self.master is not None:
            return self.master[self.state_slice(k)]
        return self.param_values(*self.state_range(k))  # fp32: the params are the master

    def param_out_piece(self, k: int) -> Optional[torch.Tensor]:
        """The resident params that receive bucket k's cast-back (None: the params are the
        master). What a step kernel is handed of it is the codec's `kernel_out`."""
        return None if self.master is None else self.param_values(*self.state_range(k))

    # -- the params' format ([Note: the cast-back is the codec's] in kernels/param_codec.py) -----
    @property
    def codec(self) -> ParamCodec:
        """How the params are stored given the fp32 master: the optimizer's codec, set by its
        placement at `allocate`; a buffer without one (stage 3's frozen buffers) stores its
        dtype as it is."""
        c = self.__dict__.get("_codec")
        if c is None:
            c = self.__dict__["_codec"] = ParamCodec(self.dtype)
        return c

    @codec.setter
    def codec(self, codec: ParamCodec) -> None:
        self.__dict__["_codec"] = codec

    # -- after bucket k's update -----------------------------------------------------------------
    def publish_piece(self, comm, k: int):
        """Make bucket k's updated piece visible where the params are used. The pattern decides
        (StagePattern.publishes): stages 1-2 all-gather it into every rank's full params
        (async, in place: it overlaps bucket k+1's update; `gather_piece`); stage 0 updated the
        whole bucket on every rank, stage 3 gathers at the next use. First the buffer stores
        the piece where its shard lives (`store_piece`: stage-3 param offload). Returns the
        all-gather's handle, or None."""
        self.store_piece(k)
        return self.gather_piece(comm, k) if self.pattern.publishes else None

    def store_piece(self, k: int) -> None:
        """After bucket k's update: write the shard back where it lives between uses."""

    def params_loaded_(self) -> None:
        """The masters were replaced (a state dict or checkpoint load, on every rank): a
        format the params are encoded in re-encodes them (stage3.ShardedFlat, FP8)."""

    def gather_piece(self, comm, k: int):
        raise NotImplementedError(f"{type(self).__name__} keeps no full params to publish into")

    def moments(self, k: int) -> List[torch.Tensor]:
        """Bucket k's part of each of the rule's states, in the rule's order."""
        if self.state is None:
            return []
        return self.state.views(self.state_slice(k))  # per-block states: whole blocks

    def state_tensors(self) -> dict:
        out = {**self.rule_states, "steps": self.steps}
        out.update(self._extra_state())
        if self.master is not None:
            out["master"] = self.master
        return out

    def _extra_state(self) -> dict:
        return {}

    # -- what memory_report and the checkpoint views see ----------------------------------------
    def param_buffers(self) -> Iterator[Tuple[str, torch.Tensor, int]]:
        """(category, tensor, padding elements) of the param buffers held."""
        raise NotImplementedError

    def device_buffers(self) -> Iterator[Tuple[str, torch.Tensor, int]]:
        """(category, tensor, padding elements) of every buffer this one holds on the device:
        the params, and the master and rule states where the placement keeps them there
        (RuleState.device_buffers: a compact master yields several tensors)."""
        yield from self.param_buffers()
        if self.state is not None:
            yield from self.state.device_buffers(self.state_padding)

    def value_pieces(self) -> Iterator[Tuple[int, int, int]]:
        """(slot, flat lo, flat hi) of the param values resident on this rank."""
        raise NotImplementedError

    def step_params(self, k: int) -> Tuple[int, ...]:
        """Slots whose elements bucket k's step counter governs."""
        return tuple(i for i, _, _ in self.layout.overlaps(*self.layout.bucket_range(k)))

    def layout_meta(self) -> dict:
        L = self.layout
        return {"numel": L.numel, "padded_numel": L.padded_numel,
                "bucket_numel": L.bucket_numel, "world_size": L.world_size,
                "offsets": [s.offset for s in L.slots]}

    def check_between_steps(self) -> None:
        """Raise if the buffer is mid-use (stage 3: gathered); checkpoints read it between."""
