"""The ds_config keys known here: those with no effect and why, those refused and what to do instead, and the
sub-keys each section takes (``config.read_ds_config`` reads them)."""
from typing import Dict

_BUCKETS = "communication buckets and overlap are FSDP2's and DDP's here"
_LOGGED = "the log and metrics.json show loss, lr, samples/s, tokens/s and MFU; TensorBoard goes to train.output_dir"
_CHECKPOINTS = "checkpoints are torch.distributed.checkpoint (DCP) directories here"
# Top-level keys accepted with no effect, and why.
_NO_EFFECT: Dict[str, str] = {
    "wall_clock_breakdown": _LOGGED,
    "flops_profiler": _LOGGED,
    "tensorboard": _LOGGED,
    "csv_monitor": _LOGGED,
    "wandb": "Weights & Biases is train.wandb here",
    "comms_logger": _LOGGED,
    "timers": _LOGGED,
    "memory_breakpoint": _LOGGED,
    "dump_state": _LOGGED,
    "zero_allow_untested_optimizer": "any torch optimizer runs under ZeRO here",
    "zero_force_ds_cpu_optimizer": "the offloaded optimizer step is torch's on the CPU here",
    "communication_data_type": "gradients are reduced in the master weights' dtype",
    "seq_parallel_communication_data_type": "gradients are reduced in the master weights' dtype",
    "prescale_gradients": "gradients are averaged over data-parallel ranks once, in the master weights' dtype",
    "gradient_predivide_factor": "gradients are averaged over data-parallel ranks once, in the master weights' dtype",
    "sparse_gradients": "embedding gradients are dense here",
    "disable_allgather": _BUCKETS,
    "dataloader_drop_last": "the sampler always keeps whole global batches",
    "activation_checkpointing": "activation checkpointing is train.activation_checkpoint here",
    "aio": "no NVMe offload here",
    "checkpoint": _CHECKPOINTS,
    "load_universal_checkpoint": _CHECKPOINTS,
    "use_node_local_storage": _CHECKPOINTS,
    "pipeline": "pipeline parallelism is train.dist.pipeline_parallel_size",
    "graph_harvesting": "CUDA graphs come from train.compile.mode=reduce-overhead",
}
# Top-level keys refused, with what to do instead.
_REFUSED: Dict[str, str] = {
    "amp": "NVIDIA Apex AMP is not built here: use fp16 or bf16",
    "elasticity": "the batch size is fixed for a run here; drop elasticity",
    "curriculum_learning": "no curriculum of sequence lengths here; drop it",
    "data_efficiency": "no data sampling or routing schedule here; drop it",
    "compression_training": "no compression here; drop it",
    "sparse_attention": "attention is dense SDPA or FlexAttention here; drop it",
    "autotuning": "no autotuner here: tools/estimate_memory.py sizes a layout; drop it",
    "quantize_training": "no quantized training here beyond train.fp8; drop it",
    "nebula": _CHECKPOINTS + "; drop it",
}
_ZERO_TUNING = ("allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
                "reduce_bucket_size", "contiguous_gradients", "round_robin_gradients", "sub_group_size",
                "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights", "legacy_stage1",
                "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                "gather_16bit_weights_on_model_save", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
                "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather",
                "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                "stage3_module_granularity_threshold", "reduce_bucket_size_fp32", "cpu_offload_use_pin_memory")
_OFFLOAD_TUNING = ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "ratio", "nvme_path",
                   "pipeline_read", "pipeline_write")
_FP16 = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
         "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16 = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
         "bf16_optimizer_states")
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
# DeepSpeed's scheduler defaults (deepspeed/runtime/lr_schedules.py).
_SCHEDULERS = {
    "WarmupLR": dict(warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log"),
    "WarmupDecayLR": dict(total_num_steps=None, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                          warmup_type="log"),
    "WarmupCosineLR": dict(total_num_steps=None, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                           warmup_type="log"),
}
_BATCH = {"train_batch_size": "train.global_batch_size",
          "train_micro_batch_size_per_gpu": "train.train_micro_batch_size",
          "gradient_accumulation_steps": "train.num_accumulation_steps"}
_SECTIONS = ("fp16", "bf16", "bfloat16", "zero_optimization", "optimizer", "scheduler", "gradient_clipping",
             "steps_per_print", *_BATCH)
KNOWN_KEYS = sorted({*_NO_EFFECT, *_REFUSED, *_SECTIONS})
