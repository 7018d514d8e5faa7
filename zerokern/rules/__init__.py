"""The optimizer-rule interface: what one optimizer (AdamW, Lion, ...) declares to the ZeRO engine.

[Note: a rule and the engine]
The engine (optimizer.ZeroOptimizer) owns everything that does not depend on the update:
the layout, the stages, the grads and their reduction, the loss scale and clipping, the fp32
master, where the state lives (placement.py, offload.py, offload_nvme.py), checkpoints and the
accounting. A rule owns the rest:
- `states`: its per-element state tensors (`StateSpec`: name, dtype, bytes per element,
  whether it shards like the param). Every placement allocates `master` plus these; the
  checkpoint writes one section per name (after `master`); `memory_report`, `estimate` and the
  formula count them by name, so K = 4 (the fp32 master) + sum of their bytes per element.
- `step_`: the update over one flat piece (master, the states in declared order, the grad, the
  16-bit param out, the device step counter, grad_scale and found_inf), which dispatches to a
  kernel per backend (reference / cpu / triton / cuda); the contract of DESIGN §3 holds for
  every rule: skipped bitwise on found_inf (step included), cast-back bitwise `.to(dtype)`.
- `defaults` and `check_group`: the hyperparameters of a param group and their checks, and
  `hyper(group)`: the keyword arguments `step_` takes from a group.
A rule is stateless (a plain object); several optimizers may share one.
The indirection costs one Python call per bucket: AdamW through `ADAMW.step_(...,
**ADAMW.hyper(group))` against `kernels.adam_step_` called directly, n = 128, cpu backend,
interleaved 7 x 2000 calls on the shared 2-core VM (load ~20): medians 349 vs 338 us per
call, minima 174 vs 206 us, i.e. within the noise of the kernel call's own argument checks.

[Note: a rule's keys]
A rule's `defaults` names its hyperparameters: `ZeroOptimizer(defaults=...)` may hold those keys
only (`check_defaults`: `ZeroOptimizer(rule=LION, defaults={..., "eps": 1e-8})` is a ValueError
naming "eps" and the rule, never a hyperparameter silently unused). A param group may carry
other keys, as torch's optimizers allow (a "name", a scheduler's "initial_lr", Megatron's
"lr_mult"), but not one that names a hyperparameter this rule does not have
(`check_group_keys`): a key of another optimizer (`OTHER_HYPERPARAMETERS`: torch's, Muon's,
lion-pytorch's, zerokern's) or a near-miss of one of its own ("weight_decy"), either of which
the user meant to change the update. A rule whose `defaults` is empty declares no keys and
is not checked.

[Note: a rule per param group]
An engine holds one rule per param group (`ZeroOptimizer(rule=[...])`; ZeroMuon: Muon for the
matrices' groups, AdamW for the rest). Each buffer belongs to one group (`buffer.group_index`)
and so has one rule: the placement allocates that rule's states for it (`rule_for`),
the reports count them by name, a checkpoint section holds only the buffers that have it
(checkpoint/format.py). Where one name must stand for the optimizer (reports, checkpoint
metadata), `combine(rules)` gives the rule itself when every group has the same one (so
ZeroAdamW and ZeroLion are unchanged), else a `MixedRules` whose states are the union by name
in first-seen order and whose name joins the rules' names ("muon+adamw").
A rule whose update needs more than one piece at a time sets `phased = True` and provides a
group step instead of `step_` (zerokern.rules.muon: momentum per piece, Newton-Schulz on whole
matrices across ranks, then the update per piece); the engine runs it per buffer through the
declared protocol of [Note: state kinds and the owner protocol].

[Note: state kinds and the owner protocol]
A StateSpec is of one of three kinds (`StateSpec.kind`):
- ELEMENT: one element per param element, sharded like the param (AdamW's, Lion's, Muon's);
- BLOCK: one element per `block` param elements, sharded like the param (8-bit AdamW's absmax);
- MATRIX: per param, whole, held by the param's owner rank (Adafactor's row and column
  statistics, its 1-D params' variance, its per-param step): `shape_of(param shape)` gives
  the state's shape (None: that param has none). These are declared in `matrix_states`, never
  in `states` (which every placement allocates per element); the owner's tensors, their numel,
  bytes, views and their resharding (by param, whole, owner-free) are answered in one place,
  rules/matrix_states.py (`MatrixStates`, `matrix_state_numel`).
The phased protocol, for any phased rule (Muon, Adafactor):
- `plan(g, comm_shard)`, once per buffer at construction: an object with `owner` (slot ->
  rank; rules/owners.py [Note: one owner per matrix]) and, for a rule with matrix states,
  `states` (its MatrixStates) - Muon's plan is its ShardedOrthogonalizer;
- `group_step_(g, grads, plan, *, grad_scale, found_inf, after_piece, place, gi, unused,
  **hyper)` per buffer and step: passes over the pieces through `place.map_piece_` (the
  states they name: `nvme_passes`), the whole-matrix phase on the owners (`plan.gather_` /
  `plan.scatter_`), then per bucket the params written and `after_piece(k)` called.
  `unused`: (n_slots,) device bool, True for a param no rank used this step (frozen_slots.py
  [Note: a param no rank used]): the engine restores the element states and the master
  around the passes; a matrix state is the rule's to leave as it was.

[Note: per-element and per-block states]
Every state shards like the param (`sharded`); a rule declaring another kind raises at
construction (`check_rule`), never a silent mis-layout. A state holds one element per
`block` param elements: block 1 (AdamW's fp32 moments, Lion's) or a per-block state such as the
fp32 absmax of 8-bit AdamW's 128-element quantization blocks (rules/adamw8bit.py). A block
state works because every piece of state a placement hands a kernel is a whole number of
blocks: state ranges are made of pieces of buckets, each a multiple of partition.ALIGN = 128
elements starting at a multiple of 128 (partition.py), and `block` must divide ALIGN
(`check_rule`). `RuleState.views` cuts every state for an element range and raises if the range
would cut a block, so a mis-layout (a block straddling two ranks' pieces) is an error, never a
silently wrong scale. The dtypes a state may have: fp32, or uint8 codes (1 byte per element);
`bytes_per_elem` must be itemsize / block (the formula's K term, exact). The NVMe files hold
any such state, each in its own dtype and padded to aligned I/O (state/nvme_state.py [Note:
any StateSpec in a file, aligned]). A buffer whose rule has per-block states starts every
param's slot on a block boundary (`slot_align`, partition.py [Note: block-aligned slots]), so
no block is shared by two params: a param no rank used is skipped on its own blocks
(frozen_slots.py). A param frozen after construction is still refused with such a rule.

[Note: what a rule supports]
Whether a rule runs with a placement or a master is the rule's to say, not the engine's to
guess from a type: `rule.unsupported(offload=, master=)` gives (argument, why) for the first
it cannot run with, or None. The engine (optimizer_args.check_rule_support, for every group's
rule, before anything changes), zerokern.initialize and the estimate ask it. A per-piece rule
runs everywhere: its `step_` is what the NVMe pool and the compact master's chunks call. A
phased rule says so with:
- `nvme_passes`: the states each pass of its group step reads and writes per piece through
  `placement.map_piece_`, in order (Muon: ("momentum_buffer",) then ("master",)); the NVMe
  placement plans its reads from it (state/offload_nvme.py [Note: a phased rule over NVMe]).
  None (the default): offload="nvme" is refused.
- `nvme_read_passes`: the indices of the passes in `nvme_passes` whose function changes none
  of the views it is given (Adafactor's pass 1 reads the master into its exchange): the NVMe
  placement reads their chunks and writes nothing back. Every state such a pass names must be
  written by another pass (the step's flip needs the other half whole), else offload="nvme"
  is refused.
- `compact_master_ok`: its group step reads and writes the master only through
  `map_piece_` (which expands and compacts a compact master chunk by chunk); False (the
  default for a phased rule): master="compact" is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

ELEMENT, BLOCK, MATRIX = "element", "block", "matrix"  # StateSpec.kind


@dataclass(frozen=True)
class StateSpec:
    """One per-element state tensor of a rule."""

    name: str                           # a checkpoint section and a report category
    dtype: torch.dtype = torch.float32
    bytes_per_elem: float = 4.0         # bytes per state element (the formula's K term)
    sharded: bool = True                # sharded like the param
    block: int = 1                      # param elements per state element (Note: per-block)
    scales: Optional[str] = None        # a per-block state: the uint8 code state it scales
    signed: bool = True                 # ...whose codes use the signed map (kernels/quant8.py)
    # a per-matrix state (kind MATRIX, sharded False): param shape -> the state's shape, or
    # None where that param has none ([Note: state kinds and the owner protocol])
    shape_of: Optional[Callable[[Tuple[int, ...]], Optional[Tuple[int, ...]]]] = None

    @property
    def kind(self) -> str:
        """ELEMENT, BLOCK or MATRIX ([Note: state kinds and the owner protocol])."""
        return MATRIX if self.shape_of is not None else BLOCK if self.block != 1 else ELEMENT

    def numel(self, n: int) -> int:
        """State elements for `n` param elements (n a multiple of `block`)."""
        return n // self.block

    @property
    def plain(self) -> bool:
        """One fp32 element per param element (what the NVMe files hold)."""
        return self.block == 1 and self.dtype == torch.float32


class Rule:
    """Base of the optimizer rules. Subclasses set `name`, `states`, `defaults` and implement
    `check_group`, `hyper` and `step_`."""

    name: str = ""
    states: Tuple[StateSpec, ...] = ()
    # per-matrix states, on each param's owner (phased rules only; [Note: state kinds and the
    # owner protocol])
    matrix_states: Tuple[StateSpec, ...] = ()
    defaults: Dict[str, Any] = {}
    # True: the update is not per piece; the engine runs the rule's group step over a whole
    # buffer ([Note: a rule per param group]), and `step_` is not used.
    phased: bool = False
    # False: the update ignores the step count (frozen_slots.py need not re-run it for a
    # param whose count lags).
    counts_steps: bool = True
    # [Note: what a rule supports]: a phased rule's passes over its states (None: no NVMe),
    # and whether its group step handles a compact master (None: True unless phased).
    nvme_passes: Optional[Tuple[Tuple[str, ...], ...]] = None
    nvme_read_passes: Tuple[int, ...] = ()
    compact_master_ok: Optional[bool] = None

    def unsupported(self, offload=None, master: str = "fp32") -> Optional[Tuple[str, str]]:
        """What this rule cannot run with ([Note: what a rule supports]).

        Args:
            offload: None, "cpu" or "nvme" (the engine's offload=).
            master: "fp32" or "compact" (the engine's master=).

        Returns:
            None if the rule runs with both, else (the argument's name, why not).
        """
        if offload == "nvme" and self.phased and self.nvme_passes is None:
            return ("offload", f"offload='nvme' is not supported by the {self.name!r} rule: "
                               "its phased update declares no nvme_passes (the states it "
                               "streams per piece); use offload=None or 'cpu'")
        if offload == "nvme" and self.phased:
            bad = self._unwritten_read_passes()
            if bad:
                return ("offload", f"offload='nvme' is not supported by the {self.name!r} "
                                   f"rule: {bad}")
        ok = self.compact_master_ok
        if master == "compact" and (self.phased if ok is None else not ok):
            return ("master", f"master='compact' is not supported by the {self.name!r} rule: "
                              "its update reads the master other than through the placement's "
                              "map_piece_; use master='fp32'")
        return None

    def _unwritten_read_passes(self) -> Optional[str]:
        """Why nvme_read_passes is not a valid declaration (None if it is): an index outside
        nvme_passes, or a state that only read passes name (its other half would never be
        written before the step's flip)."""
        n = len(self.nvme_passes)
        for i in self.nvme_read_passes:
            if not (isinstance(i, int) and 0 <= i < n):
                return f"its nvme_read_passes names pass {i!r} of {n}"
        written = {name for i, p in enumerate(self.nvme_passes)
                   if i not in self.nvme_read_passes for name in p}
        unwritten = sorted({name for i in self.nvme_read_passes for name in self.nvme_passes[i]}
                           - written)
        if unwritten:
            return (f"its nvme_read_passes only read {unwritten}, which no other pass writes "
                    "(the state files' other half would never be written)")
        return None

    @property
    def state_names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def k_bytes(self) -> float:
        """Bytes of rule state per param element (without the master)."""
        return float(sum(s.bytes_per_elem for s in self.states))

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        """ValueError/TypeError naming a bad hyperparameter of `group` (before any change)."""
        raise NotImplementedError

    def _takes(self) -> str:
        return f"it takes {', '.join(self.defaults)}"

    def check_defaults(self, defaults: Dict[str, Any], where: str = "defaults") -> None:
        """Every key of `defaults` is one of this rule's hyperparameters ([Note: a rule's
        keys]).

        Args:
            defaults: the engine's `defaults=` dict.
            where: what to call it in the error.

        Raises:
            ValueError: naming the first other key and the rule.
        """
        if not self.defaults:
            return
        for k in defaults:
            if k not in self.defaults:
                raise ValueError(f"{where}: {k!r} is not a hyperparameter of the {self.name!r} "
                                 f"rule ({self._takes()}): the update would not use it")

    def check_group_keys(self, keys, where: str = "", allowed=()) -> None:
        """No key of a param group names a hyperparameter this rule does not have: another
        optimizer's, or a near-miss of one of its own ([Note: a rule's keys]).

        Args:
            keys: the keys the user gave in the group ("params" is skipped).
            where: e.g. "param group 2".
            allowed: further keys the optimizer itself reads from a group (ZeroMuon's
                use_muon).

        Raises:
            ValueError: naming the key, the group and the rule.
        """
        if not self.defaults:
            return
        import difflib

        own = tuple(self.defaults)
        for k in keys:
            if k == "params" or k in own or k in allowed or not isinstance(k, str):
                continue
            near = difflib.get_close_matches(k, own, n=1, cutoff=0.85)
            if k in OTHER_HYPERPARAMETERS or near:
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(f"{where + ': ' if where else ''}{k!r} is not a "
                                 f"hyperparameter of the {self.name!r} rule ({self._takes()})"
                                 f"{hint}: the update would not use it (torch's optimizers "
                                 "ignore unknown group keys; zerokern refuses a key that "
                                 "names a hyperparameter)")

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The keyword arguments of `step_` taken from a param group."""
        raise NotImplementedError

    def step_(self, master: torch.Tensor, states, grad: torch.Tensor,
              param_out: Optional[torch.Tensor], *, step: torch.Tensor,
              grad_scale: torch.Tensor, found_inf: torch.Tensor, backend: str,
              **hyper) -> None:
        """One fused update of a flat piece, in place (DESIGN §3 contract for every rule)."""
        raise NotImplementedError

    # -- the phased protocol ([Note: state kinds and the owner protocol]) ------------------------
    def plan(self, g, comm_shard):
        """A phased rule's plan of buffer `g` over the shard group (owners; matrix states)."""
        raise NotImplementedError(f"the {self.name!r} rule is not phased")

    def group_step_(self, g, grads: List[torch.Tensor], plan, *, grad_scale: torch.Tensor,
                    found_inf: torch.Tensor, after_piece, place=None, gi: int = 0,
                    unused: Optional[torch.Tensor] = None, **hyper) -> None:
        """A phased rule's step over buffer `g` (see the Note)."""
        raise NotImplementedError(f"the {self.name!r} rule is not phased")


# Hyperparameter names of other optimizers ([Note: a rule's keys]): zerokern's rules (AdamW's
# `adamw`, ZeroMuon's `use_muon`), torch.optim's (Adam/AdamW, SGD, Muon, RMSprop, Adagrad,
# Adadelta, NAdam, Rprop, ASGD; not the implementation switches foreach / fused / capturable /
# differentiable, which change no value) and lion-pytorch's. In a param group of a rule that
# lacks one, such a key is an error.
OTHER_HYPERPARAMETERS = frozenset((
    "lr", "betas", "eps", "weight_decay", "adamw", "use_muon", "amsgrad", "maximize",
    "decoupled_weight_decay", "momentum", "dampening", "nesterov", "ns_coefficients",
    "ns_steps", "adjust_lr_fn", "alpha", "centered", "rho", "lr_decay",
    "initial_accumulator_value", "momentum_decay", "etas", "step_sizes", "lambd", "t0",
    "cautious_factor"))


def check_defaults_keys(rules, defaults: Dict[str, Any]) -> None:
    """`defaults` of an engine with a rule per param group: each key is a hyperparameter of
    at least one of the rules (it fills the groups that lack it; [Note: a rule's keys]).

    Args:
        rules: the groups' rules.
        defaults: the engine's `defaults=` dict.

    Raises:
        ValueError: naming the key and the rules.
    """
    rules = [r for r in dict.fromkeys(rules) if r.defaults]
    if not rules:
        return
    for k in defaults:
        if not any(k in r.defaults for r in rules):
            names = ", ".join(repr(r.name) for r in rules)
            raise ValueError(f"defaults: {k!r} is not a hyperparameter of any of the rules "
                             f"({names}): the update would not use it")


def check_rule(rule) -> Rule:
    """The rule an engine is built with: a Rule whose states the placements can hold."""
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a zerokern.rules.Rule, got {type(rule).__name__}")
    names = rule.state_names + tuple(s.name for s in rule.matrix_states)
    if not names or len(set(names)) != len(names) or "master" in names or "steps" in names \
            or "params" in names:
        raise ValueError(f"rule {rule.name!r}: state names must be unique, non-empty and not "
                         f"'master', 'steps' or 'params', got {names}")
    for s in rule.matrix_states:  # [Note: state kinds and the owner protocol]
        if s.kind != MATRIX or s.sharded or s.dtype != torch.float32 or not rule.phased:
            raise ValueError(f"rule {rule.name!r}: matrix state {s.name!r} must be fp32, "
                             "declare shape_of and sharded=False, and its rule be phased "
                             "([Note: state kinds and the owner protocol])")
    from zerokern.geometry.partition import ALIGN

    for s in rule.states:
        ok = s.sharded and s.dtype in STATE_DTYPES and isinstance(s.block, int) \
            and s.block >= 1 and ALIGN % s.block == 0 \
            and s.bytes_per_elem == s.dtype.itemsize / s.block
        if not ok:
            raise ValueError(f"rule {rule.name!r}: state {s.name!r} must shard like the param, "
                             f"be fp32 or uint8, hold one element per `block` param elements "
                             f"with block dividing {ALIGN}, and declare bytes_per_elem = "
                             "itemsize / block ([Note: per-element and per-block states])")
        # A checkpoint stores a per-block state expanded and rebuilds it with the codes it
        # scales (checkpoint/block_states.py): it must say which.
        codes = {c.name: c for c in rule.states}.get(s.scales)
        if (s.block == 1) != (s.scales is None) or (s.scales is not None and (
                codes is None or codes.dtype != torch.uint8 or codes.block != 1)):
            raise ValueError(f"rule {rule.name!r}: state {s.name!r}: a per-block state (block "
                             "> 1) is a scale and names, as `scales`, the per-element uint8 code "
                             "state of the same rule it scales; a per-element state names none "
                             f"(got block={s.block}, scales={s.scales!r})")
    return rule


STATE_DTYPES = (torch.float32, torch.uint8)


def has_block_states(rule) -> bool:
    """Some state of `rule` is not one fp32 element per param element (8-bit AdamW's)."""
    return any(not s.plain for s in rule.states)


def slot_align(rule) -> int:
    """Where each param's slot starts in a buffer whose group has `rule`: a multiple of its
    largest per-block state's block (8-bit AdamW: 128), or anywhere (1) without per-block
    states (partition.py [Note: block-aligned slots])."""
    return max((s.block for s in getattr(rule, "states", ())), default=1)


def cut_states(states: Dict[str, torch.Tensor], blocks: Dict[str, int], lo: int,
               hi: int) -> List[torch.Tensor]:
    """Each state's part for state elements [lo, hi) (in per-element coordinates), in order.

    Raises:
        ValueError: [lo, hi) cuts a block of a per-block state (a mis-layout, never silent).
    """
    out = []
    for name, t in states.items():
        b = blocks.get(name, 1)
        if lo % b or hi % b:
            raise ValueError(f"state {name!r}: elements [{lo}, {hi}) cut its {b}-element "
                             "blocks (zerokern.rules [Note: per-element and per-block states])")
        out.append(t[lo // b:hi // b])
    return out


class RuleState:
    """One buffer's optimizer state, wherever a placement keeps it: `master` ((S,) fp32, or
    None where the params are the master), `states` (name -> (S,) tensor, in the rule's order)
    and `steps` ((n_buckets,) int64). A rule's state is read by name: `st.states[name]`, or
    as an attribute (`getattr(st, name)`) for the names the rule declares."""

    master: Optional[torch.Tensor]
    states: Dict[str, torch.Tensor]
    steps: torch.Tensor
    blocks: Dict[str, int] = {}  # name -> block, for the per-block states (others: 1)
    scaled: Dict[str, Tuple[str, bool]] = {}  # per-block scale -> (its codes, signed map)

    def index_states(self, rule: Rule) -> None:
        """`blocks` and `scaled` from `rule`'s StateSpecs (every placement's state calls it)."""
        self.blocks = {s.name: s.block for s in rule.states if s.block != 1}
        self.scaled = {s.name: (s.scales, s.signed) for s in rule.states if s.scales is not None}

    def views(self, sl: slice) -> List[torch.Tensor]:
        """The rule's states for state elements `sl` (per-element coordinates), in order;
        ValueError if `sl` cuts a block ([Note: per-element and per-block states])."""
        return cut_states(self.states, self.blocks, sl.start, sl.stop)

    def __getattr__(self, name: str):
        states = self.__dict__.get("states")
        if states is not None and name in states:
            return states[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def device_tensors(self) -> Dict[str, torch.Tensor]:
        """Category -> tensor of what it holds on the device (memory_report)."""
        out = {} if self.master is None else {"master": self.master}
        out.update(self.states)
        return out

    def device_buffers(self, padding: int) -> Iterator[Tuple[str, torch.Tensor, int]]:
        """(category, tensor, padding elements) of every device tensor it holds (a per-block
        state's padding: its blocks made of padding only, `padding // block`; the padding is
        the tail of a rank's state)."""
        for cat, t in self.device_tensors().items():
            yield cat, t, padding // self.blocks.get(cat, 1)


def alloc_states(rule, n: int, make) -> Dict[str, torch.Tensor]:
    """The rule's zero-filled states for `n` param elements: `make(numel, dtype)` allocates."""
    return {s.name: make(s.numel(n), s.dtype).zero_() for s in rule.states}


class MixedRules(Rule):
    """The optimizer-wide view of several rules ([Note: a rule per param group]): the union
    of their states by name, a joined name. It updates nothing: each buffer runs its own."""

    def __init__(self, rules) -> None:
        self.rules = tuple(dict.fromkeys(rules))  # distinct, in first-seen order
        self.name = "+".join(r.name for r in self.rules)
        seen: Dict[str, StateSpec] = {}
        for r in self.rules:
            for s in r.states:
                seen.setdefault(s.name, s)
        self.states = tuple(seen.values())
        per_matrix: Dict[str, StateSpec] = {}
        for r in self.rules:
            for s in r.matrix_states:
                per_matrix.setdefault(s.name, s)
        self.matrix_states = tuple(per_matrix.values())

    def check_group(self, group, where: str = "") -> None:
        raise NotImplementedError("MixedRules checks no group: each group has its own rule")

    def hyper(self, group):
        raise NotImplementedError("MixedRules has no hyperparameters: each group has its rule")


def combine(rules) -> Rule:
    """One rule standing for per-group `rules` (reports, checkpoint metadata): the rule itself
    when all are the same, else their MixedRules."""
    rules = list(rules)
    if not rules:
        raise ValueError("combine() needs at least one rule")
    if all(r is rules[0] for r in rules):
        return rules[0]
    return MixedRules(rules)


def map_in_memory_(g, k: int, names, fn, params: bool) -> None:
    """A placement's map_piece_ (state/placement.py) where the state is in memory (device or
    host): one call `fn(a, b, views)` on bucket k's views of `names`, state elements [a, b);
    with params the master piece is cast into the params (the buffer's codec: `.to(dtype)`
    bitwise; a scaled codec encodes at publish instead). "master" at
    fp32 on the device is the params themselves."""
    sl = g.state_slice(k)
    views = [g.master_piece(k) if n == "master" else g.rule_states[n][sl] for n in names]
    fn(sl.start, sl.stop, views)
    out = g.param_out_piece(k) if params else None
    if out is not None:
        master = views[names.index("master")]
        # Host state (offload="cpu"): the pinned master goes to the device params without a
        # host wait, ordered on the current stream (the host next writes this master after
        # the next step's grads landed, which that stream computes after this copy). Found by
        # the fake-CUDA run of ZeroMuon with offload="cpu" (tests/gpu_control): a blocking
        # H2D copy per piece.
        g.codec.cast_(out, master,
                      non_blocking=master.device != out.device and master.is_pinned())


def rule_for(placement, buf) -> Rule:
    """The rule of buffer `buf`: its param group's where the placement holds one rule per
    group (zerokern.rules [Note: a rule per param group]), else the placement's one rule."""
    rules = getattr(placement, "rules", None)
    return placement.rule if rules is None else rules[buf.group_index]
