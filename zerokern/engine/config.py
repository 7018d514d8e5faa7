"""DeepSpeed JSON config -> zerokern settings, with DeepSpeed's meaning and units.

Every key is one of three kinds (the tables below):
- honoured: it changes what zerokern does, as DeepSpeed documents (bucket sizes are ELEMENTS in
  DeepSpeed and MiB in zerokern: converted with the element size of the reduce dtype);
- no effect: accepted, and listed once in the start-up log with the reason (zerokern already
  behaves that way, e.g. gradients are always contiguous);
- ignored with a warning where DeepSpeed ignores it too (offload_param below stage 3);
- anything else, or a value zerokern cannot honour (e.g. offload_param on "nvme" with the
  optimizer state elsewhere): ValueError naming the key. Nothing is silently ignored.
Defaults are DeepSpeed 0.19's (gradient_clipping 1.0: [Note: gradient_clipping default]).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from zerokern.options.args import PRECISIONS

from ..checkpointing.settings import parse_section as _activation_checkpointing
from ..stage3.ds_schedule import Stage3Keys
from .config_file import load_config
from .config_values import ConfigError, _bool, _check_auto, _int, _num, _unknown
from .optimizer_types import optimizer_settings
from .parallel import hpz_setting

# key -> reason it has no effect in zerokern (accepted and logged once)
NO_EFFECT_TOP = {
    "zero_allow_untested_optimizer": "zerokern builds ZeroAdamW itself",
    "gradient_predivide_factor": "averaging over ranks is exact in zerokern (DESIGN §3)",
    "prescale_gradients": "averaging over ranks is exact in zerokern (DESIGN §3)",
    "memory_breakdown": "use optimizer.memory_report()",
    "dump_state": "zerokern prints no state dump",
    "zero_force_ds_cpu_optimizer": "the offloaded update is always zerokern's C++ kernel",
}
NO_EFFECT_ZERO = {
    "allgather_bucket_size": "zerokern gathers the same buckets it reduces (reduce_bucket_size)",
    "overlap_comm": "communication always overlaps backward (GPU side stream; gloo rings)",
    "reduce_scatter": "stages 1-3 always reduce-scatter",
    "allgather_partitions": "stages 1-2 always all-gather the updated shards",
    "contiguous_gradients": "gradients are always contiguous (flat buffers)",
    "round_robin_gradients": "each rank owns one piece of every bucket already",
    "ignore_unused_parameters": "an unused param counts as a zero gradient (DESIGN §2)",
    "sub_group_size": "the update runs per bucket",
    "load_from_fp32_weights": "checkpoints always hold fp32 masters",
    "elastic_checkpoint": "zerokern checkpoints load at any world size",
}
NO_EFFECT_OFFLOAD = {
    "pin_memory": "host buffers are always pinned on a GPU (none on a CPU-only machine)",
    "buffer_count": "the pipeline uses its own chunking (offload.py)",
    "fast_init": "no effect for device 'cpu'",
}
NO_EFFECT_OFFLOAD_PARAM = {
    "pin_memory": "the param shards' host homes are pinned on a GPU (none on a CPU-only machine)",
    "buffer_count": "offload_params='nvme' keeps one fetch and one step buffer of a shard",
    "buffer_size": "offload_params='nvme' sizes its buffers to the largest unit shard",
    "max_in_cpu": "offload_params='nvme' keeps no param cache in host memory",
}
# DeepSpeed's stage-3 schedule keys, in elements ([Note: DeepSpeed's stage-3 keys] in
# zerokern/stage3/ds_schedule.py): key -> Stage3Keys field. Honoured at stage 3; DeepSpeed
# reads them at stage 3 only, and so does zerokern (logged as no effect below stage 3).
STAGE3_KEYS = {"stage3_max_reuse_distance": "max_reuse_distance",
               "stage3_max_live_parameters": "max_live_parameters",
               "stage3_prefetch_bucket_size": "prefetch_bucket_size",
               "stage3_param_persistence_threshold": "param_persistence_threshold"}
FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "consecutive_hysteresis", "auto_cast")
HONOURED_ZERO = ("stage", "reduce_bucket_size", "offload_optimizer", "offload_param",
                 "stage3_gather_16bit_weights_on_model_save",
                 "stage3_gather_fp16_weights_on_model_save", "zero_hpz_partition_size",
                 "zero_quantized_weights", "zero_quantized_gradients", *STAGE3_KEYS)
HONOURED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "gradient_clipping", "steps_per_print",
                "wall_clock_breakdown", "optimizer", "scheduler", "fp16", "bf16",
                "zero_optimization", "communication_data_type", "checkpoint",
                "activation_checkpointing",
                "pipeline")  # read by engine/pipeline_module.py (a PipelineModule model)
# [Note: gradient_clipping default] DeepSpeed 0.19 clips at 1.0 when the key is absent
# (deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT = 1.0, since its PR #8068; 0.0
# before). zerokern follows the DeepSpeed this config format targets (0.19.8, the installed
# reference): without the key a DeepSpeed user's run trained differently (loss 8e-4 apart after
# 10 steps on a tiny GPT, issue 21 item 8). "gradient_clipping": 0 turns clipping off.
GRADIENT_CLIPPING_DEFAULT = 1.0
# checkpoint.tag_validation (DeepSpeed's modes, case-insensitive; its default "Warn").
TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")
COMM_DTYPES = PRECISIONS  # communication_data_type takes the precision names
# Without reduce_bucket_size zerokern keeps its own 25 MiB buckets, not DeepSpeed's default of
# 5e8 elements: zerokern's staging buckets live between steps, and at that size they are as
# large as the model (at 23M params fp32: +88 MiB per rank at stages 1-2, measured by
# `zerokern bench --engine`), where DeepSpeed's default costs it little between steps.
ZK_BUCKET_MB_DEFAULT = 25.0
# ...except at stage 2, where the engine keeps its staging pool (MAX_IN_FLIGHT = 2 buckets)
# between steps (build.py [Note: the engine keeps its staging]): 6 MiB buckets hold 12 MiB (over
# NCCL or gloo's TCP ring; over shared memory the grads are read in place, with no pool).
ZK_STAGE2_BUCKET_MB_DEFAULT = 6.0


@dataclass
class EngineConfig:
    """The parsed config. Sizes: batch sizes in samples, bucket_mb in MiB.

    Attributes:
        train_batch_size: samples per optimizer step over all ranks.
        micro_batch_size: samples per micro-batch per rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        world_size: ranks the config was parsed for.
        gradient_clipping: global L2 clipping norm (0: off).
        steps_per_print: log every this many optimizer steps.
        wall_clock_breakdown: add forward/backward/step times to the log.
        optimizer: the config's {"type", "params"} optimizer section, or None.
        scheduler: the config's {"type", "params"} scheduler section, or None.
        precision: "fp32", "bf16" or "fp16".
        loss_scale: ZeroAdamW's loss_scale= (fp16: "dynamic", a float or a dict).
        stage: the ZeRO stage, 0-3.
        reduce_bucket_elements: reduce_bucket_size in elements; None: zerokern's default.
        reduce_dtype: communication_data_type, or None.
        offload: offload_optimizer.device: None, "cpu" or "nvme".
        offload_path: nvme_path for offload "nvme".
        offload_params: offload_param.device: None, "cpu" or "nvme".
        gather_16bit_on_save: stage3_gather_16bit_weights_on_model_save.
        quantized_weights: zero_quantized_weights (ZeroAdamW(quantized_weights=), qwZ).
        quantized_gradients: zero_quantized_gradients: False, or "int4" (ZeroAdamW(
            quantized_gradients=), qgZ; int4 as DeepSpeed's qgZ).
        tag_validation: checkpoint.tag_validation: "IGNORE", "WARN" (default) or "FAIL".
        async_save: checkpoint.writer.decoupled (DeepSpeed 0.19's decoupled checkpoint
            engine): save_checkpoint saves asynchronously by default.
        hpz_partition_size: zero_hpz_partition_size when it takes effect (stage 3, > 1,
            < world size: hpZ on a (world / h, h) mesh, engine/parallel.py), else 1.
        stage3_keys: DeepSpeed's stage-3 schedule keys (stage3_max_reuse_distance,
            stage3_max_live_parameters, stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold), DeepSpeed's defaults where absent; at stage 3
            they set the units kept for the backward and the forward's prefetch
            (zerokern/stage3/ds_schedule.py).
        stage3_keys_given: the stage-3 schedule keys the config sets.
        activation_checkpointing: the `activation_checkpointing` section as
            `zerokern.checkpointing.configure` keywords, or None without one (initialize
            configures zerokern.checkpointing with it).
        ignored: (key, why) of the keys ignored with a warning, as DeepSpeed ignores them.
        no_effect: (key, why) of the accepted keys with no effect in zerokern.
        raw: the config as given.
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    gradient_clipping: float = GRADIENT_CLIPPING_DEFAULT
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    optimizer: Optional[Dict[str, Any]] = None    # {"type", "params"} as given
    scheduler: Optional[Dict[str, Any]] = None    # {"type", "params"} as given
    precision: str = "fp32"
    loss_scale: Any = None                        # ZeroAdamW(loss_scale=)
    stage: int = 0
    reduce_bucket_elements: Optional[int] = None  # None: zerokern's default bucket
    reduce_dtype: Optional[torch.dtype] = None
    offload: Optional[str] = None                 # "cpu" | "nvme"
    offload_path: Optional[str] = None            # nvme_path (offload "nvme")
    offload_params: Optional[str] = None          # offload_param.device: "cpu" | "nvme"
    gather_16bit_on_save: bool = False
    quantized_weights: bool = False               # zero_quantized_weights (qwZ)
    quantized_gradients: Any = False              # zero_quantized_gradients: False | "int4"
    tag_validation: str = "WARN"                  # checkpoint.tag_validation
    async_save: bool = False                      # checkpoint.writer.decoupled
    hpz_partition_size: int = 1                   # [Note: hpz_partition_size] (parallel.py)
    activation_checkpointing: Optional[Dict[str, Any]] = None  # configure() keywords
    stage3_keys: Stage3Keys = field(default_factory=Stage3Keys)  # DeepSpeed's defaults
    stage3_keys_given: Tuple[str, ...] = ()
    no_effect: List[Tuple[str, str]] = field(default_factory=list)  # (key, why)
    ignored: List[Tuple[str, str]] = field(default_factory=list)    # (key, why): a warning
    raw: Dict[str, Any] = field(default_factory=dict)

    @property
    def bucket_mb(self) -> float:
        """reduce_bucket_size (elements) in MiB of the reduce dtype (zerokern's unit)."""
        if self.reduce_bucket_elements is None:
            return ZK_STAGE2_BUCKET_MB_DEFAULT if self.stage == 2 else ZK_BUCKET_MB_DEFAULT
        dtype = self.reduce_dtype or PRECISIONS[self.precision]
        return self.reduce_bucket_elements * dtype.itemsize / 2**20


def batch_sizes(cfg: Dict[str, Any], world_size: int) -> Tuple[int, int, int]:
    """DeepSpeed's triple: train = micro * gas * world_size; any two imply the third."""
    tb = cfg.get("train_batch_size")
    mb = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    tb = None if tb is None else _int("train_batch_size", tb)
    mb = None if mb is None else _int("train_micro_batch_size_per_gpu", mb)
    gas = None if gas is None else _int("gradient_accumulation_steps", gas)
    if tb is None and mb is None:
        raise ConfigError("config needs train_batch_size or train_micro_batch_size_per_gpu "
                         "(DeepSpeed: either, with gradient_accumulation_steps optional)")
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // (mb * world_size) or 1
    elif tb is not None and gas is not None:
        mb = tb // (gas * world_size) or 1
    elif mb is not None and gas is not None:
        tb = mb * gas * world_size
    elif tb is not None:
        gas, mb = 1, tb // world_size or 1
    else:
        gas, tb = 1, mb * world_size
    if tb != mb * gas * world_size:
        given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                             "gradient_accumulation_steps") if k in cfg]
        raise ConfigError(
            f"config key train_batch_size: {tb} != train_micro_batch_size_per_gpu ({mb}) * "
            f"gradient_accumulation_steps ({gas}) * world size ({world_size}) (given: {given})")
    return tb, mb, gas


def _zero(z: Dict[str, Any], out: EngineConfig) -> None:
    if not isinstance(z, dict):
        raise ConfigError(f"config key zero_optimization must be a dict, got {z!r}")
    _unknown(z, set(HONOURED_ZERO) | set(NO_EFFECT_ZERO), "zero_optimization.")
    stage = z.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    out.stage = int(stage)
    if "reduce_bucket_size" in z:
        out.reduce_bucket_elements = _int("zero_optimization.reduce_bucket_size",
                                          z["reduce_bucket_size"])
    if "allgather_bucket_size" in z:
        _int("zero_optimization.allgather_bucket_size", z["allgather_bucket_size"])
    for k in ("overlap_comm", "reduce_scatter", "allgather_partitions", "contiguous_gradients",
              "round_robin_gradients", "ignore_unused_parameters", "elastic_checkpoint",
              "load_from_fp32_weights"):
        if k in z:
            _bool(f"zero_optimization.{k}", z[k])
    for k in ("stage3_gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save"):
        if k in z:
            out.gather_16bit_on_save = _bool(f"zero_optimization.{k}", z[k])
    for k, why in NO_EFFECT_ZERO.items():
        if k in z:
            out.no_effect.append((f"zero_optimization.{k}", why))
    given = {STAGE3_KEYS[k]: _int(f"zero_optimization.{k}", z[k], 0)
             for k in STAGE3_KEYS if k in z}
    out.stage3_keys = Stage3Keys(**given)
    out.stage3_keys_given = tuple(f"zero_optimization.{k}" for k in STAGE3_KEYS if k in z)
    if out.stage != 3:
        out.no_effect += [(k, "stage 3 only, as in DeepSpeed") for k in out.stage3_keys_given]
    _quantized(z, out)
    oo = z.get("offload_optimizer")
    if oo is not None:
        key, dev = _offload_section(oo, "offload_optimizer", {*NO_EFFECT_OFFLOAD, "ratio"})
        if "ratio" in oo and oo["ratio"] != 1.0:
            raise ConfigError(f"config key {key}.ratio: partial offload is not supported "
                              "(1.0 only)")
        if dev == "nvme" and not isinstance(oo.get("nvme_path"), str):
            raise ConfigError(f"config key {key}.nvme_path: device 'nvme' needs the directory "
                             "for the state files (ZeroAdamW(offload_path=))")
        if dev in ("cpu", "nvme"):
            if out.stage == 0:
                raise ConfigError(f"config key {key}.device={dev!r} needs "
                                 "zero_optimization.stage 1, 2 or 3")
            out.offload = dev
            out.offload_path = oo.get("nvme_path")
            for k, why in NO_EFFECT_OFFLOAD.items():
                if k in oo:
                    out.no_effect.append((f"{key}.{k}", why))
    op = z.get("offload_param")
    if op is not None:
        key, dev = _offload_section(op, "offload_param", set(NO_EFFECT_OFFLOAD_PARAM))
        if dev in ("cpu", "nvme") and out.stage != 3:
            # DeepSpeed 0.19 ignores offload_param below stage 3 (only stage 3 partitions
            # params; its stage 0-2 engines never read the section): so does zerokern, with
            # a warning at initialize instead of an error (issue 21 item 11).
            out.ignored.append((f"{key}.device={dev!r}", f"only stage 3 offloads params; "
                                f"ignored at stage {out.stage}, as DeepSpeed does"))
        elif dev in ("cpu", "nvme"):
            if dev == "nvme":
                # ZeroAdamW journals the param files with the optimizer state's files in one
                # directory (zerokern.stage3.param_offload [Note: param offload choices] 3).
                if not isinstance(op.get("nvme_path"), str):
                    raise ConfigError(f"config key {key}.nvme_path: device 'nvme' needs the "
                                     "directory for the param files")
                if out.offload != "nvme":
                    raise ConfigError(f"config key {key}.device='nvme' needs "
                                     "zero_optimization.offload_optimizer.device 'nvme' too "
                                     "(zerokern keeps params on disk only with the optimizer "
                                     "state, so that a failed step changes neither)")
                if os.path.abspath(op["nvme_path"]) != os.path.abspath(out.offload_path):
                    raise ConfigError(f"config key {key}.nvme_path {op['nvme_path']!r} must be "
                                     "zero_optimization.offload_optimizer.nvme_path "
                                     f"({out.offload_path!r}): zerokern keeps both in one "
                                     "directory (ZeroAdamW(offload_path=))")
            out.offload_params = dev
            for k, why in NO_EFFECT_OFFLOAD_PARAM.items():
                if k in op:
                    out.no_effect.append((f"{key}.{k}", why))
    if "zero_hpz_partition_size" in z:
        key = "zero_optimization.zero_hpz_partition_size"
        hpz_setting(_int(key, z["zero_hpz_partition_size"], 0), out)


def _quantized(z: Dict[str, Any], out: EngineConfig) -> None:
    """ZeRO++'s zero_quantized_weights / zero_quantized_gradients (comm/quantized.py). qgZ is
    int4, as DeepSpeed 0.19's (coalesced_collectives.all_to_all_quant_reduce quantizes both
    hops to 4 bits)."""
    if "zero_quantized_weights" in z:
        out.quantized_weights = _bool("zero_optimization.zero_quantized_weights",
                                      z["zero_quantized_weights"])
        if out.quantized_weights and out.stage != 3:
            raise ConfigError("config key zero_optimization.zero_quantized_weights=true needs "
                             f"zero_optimization.stage 3 (got {out.stage})")
    if "zero_quantized_gradients" in z:
        on = _bool("zero_optimization.zero_quantized_gradients", z["zero_quantized_gradients"])
        if on and out.stage == 0:
            raise ConfigError("config key zero_optimization.zero_quantized_gradients=true needs "
                             "zero_optimization.stage 1, 2 or 3")
        out.quantized_gradients = "int4" if on else False


# checkpoint.writer keys of DeepSpeed 0.19 (its FastCheckpointEngine's I/O tuning) that
# zerokern accepts with no effect; "decoupled" is async_save (engine/checkpointing.py).
WRITER_NO_EFFECT = {
    k: "zerokern writes its checkpoint files itself (zerokern/checkpoint/writer.py)"
    for k in ("type", "io_buffer_size", "io_buffer_double", "show_statistics",
              "data_parallel", "io_multiplier")}


def _checkpoint(sec: Any, out: EngineConfig) -> None:
    """The `checkpoint` section: tag_validation and writer.decoupled (DeepSpeed 0.19's
    decoupled checkpoint engine: zerokern's async_save); the other DeepSpeed keys, e.g.
    load_universal or use_node_local_storage, raise as unknown."""
    if not isinstance(sec, dict):
        raise ConfigError(f"config key checkpoint must be a dict, got {sec!r}")
    _unknown(sec, {"tag_validation", "writer"}, "checkpoint.")
    mode = sec.get("tag_validation", "Warn")
    if not isinstance(mode, str) or mode.upper() not in TAG_VALIDATION_MODES:
        raise ConfigError(f"config key checkpoint.tag_validation must be one of Warn, Ignore, "
                         f"Fail (any case), got {mode!r}")
    out.tag_validation = mode.upper()
    writer = sec.get("writer")
    if writer is None:
        return
    if not isinstance(writer, dict):
        raise ConfigError(f"config key checkpoint.writer must be a dict, got {writer!r}")
    _unknown(writer, {"decoupled", *WRITER_NO_EFFECT}, "checkpoint.writer.")
    out.async_save = _bool("checkpoint.writer.decoupled", writer.get("decoupled", False))
    for k, why in WRITER_NO_EFFECT.items():
        if k in writer:
            out.no_effect.append((f"checkpoint.writer.{k}", why))


def _offload_section(sec, name: str, extra_keys) -> tuple:
    """zero_optimization.offload_optimizer / offload_param: the checks both share. Returns
    (the key's full name, its device: 'cpu', 'nvme', 'none' or None)."""
    key = f"zero_optimization.{name}"
    if not isinstance(sec, dict):
        raise ConfigError(f"config key {key} must be a dict, got {sec!r}")
    _unknown(sec, {"device", "nvme_path", *extra_keys}, key + ".")
    dev = sec.get("device", "none")
    if dev not in ("cpu", "nvme", "none", None):
        raise ConfigError(f"config key {key}.device must be 'cpu', 'nvme' or 'none', "
                         f"got {dev!r}")
    if "nvme_path" in sec and dev != "nvme":
        raise ConfigError(f"config key {key}.nvme_path is for device 'nvme', got {dev!r}")
    return key, dev


def _precision(cfg: Dict[str, Any], out: EngineConfig) -> None:
    fp16, bf16 = cfg.get("fp16", {}), cfg.get("bf16", {})
    for name, d in (("fp16", fp16), ("bf16", bf16)):
        if not isinstance(d, dict):
            raise ConfigError(f"config key {name} must be a dict, got {d!r}")
    _unknown(bf16, {"enabled"}, "bf16.")
    _unknown(fp16, set(FP16_KEYS), "fp16.")
    f_on = _bool("fp16.enabled", fp16.get("enabled", False))
    b_on = _bool("bf16.enabled", bf16.get("enabled", False))
    if f_on and b_on:
        raise ConfigError("config keys fp16.enabled and bf16.enabled are both true; pick one")
    if fp16.get("auto_cast", False):
        raise ConfigError("config key fp16.auto_cast=true (casting inputs) is not supported; "
                         "cast the inputs in the model")
    if fp16.get("consecutive_hysteresis", False):
        raise ConfigError("config key fp16.consecutive_hysteresis=true is not supported")
    out.precision = "fp16" if f_on else "bf16" if b_on else "fp32"
    if not f_on:
        return
    ls = _num("fp16.loss_scale", fp16.get("loss_scale", 0))
    if ls > 0:
        out.loss_scale = ls  # static
        return
    # DeepSpeed's dynamic scaler: 2**initial_scale_power, x2 after loss_scale_window clean
    # steps, /2 after `hysteresis` overflows, never below min_loss_scale.
    out.loss_scale = {
        "init_scale": 2.0 ** _int("fp16.initial_scale_power",
                                  fp16.get("initial_scale_power", 16), 0),
        "growth_interval": _int("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000)),
        "hysteresis": _int("fp16.hysteresis", fp16.get("hysteresis", 2)),
        "min_scale": _num("fp16.min_loss_scale", fp16.get("min_loss_scale", 1), 1e-30),
        "growth_factor": 2.0, "backoff_factor": 0.5}


def parse_config(config: Any, world_size: int) -> EngineConfig:
    """Parse and validate a DeepSpeed config (a dict, a JSON/hjson path or base64 JSON:
    config_file.py) for `world_size` ranks.

    Args:
        config: a DeepSpeed config dict, or a path to its JSON file.
        world_size: the number of data-parallel ranks (for the batch-size triple).

    Returns:
        The EngineConfig.

    Raises:
        ValueError: naming the key, for unknown keys, 'auto' values, inconsistent batch
            sizes and values zerokern cannot honour.
    """
    cfg = load_config(config)
    _check_auto(cfg)
    _unknown(cfg, set(HONOURED_TOP) | set(NO_EFFECT_TOP), "")
    # zero_optimization first: a key zerokern cannot honour is the error a user sees first
    probe = EngineConfig(0, 0, 0, world_size)
    _zero(cfg.get("zero_optimization", {}), probe)
    tb, mb, gas = batch_sizes(cfg, world_size)
    out = EngineConfig(tb, mb, gas, world_size, raw=cfg)
    out.gradient_clipping = _num("gradient_clipping",
                                 cfg.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
    _checkpoint(cfg.get("checkpoint", {}), out)
    if "activation_checkpointing" in cfg:  # zerokern/checkpointing/settings.py's keys
        out.activation_checkpointing = _activation_checkpointing(cfg["activation_checkpointing"],
                                                                 ConfigError)
    out.steps_per_print = _int("steps_per_print", cfg.get("steps_per_print", 10))
    out.wall_clock_breakdown = _bool("wall_clock_breakdown", cfg.get("wall_clock_breakdown", False))
    for k, why in NO_EFFECT_TOP.items():
        if k in cfg:
            out.no_effect.append((k, why))
    if "communication_data_type" in cfg:
        cdt = cfg["communication_data_type"]
        if cdt not in COMM_DTYPES:
            raise ConfigError(f"config key communication_data_type must be one of "
                             f"{sorted(COMM_DTYPES)}, got {cdt!r}")
        out.reduce_dtype = COMM_DTYPES[cdt]
    _precision(cfg, out)
    _zero(cfg.get("zero_optimization", {}), out)
    for key in ("optimizer", "scheduler"):
        d = cfg.get(key)
        if d is None:
            continue
        if not isinstance(d, dict) or "type" not in d:
            raise ConfigError(f"config key {key} must be a dict with 'type', got {d!r}")
        _unknown(d, {"type", "params"}, f"{key}.")
        if not isinstance(d.get("params", {}), dict):
            raise ConfigError(f"config key {key}.params must be a dict")
        setattr(out, key, {"type": d["type"], "params": dict(d.get("params", {}))})
    if out.optimizer is not None:
        optimizer_settings(out.optimizer)  # validate now, before anything is built
    return out
