"""T5/mT5 span-corruption pretraining data over the core's Megatron-format GPT token windows."""
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
    "T5Dataset",
    "build_t5_train_valid_test_datasets",
    "build_t5_train_valid_test_loaders",
    "random_spans_helper",
    "random_spans_noise_mask",
    "t5_special_ids",
    "t5_train_samples_per_epoch",
]
