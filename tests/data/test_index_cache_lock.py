"""The index cache's lock file does not outlive the build: none is left beside the data or in cache_dir, on one
process or two ranks, and a process that waited on a lock file its holder removed locks the path's new one."""
import os
import threading
import time
from pathlib import Path

from libai_lite.data.index_cache import _cache_lock
from tests.data.test_gpt_dataset import _two_rank_worker, gpt, make_corpus
from tests.launch import spawn_ranks


def locks(*folders) -> list:
    return sorted(str(p) for folder in folders for p in Path(folder).rglob("*.lock"))


def test_an_index_build_and_its_reopen_leave_no_lock_file(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    prefix, _ = make_corpus(data)
    for _ in range(2):  # the build, then the open of the cache it wrote
        gpt(prefix, 40, 8)
        gpt(prefix, 40, 8, name="valid", cache_dir=cache)
    assert any(p.name.endswith("_sample_idx.npy") for p in data.iterdir())
    assert any(p.name.endswith("_sample_idx.npy") for p in cache.iterdir())
    assert locks(data, cache) == []


def test_two_ranks_building_one_cache_leave_no_lock_file(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=50)
    spawn_ranks(_two_rank_worker, 2, (2, str(tmp_path / "init"), prefix, str(tmp_path)), start_method="fork")
    assert (tmp_path / "builds0.txt").read_text() == "train,valid"
    assert locks(tmp_path) == []


def test_the_lock_file_goes_with_its_last_holder_and_a_waiter_locks_the_new_one(tmp_path):
    what = str(tmp_path / "x_sample_idx.npy")
    lock = Path(what + ".lock")
    with _cache_lock(what, exclusive=False):
        with _cache_lock(what, exclusive=False):
            assert lock.exists()
        assert lock.exists()  # the outer holder still has it
    assert not lock.exists()

    held, seen = threading.Event(), []

    def holder():
        with _cache_lock(what, exclusive=True):
            held.set()
            time.sleep(0.3)  # let the main thread open this file and wait on it (not asserted on)

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    with _cache_lock(what, exclusive=True):
        # The holder removed the file it held: this one is the path's current file, not the removed one.
        seen.append(lock.exists())
    t.join()
    assert seen == [True] and not lock.exists()
    assert not os.listdir(tmp_path)


def _failing_rank0_worker(rank, world_size, init_file, prefix, out_dir):
    import torch.distributed as dist

    from libai_lite.data.build import build_gpt_train_valid_test_datasets
    from libai_lite.data.gpt_dataset import GPTDataset
    from libai_lite.utils.errors import UsageError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        def failing(self):
            raise UsageError("the cache filesystem refused the write; set dataloader.train.cache_dir")

        GPTDataset._build_indices = failing
        try:
            build_gpt_train_valid_test_datasets(prefix, "9,1,0", [64, 8, 0], 8, 42)
            said = "built"
        except Exception as e:  # noqa: BLE001 - what each rank stops on is the test's subject
            said = f"{type(e).__name__}: {e}"
        Path(out_dir, f"said{rank}.txt").write_text(said)
    finally:
        dist.destroy_process_group()


def test_a_failed_build_on_rank_0_stops_the_other_ranks_on_a_user_error_not_a_traceback(tmp_path):
    """The other ranks found the cache missing after the barrier and raised a RuntimeError of their own."""
    prefix, _ = make_corpus(tmp_path, num_docs=50)
    spawn_ranks(_failing_rank0_worker, 2, (2, str(tmp_path / "init"), prefix, str(tmp_path)), start_method="fork")
    assert (tmp_path / "said0.txt").read_text() == \
        "UsageError: the cache filesystem refused the write; set dataloader.train.cache_dir"
    said = (tmp_path / "said1.txt").read_text()
    assert said.startswith("UsageError: rank 0 could not build ") and said.endswith(
        ": the cache filesystem refused the write; set dataloader.train.cache_dir"), said
