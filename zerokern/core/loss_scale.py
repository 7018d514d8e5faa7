"""Device-side loss scaling (DESIGN §2 step 3): the scale and its update never leave the device.

The optimizer reads ``scaler.scale`` (a 0-d fp32 device tensor, updated in place, never replaced)
and calls ``scaler.update_(found_inf)`` once per step. The update is a handful of tensor ops with
no host synchronisation, so ``opt.step()`` can run ahead of the device.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Mapping

import torch

from zerokern.options.args import check_precision
from zerokern.platform.device import handle

__all__ = ["LossScaler", "DynamicLossScaler", "make_loss_scaler"]

_DYNAMIC_KWARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
                   "min_scale", "hysteresis")
_INT32_MAX = 2**31 - 1


def _real(name: str, value: Any) -> float:
    # bool is an int subclass; True as a loss scale is almost surely a config mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _scale_value(name: str, value: Any) -> float:
    value = _real(name, value)
    # The scale lives in fp32: a value that rounds to 0 or inf there would be silently wrong.
    as_fp32 = float(torch.tensor(value, dtype=torch.float32))
    if value <= 0 or as_fp32 <= 0 or not math.isfinite(as_fp32):
        raise ValueError(f"{name} must be positive and finite in float32, got {value!r}")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if not 1 <= int(value) <= _INT32_MAX:  # the counters are int32 device tensors
        raise ValueError(f"{name} must be an int >= 1 (and <= {_INT32_MAX}), got {value!r}")
    return int(value)


class LossScaler:
    """Static loss scale, and the interface the optimizer relies on.

    Args:
        scale: The loss scale, positive and finite in float32.
        device: Device that holds the scale (where the gradients live).

    Attributes:
        scale: 0-d float32 tensor on ``device``. Updated in place, never replaced, so the
            optimizer may keep a reference to it.
        dynamic: Whether ``update_`` ever changes the scale.
    """

    dynamic = False
    _TENSORS = ("scale",)

    def __init__(self, scale: float, device: torch.device | str) -> None:
        value = _scale_value("scale", scale)
        self.scale = torch.full((), value, dtype=torch.float32, device=torch.device(device))

    def _found(self, found_inf: torch.Tensor) -> torch.Tensor:
        # Metadata checks only (no sync); accepts GradScaler's float found_inf too.
        if not isinstance(found_inf, torch.Tensor):
            raise TypeError(f"found_inf must be a torch.Tensor, got {type(found_inf).__name__}")
        if found_inf.numel() != 1 or found_inf.device != self.scale.device:
            raise ValueError(f"found_inf must be a one-element tensor on {self.scale.device}, got "
                             f"shape {tuple(found_inf.shape)} on {found_inf.device}")
        found = found_inf.reshape(())
        return found if found.dtype == torch.bool else found != 0

    def update_(self, found_inf: torch.Tensor) -> None:
        """Updates the scale after a step (0-d bool ``found_inf``); a no-op when static."""
        self._found(found_inf)

    def to_(self, device) -> None:
        """Move the scaler's tensors (the model moved; see model_sync.py)."""
        for name in self._TENSORS:
            setattr(self, name, getattr(self, name).to(device))

    def hit_min_scale(self) -> bool:
        """Whether the last step overflowed at the minimum scale. Always False when static."""
        return False

    def state_dict(self) -> Dict[str, Any]:
        """Returns the state with tensors cloned to the CPU (a snapshot, not views)."""
        sd: Dict[str, Any] = {"kind": "dynamic" if self.dynamic else "static"}
        for name in self._TENSORS:
            sd[name] = getattr(self, name).detach().to("cpu", copy=True)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copies a ``state_dict()`` back in place, bitwise; validates everything first.

        Args:
            state_dict: Output of ``state_dict()`` from a scaler of the same kind.

        Raises:
            ValueError: Wrong kind, missing keys, or tensors of the wrong dtype or shape.
        """
        kind = "dynamic" if self.dynamic else "static"
        got = state_dict.get("kind") if isinstance(state_dict, Mapping) else type(state_dict)
        if got != kind:
            raise ValueError(f"state_dict must come from a {kind} loss scaler, got {got!r}")
        for name in self._TENSORS:  # check all before copying any: no half-loaded state
            mine, theirs = getattr(self, name), state_dict.get(name)
            if not isinstance(theirs, torch.Tensor) or theirs.dtype != mine.dtype or theirs.dim():
                raise ValueError(f"state_dict[{name!r}] must be a 0-d {mine.dtype} tensor, "
                                 f"got {theirs!r}")
        for name in self._TENSORS:
            getattr(self, name).copy_(state_dict[name])


class DynamicLossScaler(LossScaler):
    """Dynamic loss scale: torch.amp.GradScaler's rules plus DeepSpeed's optional hysteresis.

    Per ``update_(found_inf)``, all on the device:

    * overflow: ``growth_tracker = 0``; if ``hysteresis_left <= 1`` the scale backs off to
      ``max(scale * backoff_factor, min_scale)``, else ``hysteresis_left -= 1`` (scale kept);
    * clean step: ``growth_tracker += 1``; when it reaches ``growth_interval`` the scale grows by
      ``growth_factor`` (unless that is inf in fp32), the tracker resets and
      ``hysteresis_left`` refills to ``hysteresis``.

    With ``hysteresis=1`` and a ``min_scale`` that never binds, the sequence of scales and
    trackers is bitwise that of ``torch._amp_update_scale_`` (GradScaler.update).

    Args:
        device: Device that holds the state.
        init_scale: Initial scale (GradScaler default 2**16).
        growth_factor: Factor applied after ``growth_interval`` clean steps; > 1.
        backoff_factor: Factor applied on overflow; in (0, 1).
        growth_interval: Consecutive clean steps before growing; >= 1.
        min_scale: Floor for back-off; in (0, init_scale]. GradScaler has none.
        hysteresis: Overflows tolerated before backing off (DeepSpeed ``delayed_shift``); >= 1.
    """

    dynamic = True
    _TENSORS = ("scale", "growth_tracker", "hysteresis_left")

    def __init__(self, device: torch.device | str, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, hysteresis: int = 1) -> None:
        init_scale = _scale_value("init_scale", init_scale)
        self.growth_factor = _real("growth_factor", growth_factor)
        if self.growth_factor <= 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        self.backoff_factor = _real("backoff_factor", backoff_factor)
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        self.growth_interval = _count("growth_interval", growth_interval)
        self.hysteresis = _count("hysteresis", hysteresis)
        self.min_scale = _scale_value("min_scale", min_scale)
        if self.min_scale > init_scale:
            raise ValueError(f"min_scale must be <= init_scale ({init_scale!r}), got {min_scale!r}")
        super().__init__(init_scale, device)
        dev = self.scale.device
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self.hysteresis_left = torch.full((), self.hysteresis, dtype=torch.int32, device=dev)
        # Pinned so the per-step device->host copy is truly asynchronous on a GPU.
        self._hit_host = torch.zeros((), dtype=torch.bool,
                                     pin_memory=handle(dev).pins_host_memory)

    def update_(self, found_inf: torch.Tensor) -> None:
        """Updates scale, growth tracker and hysteresis in place, without host synchronisation.

        Args:
            found_inf: 0-d bool tensor on the scale's device, True if any gradient overflowed.
                A float tensor (GradScaler's convention, nonzero = overflow) is accepted too.
        """
        found = self._found(found_inf)
        scale, tracker, hyst = self.scale, self.growth_tracker, self.hysteresis_left
        # Products in float64 then rounded once to fp32: that is what _amp_update_scale_ does
        # (float * double in C++), so non-power-of-two factors still match it bitwise.
        scale64 = scale.double()
        grown = (scale64 * self.growth_factor).float()
        backed = (scale64 * self.backoff_factor).clamp_min(self.min_scale).float()
        clean_count = tracker + 1
        # >= rather than ==: a loaded tracker beyond a smaller interval still grows (normally ==).
        grow = (~found) & (clean_count >= self.growth_interval)
        # DeepSpeed DynamicLossScaler.update_scale (consecutive_hysteresis=False): back off when
        # `delayed_shift == 1 or cur_hysteresis == 1` and leave cur_hysteresis at 1, so further
        # overflows keep backing off; otherwise `cur_hysteresis -= 1`. cur_hysteresis is refilled
        # only when the scale grows. Any overflow restarts the growth window (last_overflow_iter).
        back = found & (hyst <= 1)
        # GradScaler's guard: never grow to inf in fp32 (the tracker still resets).
        new_scale = torch.where(grow & torch.isfinite(grown), grown,
                                torch.where(back, backed, scale))
        new_tracker = torch.where(found | grow, 0, clean_count)
        new_hyst = torch.where(grow, self.hysteresis, torch.where(found & ~back, hyst - 1, hyst))
        hit = found & (scale <= self.min_scale)  # overflow while already at the floor
        self._hit_host.copy_(hit, non_blocking=True)
        scale.copy_(new_scale)
        tracker.copy_(new_tracker)
        hyst.copy_(new_hyst)

    def hit_min_scale(self) -> bool:
        """Whether the latest update saw an overflow with the scale already at ``min_scale``.

        Host diagnostic read from a host copy that ``update_`` queues asynchronously, so it
        never synchronises. On CUDA it reflects the latest update whose copy has landed, which
        may lag the device by a step; on the CPU it is exact. Not sticky: the next step resets it.
        """
        return bool(self._hit_host)


def make_loss_scaler(loss_scale: Any, precision: str,
                     device: torch.device | str) -> LossScaler:
    """Builds the scaler for ``ZeroAdamW(loss_scale=..., precision=...)``.

    Args:
        loss_scale: ``"dynamic"`` or ``None`` (the default for the precision), a positive finite
            number (static scale), or for fp16 a dict of ``DynamicLossScaler`` keyword arguments.
            For bf16/fp32 the default (``"dynamic"`` or ``None``) means a static 1.0, since
            those formats do not underflow the way fp16 does; an explicit number is honoured.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device: Device for the scaler state.

    Raises:
        TypeError, ValueError: Naming ``loss_scale``/``precision`` (or the key) and what is allowed.
    """
    check_precision(precision)
    if loss_scale is None or (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        if precision == "fp16":
            return DynamicLossScaler(device)
        return LossScaler(1.0, device)
    if isinstance(loss_scale, str):
        raise ValueError(f"loss_scale must be 'dynamic', None, a positive finite number"
                         f"{' or a dict' if precision == 'fp16' else ''}, got {loss_scale!r}")
    if isinstance(loss_scale, Mapping):
        if precision != "fp16":
            raise ValueError(f"loss_scale as a dict (dynamic scaling settings) needs "
                             f"precision='fp16', got precision={precision!r}")
        unknown = [k for k in loss_scale if k not in _DYNAMIC_KWARGS]
        if unknown:
            raise ValueError(f"loss_scale has unknown key(s) {unknown!r}; allowed keys: "
                             f"{_DYNAMIC_KWARGS}")
        try:
            return DynamicLossScaler(device, **loss_scale)
        except (TypeError, ValueError) as e:
            raise type(e)(f"loss_scale: {e}") from None
    return LossScaler(_scale_value("loss_scale", loss_scale), device)
