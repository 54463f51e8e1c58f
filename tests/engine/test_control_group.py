"""The scalars ranks agree on at every step (the stop flag) and at a log line go over a gloo group of their own:
reduced in host memory, so a run on NCCL never reads a GPU tensor back for them."""
import os

import torch.distributed as dist
from omegaconf import OmegaConf

from tests.launch import free_port, spawn_ranks


def _worker(rank, port, result_dir):
    from libai_lite.utils import distributed as d

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    d.setup_dist(OmegaConf.create({"tensor_parallel_size": 1, "pipeline_parallel_size": 1}))
    try:
        seen = []
        original = dist.all_reduce

        def spy(tensor, *args, group=None, **kwargs):
            seen.append((group, tensor.device.type))
            return original(tensor, *args, group=group, **kwargs)

        dist.all_reduce = spy
        try:
            stop, failed = d.all_reduce_max([float(rank), -float(rank)])
            total, = d.all_reduce_sum([1.0])
            message = d.broadcast_object("from rank 1" if rank == 1 else None, src=1)
        finally:
            dist.all_reduce = original
        control = d._MONITOR["control"]
        assert control is not None and dist.get_backend(control) == "gloo"
        assert seen == [(control, "cpu"), (control, "cpu")], seen
        assert (stop, failed, total, message) == (1.0, 0.0, 2.0, "from rank 1")
        with open(os.path.join(result_dir, f"ok{rank}"), "w") as f:
            f.write("ok")
        dist.barrier()
    finally:
        d.destroy()


def test_step_scalars_are_reduced_on_a_gloo_group_in_host_memory(tmp_path):
    spawn_ranks(_worker, 2, (free_port(), str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]
