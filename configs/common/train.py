"""Training settings shared by every project (LiBai's key names)."""
from libai_lite.config import LazyCall
from libai_lite.evaluation import PPLEvaluator
from libai_lite.scheduler import WarmupCosineLR

train = dict(
    output_dir="./output",
    # Batch sizes: global = micro x data_parallel_size x num_accumulation_steps; any two
    # determine the third (leave it null), inconsistent values are an error.
    train_micro_batch_size=8,
    global_batch_size=None,
    num_accumulation_steps=None,
    test_micro_batch_size=8,
    # Length of training: train_iter iterations, or at least train_epoch epochs of the train split.
    train_iter=10000,
    train_epoch=0,
    warmup_ratio=0.01,
    log_period=20,
    # The log line names a rank whose mean step time (host time outside backward, where data parallelism
    # waits for the slowest) is over `ratio` x the median rank's, and `min_seconds` or more over it (the
    # jitter of millisecond steps is no straggler), for `periods` log periods running; ratio null: not
    # watched. Ranks are compared within their pipeline stage.
    straggler=dict(ratio=1.2, periods=2, min_seconds=0.02),
    # MFU's denominator in TFLOP/s per GPU, for a device the built-in table (libai_lite/utils/flops.py)
    # does not know or a clock it does not assume; null reads the table by the device's name.
    peak_tflops=None,
    # Log the memory planner's per-rank estimate for this run at start-up (a second or more of tracing).
    log_memory_estimate=True,
    seed=1234,
    # A checkpoint directory to load weights from (not optimizer or data position); "" for none.
    load_weight="",
    # async_save: stage each checkpoint in CPU memory (one more copy of the model and optimizer state)
    # and write it in the background while training goes on; it is published, and old ones pruned,
    # once written. At most one is in flight: a save waits for the previous one. null: on when the
    # run trains on a GPU (a save then stalls it for the copy to host memory only), off on the CPU.
    checkpointer=dict(period=1000, max_to_keep=3, async_save=None),
    # torch.profiler (as torchtitan's profiling): each rank writes a Chrome trace of `active` steps to
    # output_dir/profile/, after `wait` + `warmup` steps from the run's first, `repeat` times;
    # memory_snapshot (CUDA only) also dumps the allocator's history of those steps (pytorch.org/memory_viz).
    profile=dict(enabled=False, wait=10, warmup=2, active=3, repeat=1, memory_snapshot=False),
    # Weights & Biases beside TensorBoard (pip install -e .[wandb]): metrics.json's scalars and this
    # config. mode "offline" writes the run under output_dir/wandb with no network (`wandb sync` uploads
    # it later), "online" streams it (after `wandb login`), "disabled" writes nothing.
    wandb=dict(enabled=False, project="libai_lite", name=None, mode="offline"),
    evaluation=dict(
        enabled=True,
        evaluator=LazyCall(PPLEvaluator)(),
        eval_period=1000,
        eval_iter=20,
        eval_metric="PPL",
        eval_mode="min",
    ),
    scheduler=LazyCall(WarmupCosineLR)(warmup_factor=0.001, alpha=0.1, warmup_method="linear"),
    # Mixed precision: dtype "bf16", or "fp16" with dynamic loss scaling; an fp16 overflow with the scale
    # already at min_loss_scale stops the run (as DeepSpeed's min_loss_scale does).
    amp=dict(enabled=False, dtype="bf16", initial_scale=65536.0, growth_interval=1000, min_loss_scale=1.0),
    # A NaN/inf loss stops the run (0) or skips up to this many batches (fp32/bf16; fp16 relies on
    # the loss scaler, which skips overflowed steps on its own).
    max_skipped_nonfinite=0,
    # model.cfg keys a --resume may change on purpose (a longer max_seq_length); any other change is refused.
    resume_model_changes=[],
    # Recompute every N-th transformer layer's activations in backward instead of storing them:
    # mode "full" keeps only each layer's input, "selective" keeps the matmul and attention outputs
    # and recomputes the cheap ops between them (less memory than none, less recomputation than full).
    activation_checkpoint=dict(enabled=False, every_n_layers=1, mode="full"),
    # torch.compile (enabled: auto = on a GPU, off on a CPU; true; false). The first steps compile,
    # cached under TORCHINDUCTOR_CACHE_DIR; a compile that fails runs eager. loss: also the cross entropy of unfused heads;
    # backend "aot_eager" to debug; fullgraph: a graph break inside a layer is an error; scope: auto (the
    # whole model on one replica without pipeline/tp/cp/ep, else each layer), model or layers; mode:
    # torch.compile's (reduce-overhead: CUDA graphs for static shapes; max-autotune-no-cudagraphs).
    compile=dict(enabled="auto", loss=False, backend="inductor", fullgraph=False, scope="auto", mode=None),
    # FP8 linears through torchao (pip install -e .[fp8]) on GPUs of compute capability 8.9+ (H100), compiled:
    # recipe tensorwise or rowwise; skip: module names kept in high precision; filter: auto (only linears
    # large enough to gain, torchao's thresholds) or all (libai_lite/converters/float8.py).
    fp8=dict(enabled=False, recipe="tensorwise", skip=["lm_head"], filter="auto"),
    # ZeRO: stage 1 shards optimizer state, 2 also gradients, 3 also parameters (FSDP2);
    # offload: at stage 1 the optimizer state and step on the CPU (DeepSpeed's offload_optimizer); at 2/3
    # parameters, gradients and the optimizer step too (FSDP2's CPUOffloadPolicy).
    zero_optimization=dict(enabled=False, stage=1, offload=False),
    dist=dict(
        # null: the processes launched decide (world / (pp x cp x tp)), so one config runs on 1, 4 or 8
        # processes; a number must match the launch.
        data_parallel_size=None,
        # HSDP (torchtitan's replicate x shard degrees; needs ZeRO-2/3): the data-parallel ranks as
        # data_parallel_replicate_size groups of data_parallel_shard_size ranks, each group holding one FSDP-
        # sharded copy (shard inside a node, replicate across nodes). Either null is what the other leaves; both
        # null: one flat group (replicate 1, shard = data_parallel_size).
        data_parallel_replicate_size=None,
        data_parallel_shard_size=None,
        # Capped at the world size (pipeline at what remains) as LiBai does, with a start-up
        # warning; strict_layout=True refuses a world too small for them instead.
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        strict_layout=False,
        # Split each sample's sequence over this many ranks (decoder-only models; load-balanced causal
        # chunks, keys and values all-gathered in attention; libai_lite/parallel/context_parallel.py).
        context_parallel_size=1,
        pipeline_num_layers=None,
        custom_pipeline_stage_id=None,
        # Pipeline schedule: "gpipe", "1f1b", "interleaved_1f1b" or "interleaved_zero_bubble" (with
        # virtual_pipeline_size stages per rank), or "zbv_zero_bubble" / "dualpipev" (virtual_pipeline_size=2:
        # a V of stages, rank r holding r and 2*pp-1-r; DualPipeV needs num_accumulation_steps >= 2*pp).
        pipeline_schedule="1f1b",
        virtual_pipeline_size=1,
        # Split activations along the sequence between tensor-parallel ranks outside attention/MLP.
        sequence_parallel=False,
        # Seconds a collective may wait before the run fails instead of hanging.
        timeout=600,
        # Process-group backend: null for nccl on CUDA and gloo on the CPU; "gloo" on a GPU lets several
        # processes share one device (tests and checks of multi-rank layouts on a one-GPU machine).
        backend=None,
    ),
)
