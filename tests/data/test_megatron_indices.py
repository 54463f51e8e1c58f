"""Our GPT dataset indices against the ones Megatron-LM's own code built for the shared fixture.

``../shared/fixtures/megatron/gpt2_megatron_indices.{json,npz}`` holds, for 40 configurations
(seeds, sequence lengths, splits and train sizes from 1 to 3 epochs of the train split), the
document, sample and shuffle indices Megatron-LM built for ``gpt2_mmap_text_document``. Equal
arrays mean every train, valid and test sample is Megatron's, in Megatron's order; the samples are
also read back through Megatron's own description of the arrays and compared with ours.
"""
import json
import os

import numpy as np
import pytest

from libai_lite.data import build_gpt_train_valid_test_datasets, get_train_valid_test_split, open_indexed_dataset
from tests.launch import ROOT

FIXTURES = os.path.join(os.path.dirname(ROOT), "shared", "fixtures", "megatron")
PREFIX = os.path.join(FIXTURES, "gpt2_mmap_text_document")
SPLITS = ("train", "valid", "test")

if not os.path.exists(os.path.join(FIXTURES, "gpt2_megatron_indices.json")):
    pytest.skip(f"Megatron-LM's reference indices are not present ({FIXTURES} is missing: the shared "
                f"fixtures sit beside the clone in CI only)", allow_module_level=True)

with open(os.path.join(FIXTURES, "gpt2_megatron_indices.json")) as _f:
    CONFIGS = json.load(_f)


@pytest.fixture(scope="module")
def reference():
    with np.load(os.path.join(FIXTURES, "gpt2_megatron_indices.npz")) as z:
        yield {k: z[k] for k in z.files}


def megatron_sample(indexed, doc, sample, shuffle, i):
    """Sample ``i`` read as the fixture's README describes Megatron's arrays (the reference reader)."""
    (d0, o0), (d1, o1) = sample[shuffle[i]], sample[shuffle[i] + 1]
    if d0 == d1:
        return indexed.get_document(int(doc[d0]), int(o0), int(o1 - o0 + 1))
    parts = [indexed.get_document(int(doc[d0]), int(o0))]
    parts += [indexed.get_document(int(d)) for d in doc[d0 + 1:d1]]
    parts.append(indexed.get_document(int(doc[d1]), 0, int(o1) + 1))
    return np.concatenate(parts)


def test_the_fixture_holds_forty_configurations_with_multi_epoch_and_separate_last_epoch_cases():
    assert len(CONFIGS) == 40
    assert {c["seq_length"] for c in CONFIGS} >= {128, 1024}


@pytest.mark.parametrize("config", CONFIGS, ids=[c["key"] for c in CONFIGS])
def test_every_sample_equals_megatron_in_order(config, reference, tmp_path):
    datasets = build_gpt_train_valid_test_datasets(
        PREFIX, config["splits_string"], config["num_samples"], config["seq_length"], config["seed"],
        cache_dir=str(tmp_path))
    indexed = open_indexed_dataset(PREFIX)
    key = config["key"]
    for name, ds, n in zip(SPLITS, datasets, config["num_samples"]):
        if n == 0:
            assert ds is None
            assert f"{key}/{name}_doc" not in reference
            continue
        doc, sample, shuffle = (reference[f"{key}/{name}_{kind}"] for kind in ("doc", "sample", "shuffle"))
        np.testing.assert_array_equal(ds.doc_idx, doc, err_msg=f"{key} {name} document index")
        np.testing.assert_array_equal(ds.sample_idx, sample, err_msg=f"{key} {name} sample index")
        np.testing.assert_array_equal(ds.shuffle_idx, shuffle, err_msg=f"{key} {name} shuffle index")
        for i in range(len(shuffle)):
            want = megatron_sample(indexed, doc, sample, shuffle, i)
            got = ds.get_tokens(i)
            if not np.array_equal(got, want):
                raise AssertionError(f"{key}: {name} sample {i} differs from Megatron's")


def test_both_roundings_agree_on_the_fixture_and_differ_where_megatron_core_does():
    # The fixture was built by legacy and core Megatron alike, so both roundings must split it
    # the same way; at 10,010 documents they differ exactly as the two Megatrons do.
    size = open_indexed_dataset(PREFIX).num_documents
    for splits in {c["splits_string"] for c in CONFIGS}:
        assert get_train_valid_test_split(splits, size, "core") == get_train_valid_test_split(splits, size, "legacy")
    assert get_train_valid_test_split("949,50,1", 10010, "core")[1] == 9499
    assert get_train_valid_test_split("949,50,1", 10010, "legacy")[1] == 9500
