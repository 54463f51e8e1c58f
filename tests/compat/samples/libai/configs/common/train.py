# The training section LiBai's configs share, in LiBai's form: a plain dict of LiBai's keys made a DictConfig.
from omegaconf import DictConfig

from libai.config import LazyCall
from libai.evaluation import ClsEvaluator
from libai.scheduler import WarmupCosineLR

train = dict(
    output_dir="./output",
    train_micro_batch_size=32,
    global_batch_size=None,
    num_accumulation_steps=None,
    train_iter=10000,
    train_epoch=0,
    consumed_train_samples=0,
    consumed_valid_samples=0,
    train_samples=None,
    warmup_ratio=0,
    start_iter=0,
    amp=dict(enabled=False),
    activation_checkpoint=dict(enabled=False),
    nccl_fusion_threshold_mb=16,
    nccl_fusion_max_ops=24,
    zero_optimization=dict(enabled=False, stage=1),
    checkpointer=dict(period=5000, max_to_keep=100, save_model_after_n_epoch=None),
    test_micro_batch_size=32,
    evaluation=dict(
        enabled=True,
        evaluator=LazyCall(ClsEvaluator)(topk=(1, 5)),
        eval_period=5000,
        eval_after_n_epoch=None,
        eval_iter=1e5,
        eval_metric="Acc@1",
        eval_mode="max",
    ),
    load_weight="",
    log_period=20,
    scheduler=LazyCall(WarmupCosineLR)(warmup_factor=0.001, alpha=0.01, warmup_method="linear"),
    dist=dict(
        data_parallel_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        pipeline_num_layers=None,
        custom_pipeline_stage_id=None,
    ),
    input_placement_device="cuda",
    rdma_enabled=True,
    seed=1234,
)

train = DictConfig(train)
