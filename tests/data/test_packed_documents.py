"""Megatron's packed-document options (libai_lite.data.packing) end to end: the per-sample fields against a
direct transcription of Megatron's loop, and a tiny GPT and Llama built from the project configs whose
per-document losses with reset_position_ids + reset_attention_mask equal running each document alone."""
import copy

import pytest
import torch

from libai_lite.config import LazyConfig, instantiate
from libai_lite.data import IGNORE_INDEX
from libai_lite.data.packing import (
    PackedDocumentDataset,
    check_packing_options,
    document_ids,
    document_position_ids,
    packed_document_fields,
    wrap_packed_documents,
)
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT

EOD = 0
VOCAB = 96
# fp32 throughout: a position's logits differ between the packed and the lone run only by the order in
# which matmuls and the softmax accumulate (other sequence lengths, a masked kernel). Each op then errs by
# a few float32 eps (1.2e-7) times sqrt(its reduction length, <= 128 here); through two layers and a
# log-softmax that stays well under 1e-5 of a loss sum, far below a real leak across documents (~1e-2).
RTOL, ATOL = 1e-5, 1e-5


def _megatron_reference(tokens, eod):
    """Megatron's _get_ltor_masks_and_position_ids (core GPTDataset), transcribed as the loop it is, on one
    sample's input tokens: (keep mask [s, s], loss mask [s], position ids [s])."""
    s = len(tokens)
    keep = torch.ones(s, s).tril()
    loss_mask = torch.ones(s)
    loss_mask[tokens == eod] = 0.0
    positions = torch.arange(s)
    prev = 0
    for i in (positions[tokens == eod]).tolist():
        keep[i + 1:, : i + 1] = 0
        positions[i + 1:] -= i + 1 - prev
        prev = i + 1
    return keep.bool(), loss_mask, positions


def test_fields_match_megatron_on_random_and_edge_samples():
    gen = torch.Generator().manual_seed(0)
    samples = [torch.tensor([EOD, 5, 6, EOD, EOD, 7, 8, EOD]), torch.tensor([4, 5, 6]), torch.tensor([EOD, EOD])]
    samples += [torch.randint(0, 4, (24,), generator=gen) for _ in range(50)]  # ~1 eod in 4
    for tokens in samples:
        keep, loss_mask, positions = _megatron_reference(tokens, EOD)
        fields = packed_document_fields(tokens, tokens + 1, EOD, True, True, True)
        assert torch.equal(fields["position_ids"], positions)
        docs = fields["document_ids"]
        assert torch.equal((docs[:, None] == docs[None, :]).tril(), keep)
        assert torch.equal(fields["labels"] != IGNORE_INDEX, loss_mask.bool())
    batch = torch.stack(samples[3:6])
    assert torch.equal(document_position_ids(batch, EOD), torch.stack([document_position_ids(t, EOD) for t in batch]))
    assert torch.equal(document_ids(batch, EOD), torch.stack([document_ids(t, EOD) for t in batch]))


def test_eod_mask_loss_drops_exactly_the_eod_inputs_and_nothing_else():
    tokens = torch.tensor([3, 4, EOD, 5, EOD, EOD, 6, 7])
    labels = torch.tensor([4, EOD, 5, EOD, EOD, 6, 7, IGNORE_INDEX])
    fields = packed_document_fields(tokens, labels, EOD, eod_mask_loss=True)
    assert set(fields) == {"labels"}
    dropped = fields["labels"] == IGNORE_INDEX
    assert torch.equal(dropped, (tokens == EOD) | (labels == IGNORE_INDEX))
    assert torch.equal(fields["labels"][~dropped], labels[~dropped])
    assert labels[2] == 5  # the sample's own labels are untouched


class _Samples(torch.utils.data.Dataset):
    data_prefix = "in-memory"

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i][:-1], "labels": self.rows[i][1:]}


def test_dataset_wrapper_adds_only_the_enabled_keys_and_collates():
    rows = [torch.tensor([1, 2, EOD, 3, 4, 5]), torch.tensor([EOD, 7, 8, 9, EOD, 1])]
    base = _Samples(rows)
    assert wrap_packed_documents(base, None) is base  # options off: the very dataset, batches unchanged
    ds = wrap_packed_documents(base, EOD, reset_attention_mask=True, eod_mask_loss=True)
    assert isinstance(ds, PackedDocumentDataset) and len(ds) == 2 and ds.data_prefix == "in-memory"
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=2)))
    assert set(batch) == {"input_ids", "labels", "document_ids"}
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[2, EOD, IGNORE_INDEX, 4, 5], [IGNORE_INDEX, 8, 9, EOD, IGNORE_INDEX]]


@pytest.mark.parametrize("options", [dict(reset_position_ids=True), dict(reset_attention_mask=True),
                                     dict(eod_mask_loss=True)])
def test_an_option_without_the_eod_id_is_refused_in_one_line(options):
    with pytest.raises(UsageError, match=r"set dataloader\.train\.eod_token_id") as err:
        wrap_packed_documents(_Samples([torch.arange(4)]), None, **options)
    assert "\n" not in str(err.value)
    with pytest.raises(UsageError, match="non-negative token id"):
        check_packing_options(-1, **options)


# ---------------------------------------------------------------- models from the project configs

def _model(project):
    """A tiny fp32 model, dropout off, from the project's own config (GQA 4/2 heads for Llama)."""
    config = {"gpt": "projects/GPT/configs/gpt2_pretrain.py", "llama": "projects/Llama/configs/llama_demo.py"}
    node = LazyConfig.load(str(ROOT / config[project])).model
    node.cfg.update(hidden_layers=2, vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    max_seq_length=32)
    if project == "gpt":
        node.cfg.update(embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
    else:
        node.cfg.update(num_key_value_heads=2)
    torch.manual_seed(0)
    return instantiate(node).eval()


def _documents(gen, lengths):
    """Documents of the given lengths, each ending with EOD, their other tokens never EOD."""
    return [torch.cat([torch.randint(1, VOCAB, (n - 1,), generator=gen), torch.tensor([EOD])]) for n in lengths]


def _packed_sample(docs, extra):
    """One sample cut from the stream docs + a next document's first ``extra`` tokens (as GPTDataset cuts)."""
    stream = torch.cat(docs + [torch.arange(1, extra + 1)])
    return stream[:-1], stream[1:]


@pytest.mark.parametrize("project", ["gpt", "llama"])
def test_per_document_losses_equal_each_document_run_alone(project):
    model = _model(project)
    gen = torch.Generator().manual_seed(1)
    layouts = [(7, 12, 5), (4, 9, 11)]  # two samples of 24 input tokens: 3 documents + 1 cut-off token
    samples = [_packed_sample(_documents(gen, lens), extra=1) for lens in layouts]
    input_ids = torch.stack([s[0] for s in samples])
    labels = torch.stack([s[1] for s in samples])
    fields = packed_document_fields(input_ids, labels, EOD, reset_position_ids=True, reset_attention_mask=True)

    with torch.no_grad():
        logits = model(input_ids, position_ids=fields["position_ids"], document_ids=fields["document_ids"])["logits"]
        leaky = model(input_ids)["logits"]  # plain causal attention over the whole sample
        for row, lens in enumerate(layouts):
            start = 0
            for doc, n in enumerate(lens):
                span = slice(start, start + n)
                alone_ids, alone_labels = input_ids[row:row + 1, span], labels[row:row + 1, span]
                alone = model(alone_ids)["logits"]
                torch.testing.assert_close(logits[row:row + 1, span], alone, rtol=RTOL, atol=ATOL)
                # Per-document loss sum (the criterion): packed labels kept on this document only.
                only_doc = torch.full_like(labels, IGNORE_INDEX)
                only_doc[row, span] = labels[row, span]
                packed_nll = model(input_ids, labels=only_doc, **{k: fields[k] for k in ("position_ids",
                                                                                        "document_ids")})["nll_sum"]
                alone_nll = model(alone_ids, labels=alone_labels)["nll_sum"]
                torch.testing.assert_close(packed_nll, alone_nll, rtol=RTOL, atol=0.0)
                if doc:  # without the options later documents see earlier ones: the test can fail
                    assert (leaky[row:row + 1, span] - alone).abs().max() > 1e-3
                start += n


@pytest.mark.parametrize("project", ["gpt", "llama"])
def test_pipeline_stages_pass_the_packed_fields_to_every_stage(project):
    """pipeline_batch sends position_ids and document_ids to every stage (torch's schedules hand each stage
    the kwargs); two stages cut as the splitter cuts them reproduce the whole model's per-token loss."""
    wrapper = _model(project)
    inner = wrapper.pipeline_module()
    gen = torch.Generator().manual_seed(2)
    input_ids, labels = _packed_sample(_documents(gen, (6, 10, 7)), extra=2)
    batch = {"input_ids": input_ids[None], "labels": labels[None]}
    batch.update(packed_document_fields(batch["input_ids"], batch["labels"], EOD, True, True))
    args, kwargs, target = wrapper.pipeline_batch(batch)
    assert {"position_ids", "document_ids"} <= set(kwargs) and target is batch["labels"]

    first, last = copy.deepcopy(inner), copy.deepcopy(inner)
    first.final_layernorm = first.lm_head = None
    del first.layers["1"]
    last.embeddings = None
    del last.layers["0"]
    with torch.no_grad():
        staged = last(first(*args, **kwargs), **kwargs)
        whole = inner(*args, **kwargs)
        assert torch.equal(staged, whole)
        assert torch.isclose(wrapper.pipeline_loss_fn(staged, target), wrapper(**batch)["lm_loss"], rtol=RTOL)
        # The stages did use the fields: without them the loss changes.
        plain = {k: v for k, v in kwargs.items() if k not in ("position_ids", "document_ids")}
        assert not torch.allclose(last(first(*args, **plain), **plain), staged, rtol=1e-3)


def _tp2_worker(rank, init_file):
    """Under tensor parallelism (with and without sequence parallelism) the packed fields are replicated like
    input_ids: the loss and gradients equal the one-process model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from libai_lite.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel_context

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        gen = torch.Generator().manual_seed(3)
        rows = [_packed_sample(_documents(gen, lens), extra=1) for lens in ((5, 9, 10), (12, 4, 8))]
        batch = {"input_ids": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}
        batch.update(packed_document_fields(batch["input_ids"], batch["labels"], EOD, True, True, True))
        for project in ("gpt", "llama"):
            for sp in (False, True):
                reference = _model(project).train()
                model = apply_tensor_parallel(copy.deepcopy(reference), mesh, sequence_parallel=sp)
                expected = reference(**batch)
                expected["lm_loss"].backward()
                with loss_parallel_context(True):
                    got = model(**batch)
                    got["lm_loss"].backward()
                torch.testing.assert_close(got["lm_loss"], expected["lm_loss"], rtol=RTOL, atol=0.0)
                for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{project} sp={sp} {name}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tensor_and_sequence_parallel_tp2_give_the_one_process_packed_loss(tmp_path):
    from tests.launch import spawn_ranks

    spawn_ranks(_tp2_worker, 2, (str(tmp_path / "store"),))


def _pp2_worker(rank, port, result_dir):
    """Two pipeline ranks run the trainer's pipeline path (GPipe, 2 micro-batches) on a packed batch of the
    tiny Llama: each stage gets position_ids (its rotary) and document_ids through pipeline_batch."""
    import os

    from libai_lite.parallel.pipeline import PipelineStepper
    from libai_lite.parallel.pipeline_split import build_stage_modules, local_stage_ids
    from libai_lite.utils.distributed import destroy, setup_dist
    from libai_lite.utils.parallel_dims import layer_stages

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = setup_dist({"pipeline_parallel_size": 2, "timeout": 120})
    try:
        gen = torch.Generator().manual_seed(4)
        rows = [_packed_sample(_documents(gen, lens), extra=1) for lens in ((5, 9, 10), (12, 4, 8))]
        batch = {"input_ids": torch.stack([r[0] for r in rows]), "labels": torch.stack([r[1] for r in rows])}
        batch.update(packed_document_fields(batch["input_ids"], batch["labels"], EOD, True, True, True))
        model = _model("llama")
        expected = [float(model(**{k: v[i:i + 1] for k, v in batch.items()})["lm_loss"]) for i in range(2)]
        stage_ids = local_stage_ids(ctx.pp_rank, 2)
        stages, _ = build_stage_modules(model, stage_ids, 2, layer_stages(2, 2))
        stepper = PipelineStepper(stages, stage_ids, 2, ctx.group("pp"), ctx.device, "gpipe", 2,
                                  model.pipeline_loss_fn, batch_fn=model.pipeline_batch)
        inputs, kwargs, labels = stepper.split_batch(batch)
        loss = float(stepper.step(inputs, labels, kwargs=kwargs))
        torch.save({"loss": loss, "expected": sum(expected) / 2}, f"{result_dir}/rank{rank}.pt")
        torch.distributed.barrier()
    finally:
        destroy()


# With -m slow: the packed masks are built per layer, which tp2 and sequence parallelism test by default.
@pytest.mark.slow
def test_pipeline_parallel_pp2_gives_the_one_process_packed_loss(tmp_path):
    from tests.launch import free_port, spawn_ranks

    spawn_ranks(_pp2_worker, 2, (free_port(), str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["loss"] == pytest.approx(got["expected"], rel=RTOL)


# ---------------------------------------------------------------- the loader options (libai_lite/data/build.py)

DEMO = "data_test/gpt2/demo_gpt2_text_document"  # its documents end with the GPT-2 tokenizer's eod, id 0


def _loaders(cache, **options):
    from libai_lite.data import build_gpt_train_valid_test_loaders

    return build_gpt_train_valid_test_loaders(str(ROOT / DEMO), seq_length=64, num_workers=0, cache_dir=str(cache),
                                              train_valid_test_num_samples=[8, 6, 0], micro_batch_size=4, **options)


def test_loaders_carry_the_fields_in_every_split_and_nothing_when_off(tmp_path):
    plain = _loaders(tmp_path)
    packed = _loaders(tmp_path, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                      eod_token_id=EOD)
    assert packed[2] is None
    documents = 0
    for plain_loader, packed_loader in zip(plain[:2], packed[:2]):
        for p, q in zip(plain_loader, packed_loader, strict=True):
            assert set(p) == {"input_ids", "labels"}
            assert set(q) == {"input_ids", "labels", "position_ids", "document_ids"}
            assert torch.equal(p["input_ids"], q["input_ids"])
            for key, value in packed_document_fields(p["input_ids"], p["labels"], EOD, True, True, True).items():
                assert torch.equal(q[key], value), key
            documents = max(documents, int(q["document_ids"].max()) + 1)
    assert documents >= 2  # the demo's short documents: a 64-token sample spans several


def test_loaders_refuse_an_option_without_the_eod_id_before_building_anything(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"^reset_attention_mask needs the end-of-document token id: set "
                                         r"dataloader\.train\.eod_token_id"):
        _loaders(cache, reset_attention_mask=True)
    assert not cache.exists() or not any(cache.iterdir())


def test_training_with_the_options_from_the_config(tmp_path):
    """tools/train_net.py with the three options set on the command line: trains and evaluates; the
    trainer fills in eod_token_id from the run's tokenizer, which the loader alone refuses without."""
    from tests.launch import losses, tiny, train_net

    out = tmp_path / "run"
    options = ["dataloader.train.reset_position_ids=True", "dataloader.train.reset_attention_mask=True",
               "dataloader.train.eod_mask_loss=True"]
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=3", "train.evaluation.eval_period=3", *options))
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(out)
    assert sorted(curve) == [1, 2, 3] and all(0 < v < 20 for v in curve.values())
