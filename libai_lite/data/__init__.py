"""Megatron-format data: indexed `.bin/.idx` files, the GPT dataset, samplers and loader builders."""
from .build import (
    BlendableDataset,
    build_blending_indices,
    build_gpt_train_valid_test_datasets,
    build_gpt_train_valid_test_loaders,
    get_datasets_weights_and_num_samples,
    get_train_valid_test_split,
    open_indexed_dataset,
    parse_data_prefix,
    parse_splits_string,
)
from .gpt_dataset import IGNORE_INDEX, GPTDataset, check_token_ids
from .indexed_dataset import IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder
from .samplers import MegatronPretrainingSampler, PaddedEvalDataset, SequentialEvalSampler

__all__ = [
    "BlendableDataset",
    "GPTDataset",
    "IGNORE_INDEX",
    "IndexedDatasetError",
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "PaddedEvalDataset",
    "SequentialEvalSampler",
    "build_blending_indices",
    "build_gpt_train_valid_test_datasets",
    "build_gpt_train_valid_test_loaders",
    "check_token_ids",
    "get_datasets_weights_and_num_samples",
    "get_train_valid_test_split",
    "open_indexed_dataset",
    "parse_data_prefix",
    "parse_splits_string",
]
