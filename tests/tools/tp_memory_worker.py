"""One rank of a tensor-parallel GPT step measuring what its forward keeps for backward (process RSS), for
tests/tools/test_estimate_memory.py. Run by torchrun with MALLOC_MMAP_THRESHOLD_ fixed, as bench/memory.py
is, so freed tensors leave RSS at once. argv: sequence parallel (0/1), output JSON path."""
import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from libai_lite.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel_context
from projects.GPT.modeling.gpt_model import GPTForPreTraining

CFG = dict(hidden_layers=2, vocab_size=8192, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
           max_seq_length=64, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
MICRO_BATCH = 4


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main() -> None:
    sequence_parallel, out = sys.argv[1] == "1", sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPTForPreTraining(CFG), mesh["tp"], sequence_parallel)
    tokens = torch.randint(0, CFG["vocab_size"], (MICRO_BATCH, CFG["max_seq_length"] + 1))
    kept = []
    for _ in range(3):  # the first steps pay one-off allocations; the last is measured
        gc.collect()
        before = rss()
        with loss_parallel_context(True):
            loss = model(tokens[:, :-1], tokens[:, 1:])["lm_loss"]
            kept.append(rss() - before)
            loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, kept[-1])
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(max(sizes), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(main)
