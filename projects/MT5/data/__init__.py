"""T5/mT5 pretraining data: span corruption over the core's GPT token windows (``t5_dataset``), and
Megatron-LM's own T5 dataset over sentence-split data (``megatron_t5_dataset``)."""
from .megatron_t5_dataset import (
    MegatronT5Dataset,
    build_megatron_t5_datasets,
    build_megatron_t5_train_valid_test_loaders,
    build_samples_mapping,
)
from .t5_dataset import (
    T5Dataset,
    build_t5_train_valid_test_datasets,
    build_t5_train_valid_test_loaders,
    random_spans_helper,
    random_spans_noise_mask,
    t5_special_ids,
    t5_train_samples_per_epoch,
)

__all__ = [
    "MegatronT5Dataset",
    "build_megatron_t5_datasets",
    "build_megatron_t5_train_valid_test_loaders",
    "build_samples_mapping",
    "T5Dataset",
    "build_t5_train_valid_test_datasets",
    "build_t5_train_valid_test_loaders",
    "random_spans_helper",
    "random_spans_noise_mask",
    "t5_special_ids",
    "t5_train_samples_per_epoch",
]
