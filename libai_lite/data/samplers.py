"""Batch samplers that hand each data-parallel rank its slice of every global micro-batch.

Both walk the already shuffled dataset in order, in global micro-batches of ``micro_batch_size *
data_parallel_size`` consecutive indices; rank ``r`` takes the ``r``-th contiguous ``micro_batch_size``.
The position depends only on ``consumed_samples``, so a resumed run sees what an uninterrupted one
would have, whatever the earlier data-parallel size.
"""
from __future__ import annotations

from typing import Iterator, List

import torch
from torch.utils.data import Sampler

from .gpt_dataset import IGNORE_INDEX
from ..utils.errors import UsageError


class MegatronPretrainingSampler(Sampler[List[int]]):
    """Megatron's pretraining batch sampler: one pass from ``consumed_samples`` to ``total_samples``.

    Yields lists of ``micro_batch_size`` indices for ``data_parallel_rank``. With ``drop_last`` the
    final incomplete global micro-batch is dropped; without it each rank gets its (possibly short)
    slice of it, and ranks whose slice is empty stop one batch earlier.
    """

    _pad_last = False  # SequentialEvalSampler pads the last global micro-batch instead of cutting it

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples < 0:
            raise UsageError(f"total_samples must be >= 0, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise UsageError(f"consumed_samples ({consumed_samples}) must lie in [0, total_samples = "
                             f"{total_samples}]: the checkpoint consumed more samples than the dataset "
                             f"holds; raise train_iter-derived sample counts or start a new run")
        if micro_batch_size < 1:
            raise UsageError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if data_parallel_size < 1:
            raise UsageError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise UsageError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")
        self.total_samples, self.consumed_samples = int(total_samples), int(consumed_samples)
        self.micro_batch_size, self.drop_last = int(micro_batch_size), bool(drop_last)
        self.data_parallel_rank, self.data_parallel_size = int(data_parallel_rank), int(data_parallel_size)
        self.global_micro_batch = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        full, rest = divmod(self.total_samples - self.consumed_samples, self.global_micro_batch)
        last_is_empty = rest <= (0 if self._pad_last else self.data_parallel_rank * self.micro_batch_size)
        return full + int(not (self.drop_last or last_is_empty))

    def __iter__(self) -> Iterator[List[int]]:
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        for lo in range(start, start + len(self) * self.global_micro_batch, self.global_micro_batch):
            hi = lo + self.micro_batch_size
            yield list(range(lo, hi if self._pad_last else min(hi, self.total_samples)))


class SequentialEvalSampler(MegatronPretrainingSampler):
    """In-order batches for validation and test that drop no sample and keep every rank in step.

    Same layout and arguments as ``MegatronPretrainingSampler``. Without ``drop_last`` the last global
    micro-batch is padded with indices ``>= total_samples``, so every rank yields equally many, equally
    shaped batches, as FSDP and pipeline schedules need. Wrap the dataset in ``PaddedEvalDataset``, which
    turns padding indices into samples whose labels are all ``IGNORE_INDEX``.
    """

    _pad_last = True

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = False):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
                         drop_last)

    def seek(self, consumed_samples: int) -> None:
        """Start the next pass after ``consumed_samples`` samples (Megatron's ``consumed_valid_samples``).

        Megatron-LM's validation iterator runs on across evaluations, so its k-th evaluation reads
        the k-th window of the split; seeking to the samples read before gives the same window.
        """
        if not 0 <= consumed_samples <= self.total_samples:
            raise UsageError(f"an evaluation cannot start after {consumed_samples} samples of a split of "
                             f"{self.total_samples}; size the split for every evaluation of the run")
        self.consumed_samples = int(consumed_samples)

    @property
    def num_padding(self) -> int:
        """How many padding indices all ranks together receive."""
        if self.drop_last:
            return 0
        return len(self) * self.global_micro_batch - (self.total_samples - self.consumed_samples)


class PaddedEvalDataset(torch.utils.data.Dataset):
    """``dataset`` cut to its first ``num_samples`` samples, plus padding for ``SequentialEvalSampler``.

    Index ``i >= num_samples`` returns a real sample (so shapes match) whose ``labels`` are all
    ``IGNORE_INDEX``: the loss and token counts skip it, so perplexity stays exact.
    """

    def __init__(self, dataset, num_samples: int | None = None):
        self.dataset = dataset
        self.num_samples = len(dataset) if num_samples is None else min(int(num_samples), len(dataset))
        if self.num_samples < 1:
            raise UsageError("an evaluation dataset needs at least one sample")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if idx < 0:
            raise IndexError(f"negative index {idx}")
        if idx < self.num_samples:
            return self.dataset[idx]
        sample = dict(self.dataset[idx % self.num_samples])
        sample["labels"] = torch.full_like(sample["labels"], IGNORE_INDEX)
        return sample

    def __getattr__(self, name):
        # max_token_id, data_prefix, ... of the wrapped dataset stay reachable for checks and logs.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
