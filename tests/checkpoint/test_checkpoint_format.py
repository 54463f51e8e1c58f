"""The checkpoint format is frozen: a checkpoint saved before the checkpointer was split by concern
(``fixtures/pre_split``, written by that code) still loads, and a save now writes the same files."""
import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

from libai_lite.checkpoint import Checkpointer, checkpoint_to_resume

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "pre_split")
# What the pre-split checkpointer wrote for one process: DCP's two files, the RNG and trainer state, the manifest.
FILES = [".metadata", "__0_0.distcp", "manifest.json", "rng_state_0.pt", "trainer_state.json"]
TRAINER_STATE = {"iteration": 0, "consumed_samples": 2, "scheduler": {"last_epoch": 1}}


def _trained():
    """The fixture's model and optimizer after its one step (how fixtures/pre_split was made), and the RNG state then."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rng = torch.get_rng_state()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt, rng


def test_a_checkpoint_saved_before_the_split_resumes_with_its_weights_optimizer_rng_and_trainer_state(tmp_path):
    save_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, save_dir)
    path = checkpoint_to_resume(str(save_dir))
    assert path == str(save_dir / "model_0000000")
    expected, expected_opt, rng = _trained()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    state = Checkpointer(model, opt, str(save_dir)).load(path)
    assert state == TRAINER_STATE
    for (name, got), want in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(got, want), name
    for got, want in zip(opt.state_dict()["state"].values(), expected_opt.state_dict()["state"].values()):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_save_writes_the_files_manifest_and_keys_of_the_pre_split_format(tmp_path):
    model, opt, _ = _trained()
    Checkpointer(model, opt, str(tmp_path)).save("model_0000000", TRAINER_STATE)
    old, new = os.path.join(FIXTURE, "model_0000000"), str(tmp_path / "model_0000000")
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(FIXTURE)) == ["last_checkpoint", "model_0000000"]
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000000"
    assert sorted(os.listdir(new)) == sorted(os.listdir(old)) == FILES
    manifests = [json.load(open(os.path.join(d, "manifest.json"))) for d in (old, new)]
    for manifest in manifests:
        assert sorted(manifest) == ["checksum", "files"] and manifest["checksum"] == "crc32"
        assert sorted(manifest["files"]) == [f for f in FILES if f != "manifest.json"]
        assert all(sorted(r) == ["bytes", "crc32"] and len(r["crc32"]) == 8 for r in manifest["files"].values())
    # Same bytes: the same JSON layout (DCP's own files may change with the torch version, so only their keys are compared).
    assert manifests[0]["files"]["trainer_state.json"] == manifests[1]["files"]["trainer_state.json"]
    keys = [sorted(dcp.FileSystemReader(d).read_metadata().state_dict_metadata) for d in (old, new)]
    assert keys[0] == keys[1] and "model.0.weight" in keys[0] and "optim.state.0.weight.exp_avg" in keys[0]
    rng = [torch.load(os.path.join(d, "rng_state_0.pt"), weights_only=True) for d in (old, new)]
    assert sorted(rng[0]) == sorted(rng[1])
