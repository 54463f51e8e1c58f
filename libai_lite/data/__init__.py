"""Megatron-format data: indexed `.bin/.idx` files, the GPT dataset, samplers and loader builders.

Names load on first use (PEP 562): `tools/preprocess_data.py` needs only the indexed files, and
importing torch for them would cost every preprocessing run and worker a second or more of start-up.
"""
import importlib

_WHERE = {
    "BlendableDataset": "build",
    "build_blending_indices": "build",
    "build_gpt_train_valid_test_datasets": "build",
    "build_gpt_train_valid_test_loaders": "build",
    "get_datasets_weights_and_num_samples": "build",
    "get_train_valid_test_split": "build",
    "megatron_consumed_valid_samples": "build",
    "megatron_valid_samples": "build",
    "open_indexed_dataset": "build",
    "parse_data_prefix": "build",
    "parse_splits_string": "build",
    "IGNORE_INDEX": "gpt_dataset",
    "GPTDataset": "gpt_dataset",
    "check_token_ids": "gpt_dataset",
    "IndexedDatasetError": "indexed_dataset",
    "MMapIndexedDataset": "indexed_dataset",
    "MMapIndexedDatasetBuilder": "indexed_dataset",
    "MegatronPretrainingSampler": "samplers",
    "PaddedEvalDataset": "samplers",
    "SequentialEvalSampler": "samplers",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
