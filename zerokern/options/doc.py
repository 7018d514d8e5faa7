"""The engine's arguments, documented once: `ENGINE_ARGS` is appended to the docstrings of
ZeroOptimizer, ZeroAdamW, ZeroLion and ZeroMuon (each names its own rule's hyperparameters
first), so the API pages list every argument and a new one is documented in one place."""

ENGINE_ARGS = """
        stage: 0 replicated (DDP-equivalent), 1 shard optimizer states, 2 also grads, 3 also
            params (per module unit; needs the model).
        precision: "fp32" | "bf16" | "fp16", the dtype of params and grads. The model's params
            are cast in place; fp32 masters keep the original values.
        loss_scale: fp16: "dynamic", a float (static) or a dict of DynamicLossScaler options.
            bf16/fp32: 1.0 unless a float is given.
        max_grad_norm: global L2 clipping over all shards (clip_grad_norm_ semantics).
        offload: None, or "cpu" (stages 1-3): the master, the rule's state and the update
            live on the host and use the cpu kernel (ZeRO-Offload; see zerokern.state.offload);
            or "nvme" (stages 1-3): the master and the rule's state live in files under
            offload_path and stream through host memory each step (ZeRO-Infinity's optimizer
            half; see zerokern.state.offload_nvme).
        offload_path (str | os.PathLike | None): offload="nvme" only (keyword): an existing
            writable directory for the state (and, with offload_params="nvme", param) files.
        free_grads: (keyword) True: `zero_grad(set_to_none=True)` frees the gradient memory
            (the full grad buffer at stages 0-1, the grad shard, staging buckets and ring
            scratch at stages 1-3) and the next backward allocates it again: DeepSpeed's
            memory profile between steps (what `zerokern.initialize` uses), for one allocation
            per step. False: kept and reused, as DDP keeps its buckets.
        offload_params: stage 3 only (keyword): None, "cpu" or "nvme" (with offload="nvme"):
            where each unit's param shard lives between uses; fetched to the device with
            its all-gather (ZeRO-Infinity's param half; see zerokern.stage3.param_offload).
        bucket_mb: communication bucket size in MiB.
        reduce_dtype: gradient communication dtype; default the precision dtype.
        process_group (ProcessGroup | None): torch.distributed group; default WORLD, or
            world size 1 without one.
        mesh (DeviceMesh | None): (keyword) the data-parallel torch DeviceMesh, FSDP2's
            convention (for a tensor-parallel model its dp sub-mesh): 1-D shards over it; 2-D
            is (replicate, shard), HSDP: shard over dim 1, replicate over dim 0 (each shard
            all-reduced across its replicas after the reduce-scatter; see zerokern.comm.groups).
            With process_group too, the group must have exactly the mesh's ranks. A model
            with DTensor params (torch tensor parallelism over a tp mesh) keeps them DTensors:
            each rank's buffers hold its local tp shards, reduced over this mesh only, and the
            grad norm and overflow skip are agreed over tp too (see zerokern.comm.tp); the
            mesh must not include the tp ranks (ValueError).
        hpz (bool): (keyword) stage 3 with a 2-D mesh: ZeRO++'s hpZ, params sharded over every
            rank of the mesh plus a secondary copy sharded over dim 1 (the node), so the
            backward re-gather stays in the node (see zerokern.stage3.hpz); training is bitwise
            plain stage 3's over the same ranks.
        quantized_weights (bool): (keyword) stage 3: ZeRO++'s qwZ, the forward and backward
            param all-gathers send int8 codes with an fp32 scale per 128-element block (1.03
            bytes per element instead of 2-4); each rank's own piece stays exact, so
            gathered_params(), checkpoints and write-backs are exact (see
            zerokern.comm.quantized). Error per gathered element <= absmax(block) / 254.
        quantized_gradients (bool | str): (keyword) stages 1-3: ZeRO++'s qgZ, False, True or
            "int8", or "int4": the gradient reduce-scatter sends block-quantized chunks in an
            all-to-all and reduces them in fp32 (this rank's own chunk exact); with hpz=True in
            two hops, inside the node then across nodes. Error per element <= the sum over the
            other ranks of absmax(block) / 254 (int8) or / 14 (int4).
        broadcast_params (bool): (keyword) True (default): at construction every rank of the
            data-parallel group (process_group / mesh: its shard and replicate ranks
            together) takes the params (trainable and frozen) and the model's buffers of the
            group's first rank, as DDP's constructor and DeepSpeed's initialize do, before
            anything is flattened or sharded; a DTensor param's tensor-parallel shard stays
            as it is (see zerokern.core.model_sync, [Note: ranks start from the first rank's
            weights]). False: no copy; the ranks' params and buffers are checked to agree
            (one all-reduce of a fingerprint per tensor), a ValueError naming the first that
            differs otherwise. With bare params (no model) there are no buffers to copy.
        backend: kernel backend, "auto" | "triton" | "cuda" | "cpu" | "reference".
        param_groups: with a model: param-group dicts over its params (e.g. no weight decay
            for biases and norms); every trainable param of the model must be in one.
        master: (keyword) "fp32" (default): the fp32 master is a 4-byte copy per state
            element; "compact" (bf16, no offload, stages 0-2): the same fp32 master, bit for
            bit, held as its low 16 bits under the bf16 param plus a tie bit (2.125 bytes per
            element; see zerokern.state.compact_master). Training is bitwise the same.
        units (None | type | tuple[type, ...] | Callable[[nn.Module], bool]): stage 3
            only: which submodules are gathered together. None: each child of
            every nn.ModuleList, plus the root for the rest; or module classes; or a callable
            `(module) -> bool`. The root is always a unit.
        keep_for_backward_mb (float): (keyword) stage 3 only: MiB of full units a
            grad-enabled forward may leave gathered for the backward, besides the root and the
            last unit (always kept). Whole units from the end of the forward's schedule (the
            first the backward needs) while they fit; math.inf keeps every unit (FSDP2's
            reshard_after_forward=False). Each kept unit saves its backward all-gather and
            adds its full bytes to the peak at the end of forward (`live_units_bound` in
            memory_report() counts them). Default 0: lowest memory.
        activation_checkpointing (str | None): (keyword) None (default), "full", "selective"
            or "offload": an activation policy applied to the model's units (the stage-3 units
            but the root; at stages 0-2 each child of every nn.ModuleList; needs the model).
            "full": non-reentrant torch.utils.checkpoint around each unit (its inputs held, the
            unit recomputed in backward); "selective": torch's selective-checkpoint contexts,
            keeping matmul and attention outputs and recomputing the elementwise ops;
            "offload": every tensor a unit saves for backward (params excepted) goes to
            (pinned) host memory and back in its backward. Composes with stage 3's gathers and
            trains bit for bit as without it on a deterministic backend; memory_report()
            gains an "activations" row (see zerokern.stage3.activation_policy), and
            `zerokern estimate --batch --seq --activation-checkpointing` estimates the bytes.
"""

# ZeroOptimizer's and ZeroAdamW's (the rules tested with it so far: AdamW)
PARAM_FORMAT_ARG = """
        param_format (str | None): (keyword) None (default): the params in the precision's
            dtype. "fp8" (stage 3, precision "bf16" or "fp16"): each rank's shard of the
            trainable params held as torch.float8_e4m3fn codes (1 byte per element; frozen
            params stay 16-bit) with one fp32 scale per param, agreed across the ranks (amax
            all-reduced MAX, scale = amax / 448); the stage-3 all-gathers send the codes (half
            of bf16's bytes) and decode each unit to the precision's dtype, which forward and
            backward compute with. The fp32 master and the rule's state are unchanged; the
            params the model sees are rounded to 3 mantissa bits (see
            zerokern.kernels.param_codec). Not with offload, offload_params, hpz,
            quantized_weights or master="compact" (ValueError).
"""
