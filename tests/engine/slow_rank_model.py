"""A GPT whose forward sleeps on rank 1 (a straggler for tests/engine/test_stragglers.py), given to a run as
``model._target_=tests.engine.slow_rank_model.SlowOnRankOne``."""
import time

import torch.distributed as dist

from projects.GPT.modeling.gpt_model import GPTForPreTraining

SLEEP_S = 0.1


class SlowOnRankOne(GPTForPreTraining):
    """GPTForPreTraining, ``SLEEP_S`` slower per forward on rank 1."""

    def forward(self, *args, **kwargs):
        if self.training and dist.get_rank() == 1:
            time.sleep(SLEEP_S)
        return super().forward(*args, **kwargs)
