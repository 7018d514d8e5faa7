"""Stage 3 between steps: every unit's params whole (gather_all / release_all: gathered_params,
checkpoints, generate) and the frozen params whole (frozen_whole: a checkpoint's extras).

A mixin of Stage3Runtime (runtime.py), whose bookkeeping it uses: the forward reference counts
that keep a unit gathered, `_gather` / `_drop` / `_free_unreferenced`, and hpZ's secondaries.
"""

from __future__ import annotations

from contextlib import contextmanager

from . import param_offload


class WholeParams:
    def gather_all(self) -> None:
        param_offload.new_pass(self)
        self._hpz_invalidate()
        for u in self.active_units:
            self._refs[u.index] += 1
        self._gather([u.index for u in self.active_units], exact=True)

    def release_all(self, write_back: bool) -> None:
        for u in self.active_units:
            self._refs[u.index] -= 1
        if write_back:
            for f in list(self.groups) + self.frozen:
                f.write_back_()
        self._free_unreferenced()

    @contextmanager
    def frozen_whole(self, write_back: bool = False):
        """Between steps: the frozen params whole inside the block (collective), e.g. for a
        checkpoint's extras; write_back: keep changes made inside (on a normal exit only)."""
        param_offload.new_pass(self)
        self._hpz_invalidate()
        for f in self.frozen:
            if f.quantized:  # left from a forward with qwZ pieces: exact here
                self._drop(f)
            f.start_gather(self.comm.shard, self._label(f))
        for f in self.frozen:
            f.finish_gather()
        ok = False
        try:
            yield
            ok = True
        finally:
            for f in self.frozen:
                if ok and write_back:
                    f.write_back_()
                f.free()

    @property
    def all_gathered(self) -> bool:
        return all(f.gathered for f in list(self.groups) + self.frozen)
