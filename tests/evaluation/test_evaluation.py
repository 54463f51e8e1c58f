"""Perplexity over JSON lines and LAMBADA cloze accuracy, checked against Hugging Face transformers.

The reference numbers come from `GPT2LMHeadModel` and transformers' own GPT-2 tokenizer, one
passage or window at a time; ours batch, pad, truncate, shard and split the vocabulary.
Also runnable as a torchrun worker (`python tests/evaluation/test_evaluation.py worker OUT.json ARGS...`).
"""
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from libai_lite.data.gpt_dataset import IGNORE_INDEX
from libai_lite.data.jsonl_dataset import (TokenWindowDataset, build_ppl_eval_loader, indexed_token_stream,
                                           read_jsonl_texts)
from libai_lite.evaluation import EvalContext, LambadaEvaluator, PPLEvaluator, inference_on_dataset
from libai_lite.evaluation.lambada import load_lambada, split_last_word
from libai_lite.tokenizer import GPT2Tokenizer
from libai_lite.utils.errors import UsageError
from tests.launch import kept_logger, python_tool

ROOT = Path(__file__).resolve().parents[2]
VOCAB, MERGES = ROOT / "data_test/gpt2/vocab.json", ROOT / "data_test/gpt2/merges.txt"
SAMPLE = ROOT / "data_test/lambada_sample.jsonl"
PADDED_VOCAB = 8064  # 8000 ids padded to a multiple of 128
TINY = dict(hidden_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, max_seq_length=64,
            embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)

# Passages whose target words share no token with the memorised ones: a model that has seen
# nothing else cannot produce them.
UNSEEN = [
    "Every winter the pond froze solid and the villagers went skating. On the coldest night a fox crossed the ice",
    "Quentin kept a journal of every comet he observed from the hill. His proudest entry described Halley",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls run fastest on one thread, above all on a machine other jobs keep busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import GPT2TokenizerFast

    # transformers' own byte-level BPE over the same files: an independent tokenization.
    vocab = json.loads(VOCAB.read_text())
    merges = [tuple(line.split()) for line in MERGES.read_text().splitlines()[1:] if line.strip()]
    return GPT2Tokenizer(str(VOCAB), str(MERGES)), GPT2TokenizerFast(vocab=vocab, merges=merges)


def hf_gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=PADDED_VOCAB, n_positions=TINY["max_seq_length"], n_embd=64, n_layer=2, n_head=4,
                        n_inner=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new",
                        layer_norm_epsilon=1e-5)
    return GPT2LMHeadModel(config).eval()


def ours_from_hf(hf):
    from projects.GPT.modeling.gpt_model import GPTForPreTraining
    from projects.GPT.modeling.hf_mapping import state_dict_from_hf

    cfg = dict(TINY, vocab_size=PADDED_VOCAB)
    model = GPTForPreTraining(cfg)
    model.GPT_model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg))
    return model.eval()


def reference_lambada(hf, hf_tok, texts, max_len, real_vocab=8000):
    """(accuracy, perplexity) one passage at a time with transformers: context + ' ' + last word.

    Probabilities are over the `real_vocab` ids, not the rows the embedding is padded with.
    """
    correct, nll, count = 0, 0.0, 0
    for text in texts:
        context, word = text.rsplit(" ", 1)
        ctx, tgt = hf_tok(context).input_ids, hf_tok(" " + word).input_ids
        ids = (ctx + tgt)[-(max_len + 1):]
        with torch.no_grad():
            logits = hf(torch.tensor([ids[:-1]])).logits[0].double()
        pos = torch.arange(len(ids) - 1 - len(tgt), len(ids) - 1)
        target = torch.tensor(tgt)
        nll -= F.log_softmax(logits[pos, :real_vocab], -1).gather(-1, target[:, None]).sum().item()
        correct += bool((logits[pos, :real_vocab].argmax(-1) == target).all())
        count += len(tgt)
    return correct / len(texts), math.exp(nll / count)


class _Records(logging.Handler):
    """Collects the messages of the libai_lite logger, whatever its propagation (setup_logger turns it off)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def restore_logger():
    """Undo what an in-process launch does to the libai_lite logger (handlers, no propagation)."""
    with kept_logger():
        yield


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def run_lambada(model, tokenizer, path, batch_size=4, max_seq_length=None):
    ctx = EvalContext(tokenizer=tokenizer, micro_batch_size=batch_size, max_seq_length=TINY["max_seq_length"])
    return LambadaEvaluator(str(path), max_seq_length=max_seq_length).evaluate_model(model, ctx)


# ------------------------------------------------------------------------------------ parsing
def test_last_word_split_and_file_errors(tmp_path):
    assert split_last_word("a b  c\n") == ("a b", "c")
    assert split_last_word("He said:\nthe end") == ("He said:\nthe", "end")
    assert split_last_word("single") is None
    assert len(load_lambada(SAMPLE)) == 31
    bad = {
        "missing": (tmp_path / "nope.jsonl", "not found"),
        "empty": (write_jsonl(tmp_path / "empty.jsonl", []), "holds no documents"),
        "key": (write_jsonl(tmp_path / "key.jsonl", ["a b"], key="body"), "line 1 has no 'text' field"),
        "json": (tmp_path / "json.jsonl", "line 2 is not valid JSON"),
        "one word": (write_jsonl(tmp_path / "one.jsonl", ["two words", "one"]), "line 2 has fewer than two words"),
    }
    (tmp_path / "json.jsonl").write_text('{"text": "a b"}\n{text: c d}\n')
    for path, needle in bad.values():
        with pytest.raises(UsageError, match=needle) as e:
            load_lambada(path)
        assert "\n" not in str(e.value)
    assert read_jsonl_texts(write_jsonl(tmp_path / "other.jsonl", ["x y"], key="body"), "body") == ["x y"]


# ------------------------------------------------------------------------------------ LAMBADA
@pytest.fixture(scope="module")
def memorised(tokenizers):
    """A GPT-2 trained (with transformers) until it completes four sample passages, and ours with its weights."""
    _, hf_tok = tokenizers
    texts = read_jsonl_texts(SAMPLE)[:4]
    ids = [hf_tok(t).input_ids for t in texts]
    n = max(map(len, ids))
    batch = torch.tensor([x + [0] * (n - len(x)) for x in ids])
    labels = torch.tensor([x + [IGNORE_INDEX] * (n - len(x)) for x in ids])
    # The positions that predict each passage's last word.
    target = torch.zeros(len(texts), n - 1, dtype=torch.bool)
    for row, (x, text) in enumerate(zip(ids, texts)):
        k = len(hf_tok(" " + text.rsplit(" ", 1)[1]).input_ids)
        target[row, len(x) - 1 - k:len(x) - 1] = True
    hf = hf_gpt2(seed=1).train()
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    extra = None
    for _ in range(300):
        out = hf(batch, labels=labels)
        right = bool((out.logits[:, :-1].argmax(-1) == batch[:, 1:])[target].all())
        # Some steps beyond the first all-right one, so no target is a near tie.
        extra = 10 if right and extra is None else extra
        if extra is not None:
            extra -= 1
            if extra < 0:
                break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert extra is not None and extra < 0, "the passages were not memorised"
    hf.eval()
    return texts, hf, ours_from_hf(hf)


def test_lambada_memorised_passages_are_right_and_match_transformers(tokenizers, memorised, tmp_path):
    ours_tok, hf_tok = tokenizers
    texts, hf, ours = memorised
    # Multi-token targets: ' lighthouse' and ' tomatoes' are 5 tokens each in the demo vocabulary.
    assert [len(ours_tok.encode(" " + t.rsplit(" ", 1)[1])) for t in texts] == [5, 5, 2, 5]
    path = write_jsonl(tmp_path / "mixed.jsonl", texts[:2] + UNSEEN + texts[2:])

    got = run_lambada(ours, ours_tok, path, batch_size=4)
    acc, ppl = reference_lambada(hf, hf_tok, texts[:2] + UNSEEN + texts[2:], TINY["max_seq_length"])
    assert got["lambada_acc"] == pytest.approx(4 / 6) == acc
    assert got["lambada_ppl"] == pytest.approx(ppl, rel=1e-5)
    assert got["lambada_examples"] == 6
    assert run_lambada(ours, ours_tok, write_jsonl(tmp_path / "mem.jsonl", texts))["lambada_acc"] == 1.0
    # One passage per batch (no padding) gives the same numbers.
    one = run_lambada(ours, ours_tok, path, batch_size=1)
    assert one["lambada_acc"] == got["lambada_acc"]
    assert one["lambada_ppl"] == pytest.approx(got["lambada_ppl"], rel=1e-6)

    # Longer than the model reads: the context keeps its rightmost tokens, warned once with the count.
    records = _Records()
    logging.getLogger("libai_lite").addHandler(records)
    try:
        short = run_lambada(ours, ours_tok, path, batch_size=4, max_seq_length=20)
    finally:
        logging.getLogger("libai_lite").removeHandler(records)
    acc20, ppl20 = reference_lambada(hf, hf_tok, texts[:2] + UNSEEN + texts[2:], 20)
    assert short["lambada_acc"] == pytest.approx(acc20)
    assert short["lambada_ppl"] == pytest.approx(ppl20, rel=1e-5)
    assert short["lambada_ppl"] != pytest.approx(got["lambada_ppl"], rel=1e-3)
    warnings = [m for m in records.messages if "longer than max_seq_length" in m]
    assert warnings == [f"6 of 6 LAMBADA passages in {path} are longer than max_seq_length=20 tokens: "
                        f"their context keeps the rightmost tokens"]


def test_lambada_random_model_matches_transformers_on_sample(tokenizers):
    ours_tok, hf_tok = tokenizers
    hf = hf_gpt2(seed=3)
    got = run_lambada(ours_from_hf(hf), ours_tok, SAMPLE, batch_size=8)
    acc, ppl = reference_lambada(hf, hf_tok, read_jsonl_texts(SAMPLE), TINY["max_seq_length"])
    assert got["lambada_acc"] == acc
    assert got["lambada_ppl"] == pytest.approx(ppl, rel=1e-5)
    assert got["lambada_target_tokens"] > got["lambada_examples"] == 31


def test_lambada_never_predicts_vocabulary_padding(tokenizers, memorised, tmp_path):
    import copy

    ours_tok, hf_tok = tokenizers
    texts, hf, _ = memorised
    hf = copy.deepcopy(hf)
    # One padding row (ids 8000..8063) per target position, along that position's final hidden
    # state and scaled so its logit beats the memorised answer there by 2. Padding rows are never
    # inputs, so the real ids' logits are unchanged: a restricted argmax still gets every passage right.
    states, best = [], []
    with torch.no_grad():
        for text in texts:
            context, word = text.rsplit(" ", 1)
            ids = hf_tok(context).input_ids + hf_tok(" " + word).input_ids
            k = len(hf_tok(" " + word).input_ids)
            out = hf(torch.tensor([ids[:-1]]), output_hidden_states=True)
            states.append(out.hidden_states[-1][0, -k:])
            best.append(out.logits[0, -k:, :8000].max(-1).values)
        h, best = torch.cat(states), torch.cat(best)
        assert len(h) <= 64
        rows = h / (h * h).sum(-1, keepdim=True) * (best + 2.0)[:, None]
        hf.lm_head.weight[8000:8000 + len(h)] = rows
    path = write_jsonl(tmp_path / "mem.jsonl", texts)
    got = run_lambada(ours_from_hf(hf), ours_tok, path)
    acc, ppl = reference_lambada(hf, hf_tok, texts, TINY["max_seq_length"])
    assert got["lambada_acc"] == acc == 1.0
    assert got["lambada_ppl"] == pytest.approx(ppl, rel=1e-5)
    # Padding rows take no probability mass (the model exported to Hugging Face has none): the
    # memorised answers keep theirs although a padding row out-scores each of them.
    assert ppl < 1.5


def test_lambada_refuses_pipeline_and_encoder_decoder(tokenizers):
    ours_tok, _ = tokenizers
    ev = LambadaEvaluator(str(SAMPLE))
    with pytest.raises(UsageError, match="pipeline_parallel_size=1"):
        ev.evaluate_model(torch.nn.Linear(1, 1), EvalContext(tokenizer=ours_tok, max_seq_length=8, pipeline=True))

    class EncoderDecoder(torch.nn.Module):
        def forward(self, encoder_input_ids, decoder_input_ids):
            raise AssertionError("never called")

    with pytest.raises(UsageError, match="decoder-only"):
        ev.evaluate_model(EncoderDecoder(), EvalContext(tokenizer=ours_tok, max_seq_length=8))


# ------------------------------------------------------------------------------------ perplexity
def reference_ppl(hf, hf_tok, texts, max_length, stride):
    """Hugging Face's fixed-length perplexity recipe (docs: 'Perplexity of fixed-length models')."""
    eod = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    stream = torch.tensor([t for text in texts for t in hf_tok(text).input_ids + [eod]])[None]
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, stream.size(1), stride):
        end = min(begin + max_length, stream.size(1))
        trg_len = end - prev_end
        input_ids = stream[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        n = int((target_ids[:, 1:] != -100).sum())
        nll, count = nll + loss.item() * n, count + n
        prev_end = end
        if end == stream.size(1):
            break
    return math.exp(nll / count), count


@pytest.mark.parametrize("stride", [None, 6])
def test_jsonl_perplexity_matches_transformers(tokenizers, tmp_path, stride):
    ours_tok, hf_tok = tokenizers
    texts = [json.loads(line)["text"][:150] for line in (ROOT / "data_test/corpus.jsonl").open().readlines()[:4]]
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    hf = hf_gpt2(seed=2)
    seq = 16
    loader = build_ppl_eval_loader(str(path), seq_length=seq, stride=stride, tokenizer=ours_tok, micro_batch_size=3)
    got = inference_on_dataset(ours_from_hf(hf), loader, PPLEvaluator())
    # Our window of `seq` inputs reads seq + 1 tokens: the recipe's max_length.
    ppl, count = reference_ppl(hf, hf_tok, texts, seq + 1, stride or seq)
    assert got["tokens"] == count
    assert got["PPL"] == pytest.approx(ppl, rel=1e-5)


def test_windows_score_every_token_once():
    tokens = np.arange(1, 24)
    for seq, stride in ((5, None), (5, 2), (5, 1), (4, 4), (30, None)):
        ds = TokenWindowDataset(tokens, seq, stride)
        scored = [int(t) for i in range(len(ds)) for t in ds[i]["labels"] if t != IGNORE_INDEX]
        assert scored == list(range(2, 24)), (seq, stride)
        for i in range(len(ds)):
            x, y = ds[i]["input_ids"], ds[i]["labels"]
            keep = y != IGNORE_INDEX
            assert torch.equal(y[keep], x[keep] + 1)  # labels are the next token of the input
    with pytest.raises(UsageError, match="stride=6"):
        TokenWindowDataset(tokens, 5, 6)


def test_prefix_splits_read_documents_in_order():
    from libai_lite.data import get_train_valid_test_split, open_indexed_dataset

    prefix = str(ROOT / "data_test/gpt2/demo_gpt2_text_document")
    ds = open_indexed_dataset(prefix)
    bounds = get_train_valid_test_split("949,50,1", ds.num_documents)
    test = indexed_token_stream(prefix, "test", "949,50,1")
    expected = np.concatenate([ds[i] for i in range(int(ds.doc_idx[bounds[2]]), int(ds.doc_idx[bounds[3]]))])
    assert np.array_equal(test, expected)
    assert indexed_token_stream(prefix).size == int(ds.sizes.sum())


# ------------------------------------------------------------------------------------ end to end
def _tiny(out, cache):
    from tests.launch import tiny

    return tiny(out, cache, "train.test_micro_batch_size=4")


def _evaluate_argv(ckpt, out, cache, *args):
    return ["--config-file", "projects/GPT/configs/gpt2_pretrain.py", "--checkpoint", str(ckpt), *args,
            *_tiny(out, cache)]


TASKS = {
    "lambada": ["--task", "lambada", "--data", "data_test/lambada_sample.jsonl"],
    "ppl_jsonl": ["--task", "ppl", "--data", "data_test/lambada_sample.jsonl", "--stride", "16"],
    "ppl_prefix": ["--task", "ppl", "--split", "test"],
}
LAYOUTS = {"single": [], "dp2": [], "tp2": ["train.dist.tensor_parallel_size=2"]}


def hf_from_checkpoint(ckpt):
    """Our DCP checkpoint as a transformers GPT2LMHeadModel (the exporter's mapping, our loader)."""
    import torch.distributed.checkpoint as dcp
    from transformers import GPT2Config, GPT2LMHeadModel

    from projects.GPT.modeling.gpt_model import GPTModel
    from projects.GPT.modeling.hf_mapping import state_dict_to_hf

    cfg = dict(TINY, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, max_seq_length=32,
               vocab_size=PADDED_VOCAB)
    state = {f"model.GPT_model.{k}": v for k, v in GPTModel(**cfg).state_dict().items()}
    dcp.load(state, checkpoint_id=str(ckpt))
    sd = {k[len("model.GPT_model."):]: v for k, v in state.items()}
    hf_sd = state_dict_to_hf(sd, cfg)
    # One more position than ours: the perplexity recipe feeds the window's last token too, and
    # under causal attention that position's embedding reaches only the output nobody scores.
    hf_sd["transformer.wpe.weight"] = torch.cat([hf_sd["transformer.wpe.weight"], torch.zeros(1, 64)])
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=PADDED_VOCAB, n_positions=33, n_embd=64, n_layer=2, n_head=2,
                                    n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    activation_function="gelu_new"))
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # the tied head
    hf.tie_weights()
    return hf.eval()


def test_evaluate_results_match_transformers(trained, tokenizers):
    tmp, ckpt, results = trained
    _, hf_tok = tokenizers
    hf = hf_from_checkpoint(ckpt)
    acc, ppl = reference_lambada(hf, hf_tok, read_jsonl_texts(SAMPLE), 32)
    assert results["lambada"]["lambada_examples"] == 31
    assert results["lambada"]["lambada_acc"] == pytest.approx(acc)
    assert results["lambada"]["lambada_ppl"] == pytest.approx(ppl, rel=1e-5)
    ppl, count = reference_ppl(hf, hf_tok, read_jsonl_texts(SAMPLE), 33, 16)
    assert results["ppl_jsonl"]["tokens"] == count
    assert results["ppl_jsonl"]["PPL"] == pytest.approx(ppl, rel=1e-5)
    # 30 steps on the demo corpus already beat chance (8000 ids) by far on its held-out documents.
    assert results["ppl_prefix"]["PPL"] < 8000 / 4


def test_evaluate_command_line_prints_and_writes_json(trained):
    tmp, ckpt, results = trained
    out = tmp / "lambada.json"
    cmd = [sys.executable, "tools/evaluate.py", *_evaluate_argv(ckpt, tmp / "cli", tmp / "cache", *TASKS["lambada"]),
           "--output", str(out)]
    r = python_tool(cmd, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("lambada: ")]
    assert len(lines) == 1 and "lambada_acc: " in lines[0], r.stdout[-2000:]
    record = json.loads(out.read_text())
    assert record["task"] == "lambada" and record["checkpoint"] == str(ckpt)
    assert record["results"] == pytest.approx(results["lambada"], rel=1e-6)
    assert (tmp / "cli" / "evaluate" / "log.txt").exists()  # beside the training run's, not over it


def test_data_and_tensor_parallel_give_the_one_process_numbers(trained):
    """dp=2 (31 passages: one rank gets a padding passage) and tp=2 (vocab-split argmax), in one torchrun job.

    The checkpoint was saved at tp=1 with 8064 vocabulary rows, fewer than tp=2 pads to (8192): the
    tool builds the model with the checkpoint's rows.
    """
    from tests.launch import torchrun

    tmp, ckpt, single = trained
    out = tmp / "two.json"
    torchrun(2, "tests/evaluation/test_evaluation.py", "worker", out, ckpt, tmp / "two", tmp / "cache", "dp2", "tp2")
    got = json.loads(out.read_text())
    assert got["greedy_tp2"]
    for layout in ("dp2", "tp2"):
        for name in TASKS:
            assert got[layout][name] == pytest.approx(single[name], rel=1e-5), (layout, name)


def test_lambada_as_the_training_evaluator(tmp_path):
    from tests.launch import train_net

    out = tmp_path / "run"
    r = train_net(_tiny(out, tmp_path / "cache") + [
        "train.train_iter=4", "train.evaluation.eval_period=2",
        "train.evaluation.evaluator._target_=libai_lite.evaluation.LambadaEvaluator",
        "+train.evaluation.evaluator.data_path=data_test/lambada_sample.jsonl",
        "train.evaluation.eval_metric=lambada_acc", "train.evaluation.eval_mode=max"])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.json").open()]
    evals = [row for row in rows if "valid/lambada_acc" in row]
    assert [row["iteration"] for row in evals] == [2, 4]
    assert all(row["valid/lambada_examples"] == 31 and math.isfinite(row["valid/lambada_ppl"]) for row in evals)
    assert (out / "model_best").is_dir()


def test_evaluate_errors_are_one_line(trained, capsys, restore_logger):
    tmp, ckpt, _ = trained
    sys.path.insert(0, str(ROOT / "tools"))
    from evaluate import main

    cases = [
        (ckpt, ["--task", "lambada", "--data", str(tmp / "missing.jsonl")], "not found"),
        (ckpt, ["--task", "lambada"], "needs --data"),
        (tmp / "no_such_checkpoint", TASKS["lambada"], "missing or incomplete"),
        (ckpt, ["--task", "ppl", "--data", str(write_jsonl(tmp / "body.jsonl", ["a b"], key="body"))],
         "has no 'text' field"),
        (ckpt, ["--task", "ppl", "--data", str(tmp / "nowhere/prefix")], "not found"),
    ]
    for path, args, needle in cases:
        assert main(_evaluate_argv(path, tmp / "err", tmp / "cache", *args)) == 1
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_eval_only_evaluates_dataloader_test_files(trained, tmp_path, restore_logger, monkeypatch):
    """A JSON-lines file in a config's `dataloader.test` is scored by --eval-only like tools/evaluate.py scores it."""
    from libai_lite.config import default_argument_parser
    from libai_lite.engine.launch import launch

    tmp, ckpt, single = trained
    config = tmp_path / "with_test_file.py"
    config.write_text(
        "from libai_lite.config import LazyCall\n"
        "from libai_lite.data.jsonl_dataset import build_ppl_eval_loader\n"
        "from projects.GPT.configs.gpt2_pretrain import dataloader, model, optim, tokenization, train\n"
        "dataloader.test = [LazyCall(build_ppl_eval_loader)(data_path='data_test/lambada_sample.jsonl', stride=16)]\n")
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    out = tmp_path / "eval_only"
    args = default_argument_parser().parse_args(["--config-file", str(config), "--eval-only",
                                                 f"train.load_weight={ckpt}", *_tiny(out, tmp / "cache")])
    assert launch(args) == 0
    line = [x for x in (out / "eval_only" / "log.txt").read_text().splitlines() if "Evaluation results:" in x][-1]
    values = dict(kv.split(": ") for kv in line.split("Evaluation results: ")[1].split("  "))
    assert float(values["lambada_sample/PPL"]) == pytest.approx(single["ppl_jsonl"]["PPL"], rel=1e-4)
    assert float(values["lambada_sample/tokens"]) == single["ppl_jsonl"]["tokens"]
    assert "valid/PPL" in values and "test/PPL" in values


def _greedy_tokens_on_split_vocabulary() -> bool:
    """greedy_tokens on logits split over the tp mesh of the last run equals a full-vocabulary argmax."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from libai_lite.evaluation.scoring import greedy_tokens

    logits = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))  # 13 real ids, 3 padding
    logits[0, 0, 14] = 100.0  # a padding row would win
    logits[0, 1, 3] = logits[0, 1, 9] = 50.0  # a tie across shards: the lower id
    logits[1, 0, 10] = logits[1, 0, 11] = 60.0  # a tie inside the second shard
    logits[1, 2, 12] = 70.0  # the last real id, in the second shard
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, :2] = False
    expected = logits[..., :13].argmax(-1)[mask]
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    got = greedy_tokens(distribute_tensor(logits, tp_mesh, [Shard(2)]), mask, 13)
    return bool(torch.equal(got, expected))


def _worker(out, ckpt, run_dir, cache, *layouts):
    """Every TASKS entry under each of `layouts` (keys of LAYOUTS) in this job; rank 0 writes the results."""
    import os

    sys.path.insert(0, str(ROOT / "tools"))
    from evaluate import build_parser, evaluate

    from libai_lite.utils.distributed import destroy

    results = {}
    try:
        for layout in layouts:
            results[layout] = {
                name: evaluate(build_parser().parse_intermixed_args(_evaluate_argv(ckpt, run_dir, cache, *args,
                                                                                   *LAYOUTS[layout])))
                for name, args in TASKS.items()
            }
            if layout == "tp2":
                results["greedy_tp2"] = _greedy_tokens_on_split_vocabulary()
    finally:
        destroy()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    from tests.workers import run_and_exit

    run_and_exit(_worker, *sys.argv[2:])
