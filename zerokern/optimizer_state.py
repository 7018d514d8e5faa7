"""ZeroAdamW's own state dict: this rank's shard of the optimizer state, for the same model,
stage, precision, world size and rank (zerokern.checkpoint reshards across all of them)."""

from __future__ import annotations

from typing import Any, Dict


class StateDictMixin:
    """state_dict / load_state_dict of ZeroAdamW (needs flat_groups, param_groups, scaler,
    comm, stage, precision, model_watch and grad_sync)."""

    def _meta(self) -> Dict[str, Any]:
        return {"rule": self.rule.name, "rules": [r.name for r in self.rules],
                "stage": self.stage, "precision": self.precision,
                "world_size": self.comm.shard.world_size, "rank": self.comm.shard.rank,
                # block-aligned slots (8-bit: partition.py) add their alignment, so a state
                # dict of packed slots is refused, not loaded at other offsets
                "layouts": [(g.layout.numel, g.layout.padded_numel, g.layout.bucket_numel,
                             [s.shape for s in g.layout.slots])
                            + ((g.layout.slot_align,) if g.layout.slot_align != 1 else ())
                            for g in self.flat_groups]}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard: moments, masters, step counters, scaler, hyperparameters (and at
        stage 3 the param shard, which the model's own state_dict cannot give)."""
        self._frozen_skip.check_savable("state_dict()")
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in self.param_groups]
        return {"zero": self._meta(),
                "state": [{k: t.detach().clone() for k, t in g.state_tensors().items()}
                          for g in self.flat_groups],
                "param_groups": groups,
                "loss_scaler": self.scaler.state_dict(),
                # per buffer, the per-matrix states this rank owns (a phased rule's: zerokern.
                # rules [Note: state kinds and the owner protocol]), "slot.name" -> tensor
                "matrix": [{f"{i}.{name}": t.detach().clone() for i, name, t in st.items()}
                           for st in self._matrix_states()]}

    def _matrix_states(self):
        """Per buffer, its plan's MatrixStates, or an empty one."""
        plans = getattr(self, "_plans", {})
        return [getattr(plans.get(gi), "states", None) or _NO_STATES
                for gi in range(len(self.flat_groups))]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a `state_dict()` of the same model, stage, precision, world size and rank.

        Args:
            state_dict: what `state_dict()` returned on this rank (use zerokern.checkpoint to
                change world size, stage or precision).

        Raises:
            ValueError: not a ZeroAdamW state dict, or one of another stage, precision, world
                size, rank or layout (naming which).
        """
        if not isinstance(state_dict, dict) or "zero" not in state_dict:
            raise ValueError("state_dict is not a ZeroAdamW state dict (no 'zero' entry); "
                             "use zerokern.checkpoint to reshard across layouts")
        meta, mine = state_dict["zero"], self._meta()
        for key in ("rule", "rules", "stage", "precision", "world_size", "rank", "layouts"):
            # a state dict saved before rules existed is ZeroAdamW's; before a rule per
            # group, "rule" is every group's
            default = {"rule": "adamw", "rules": [meta.get("rule", "adamw")] *
                       len(mine["rules"])}.get(key)
            if meta.get(key, default) != mine[key]:
                raise ValueError(f"state_dict {key} {meta.get(key)!r} does not match this "
                                 f"optimizer's {mine[key]!r}")
        states, groups = state_dict["state"], state_dict["param_groups"]
        for g, st in zip(self.flat_groups, states):
            for k, t in g.state_tensors().items():
                if k not in st or st[k].shape != t.shape or st[k].dtype != t.dtype:
                    raise ValueError(f"state_dict entry {k!r} is missing or mis-shaped")
        matrix = state_dict.get("matrix", [{}] * len(self.flat_groups))
        for st, saved in zip(self._matrix_states(), matrix):
            for i, name, t in st.items():
                v = saved.get(f"{i}.{name}")
                if v is None or v.shape != t.shape or v.dtype != t.dtype:
                    raise ValueError(f"state_dict per-matrix entry {i}.{name} is missing or "
                                     "mis-shaped")
        # The scaler checks its entry before writing anything; ours are checked above.
        self.scaler.load_state_dict(state_dict["loss_scaler"])
        for g, st in zip(self.flat_groups, states):
            for k, t in g.state_tensors().items():
                t.copy_(st[k])
        for st, saved in zip(self._matrix_states(), matrix):
            for i, name, t in st.items():
                t.copy_(saved[f"{i}.{name}"])
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state_loaded()

    def state_loaded(self) -> None:
        """The masters were just loaded (state_dict, zerokern.checkpoint): they define the
        state, so param writes made before the load are not taken into them again."""
        if self.model_watch is not None:
            self.model_watch.record_versions()
        self.grad_sync.generation += 1


class _NoStates:
    """No per-matrix states (a buffer whose rule has none)."""

    @staticmethod
    def items():
        return iter(())


_NO_STATES = _NoStates()
