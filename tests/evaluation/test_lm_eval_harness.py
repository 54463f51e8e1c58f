"""lm-evaluation-harness through tools/eval_harness.py: tasks defined by local YAML over data_test/ (nothing
downloads), each answer checked against tools/evaluate.py or transformers scoring the same checkpoint."""
import glob
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "data_test/lambada_sample.jsonl"
MAX_LEN = 32  # the tiny GPT's max_seq_length (tests.launch.tiny)
GEN_TOKENS = 6

CONTEXT = "{{text.split(' ')[:-1]|join(' ')}}"
TARGET = "{{' '+text.split(' ')[-1]}}"


def _task(name: str, data: Path, body: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


def write_tasks(where: Path, data: Path = SAMPLE) -> Path:
    """The three request kinds over one JSON-lines file: lambada_openai's recipe, a perplexity task like
    wikitext's, and a greedy continuation of each passage's context."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "lambada_local.yaml").write_text(_task("lambada_local", data, f"""output_type: loglikelihood
doc_to_text: "{CONTEXT}"
doc_to_target: "{TARGET}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""))
    (where / "rolling_local.yaml").write_text(_task("rolling_local", data, """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""))
    (where / "generate_local.yaml").write_text(_task("generate_local", data, f"""output_type: generate_until
doc_to_text: "{CONTEXT}"
doc_to_target: "{TARGET}"
generation_kwargs:
  until: ["e"]
  max_gen_toks: {GEN_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
"""))
    return where


def harness_env(tmp: Path) -> dict:
    from tests.launch import env

    # datasets' json builder reads the local file; offline, a stray download fails instead of hanging.
    return env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf_home"),
               HF_DATASETS_CACHE=str(tmp / "hf_datasets"))


def run_harness(tmp: Path, model_args: str, tasks: str, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "tools/eval_harness.py", "--model", "libai_lite", "--model_args", model_args,
           "--tasks", tasks, "--include_path", str(write_tasks(tmp / "tasks")), "--output_path", str(tmp / "out"),
           "--log_samples", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=harness_env(tmp), capture_output=True, text=True, timeout=600)


def samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    rows = [json.loads(line) for line in open(path)]
    return sorted(rows, key=lambda r: r["doc_id"])


def texts() -> list[str]:
    return [json.loads(line)["text"] for line in SAMPLE.read_text().splitlines() if line.strip()]


GPT_ARGS = ",".join(["config=projects/GPT/configs/gpt2_pretrain.py", "model.cfg.hidden_layers=2",
                     "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128", "model.cfg.num_attention_heads=2",
                     f"model.cfg.max_seq_length={MAX_LEN}"])


@pytest.fixture(scope="module")
def gpt_run(trained, tmp_path_factory):
    """The scoring tasks on the shared tiny GPT checkpoint, in one harness run pointed at the trained run's
    folder (train.output_dir), and that folder's file hashes before and after it."""
    from tests.launch import tree_hashes

    tmp = tmp_path_factory.mktemp("harness_gpt")
    _, ckpt, evaluate_results = trained
    before = tree_hashes(ckpt.parent)
    r = run_harness(tmp, f"{GPT_ARGS},checkpoint={ckpt},train.output_dir={ckpt.parent}",
                    "lambada_local,rolling_local", "--batch_size", "4")
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp, ckpt, evaluate_results, r, (before, tree_hashes(ckpt.parent))


@pytest.mark.slow
def test_lambada_through_the_harness_equals_tools_evaluate(gpt_run):
    tmp, _, evaluate_results, r, (before, after) = gpt_run
    lambada = evaluate_results["lambada"]
    rows = samples(tmp / "out", "lambada_local")
    assert len(rows) == lambada["lambada_examples"] == 31
    loglik = [float(row["filtered_resps"][0][0]) for row in rows]
    greedy = [row["filtered_resps"][0][1] in (True, "True") for row in rows]
    assert sum(greedy) / len(rows) == lambada["lambada_acc"]
    # Same fp32 forward on the same tokens, batched differently: summed in float64 on both sides.
    assert -sum(loglik) == pytest.approx(math.log(lambada["lambada_ppl"]) * lambada["lambada_target_tokens"],
                                         rel=1e-5)
    assert "lambada_local" in r.stdout and "lm_eval/log.txt" in after
    # The harness writes its log and config to <train.output_dir>/lm_eval/ and nothing else of the run.
    assert ({k: v for k, v in after.items() if not k.startswith("lm_eval/")}
            == {k: v for k, v in before.items() if not k.startswith("lm_eval/")})


def _our_tokenizer():
    from libai_lite.tokenizer import GPT2Tokenizer

    return GPT2Tokenizer(str(ROOT / "data_test/gpt2/vocab.json"), str(ROOT / "data_test/gpt2/merges.txt"))


@pytest.mark.slow
def test_rolling_loglikelihood_equals_transformers_on_the_same_windows(gpt_run):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from tests.evaluation.test_evaluation import hf_from_checkpoint

    tmp, ckpt, *_ = gpt_run
    hf, tok = hf_from_checkpoint(ckpt), _our_tokenizer()
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    rows = samples(tmp / "out", "rolling_local")
    assert len(rows) == 31
    long_docs = 0
    for text, row in zip(texts(), rows):
        windows = list(map(make_disjoint_window, get_rolling_token_windows(tok.encode(text), prefix, MAX_LEN, 1)))
        long_docs += len(windows) > 1
        expected = 0.0
        for context, pred in windows:
            ids = context + pred
            with torch.no_grad():
                logits = hf(torch.tensor([ids[:-1]])).logits[0, -len(pred):, :tok.vocab_size].double()
            expected += F.log_softmax(logits, -1).gather(1, torch.tensor(pred)[:, None]).sum().item()
        got = row["filtered_resps"][0]
        got = float(got[0] if isinstance(got, list) else got)
        assert got == pytest.approx(expected, rel=1e-5), text
    assert long_docs > 0  # some passages are longer than MAX_LEN tokens: more than one window


@pytest.mark.slow
def test_generate_until_on_an_imported_gpt2_equals_transformers_generate(tmp_path):
    """Left-padded batches of prompts, cut at the stop string, as transformers decodes them one by one."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.checkpoint.test_hf_convert import main as hf_convert

    torch.manual_seed(4)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_positions=MAX_LEN, n_embd=64, n_layer=2, n_head=2,
                                    initializer_range=0.5)).eval()
    hf_dir, ours = tmp_path / "hf", tmp_path / "imported"
    hf.save_pretrained(hf_dir)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(ROOT / "data_test/gpt2" / name, hf_dir)
    assert hf_convert(["import", "--hf-dir", str(hf_dir), "--output", str(ours)]) == 0
    r = run_harness(tmp_path, f"config={ours / 'config.py'},checkpoint={ours},train.output_dir={tmp_path / 'run'}",
                    "generate_local", "--batch_size", "4")
    assert r.returncode == 0, r.stderr[-4000:]
    tok = _our_tokenizer()
    rows = samples(tmp_path / "out", "generate_local")
    assert len(rows) == 31
    cut = 0
    for text, row in zip(texts(), rows):
        ids = tok.encode(text.rsplit(" ", 1)[0])[-(MAX_LEN - GEN_TOKENS):]
        out = hf.generate(torch.tensor([ids]), max_new_tokens=GEN_TOKENS, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        expected = tok.decode([t for t in out[0, len(ids):].tolist() if t != tok.eos_token_id])
        cut += "e" in expected
        assert row["resps"][0][0] == expected.split("e")[0], text
    assert cut > 0  # the stop string cut some continuations


# With -m slow (an import, a harness start-up and transformers' T5 per passage): the seq2seq scoring
# path shares the batching and log-softmax of the decoder-only tests above.
@pytest.mark.slow
def test_seq2seq_loglikelihood_and_generation_equal_transformers_t5(tmp_path):
    """An MT5-family checkpoint (T5 v1.0 imported from transformers): the context is the encoder's input."""
    from transformers import T5Config, T5ForConditionalGeneration

    from libai_lite.tokenizer import SentencePieceTokenizer
    from tests.checkpoint.test_hf_convert import T5_KW, _randomise
    from tests.checkpoint.test_hf_convert import main as hf_convert

    torch.manual_seed(3)
    hf = _randomise(T5ForConditionalGeneration(T5Config(vocab_size=4100, feed_forward_proj="relu", **T5_KW))).eval()
    hf_dir, ours = tmp_path / "hf", tmp_path / "imported"
    hf.save_pretrained(hf_dir)
    shutil.copy(ROOT / "data_test/spm/spiece.model", hf_dir)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 100}))
    assert hf_convert(["import", "--model", "t5", "--hf-dir", str(hf_dir), "--output", str(ours)]) == 0
    # The MT5 recipe trains under bf16 autocast; fp32 here compares with transformers' fp32 at 1e-5.
    r = run_harness(tmp_path, f"config={ours / 'config.py'},checkpoint={ours},train.output_dir={tmp_path / 'run'},"
                              f"max_length=64,train.amp.enabled=False", "lambada_local,generate_local",
                    "--batch_size", "3")
    assert r.returncode == 0, r.stderr[-4000:]

    tok = SentencePieceTokenizer(str(ROOT / "data_test/spm/spiece.model"), extra_ids=100, style="t5")
    eos, vocab = tok.eos_token_id, tok.vocab_size
    for row, text in zip(samples(tmp_path / "out", "lambada_local"), texts()):
        context, word = text.rsplit(" ", 1)
        enc, target = tok.encode(context)[-63:] + [eos], tok.encode(" " + word)
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([enc]),
                        decoder_input_ids=torch.tensor([[0] + target[:-1]])).logits[0, :, :vocab].double()
        logprob = F.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).sum().item()
        greedy = bool((logits.argmax(-1) == torch.tensor(target)).all())
        got_lp, got_greedy = row["filtered_resps"][0]
        assert float(got_lp) == pytest.approx(logprob, rel=1e-5)
        assert (got_greedy in (True, "True")) == greedy
    for row, text in zip(samples(tmp_path / "out", "generate_local"), texts()):
        enc = tok.encode(text.rsplit(" ", 1)[0])[-63:] + [eos]
        new = []
        for _ in range(GEN_TOKENS):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([[0] + new])).logits
            new.append(int(logits[0, -1, :vocab].argmax()))
            if new[-1] == eos:
                new.pop()
                break
        assert row["resps"][0][0] == tok.decode(new).split("e")[0], text


def test_bad_model_args_are_refused_before_any_work():
    """In process: the model refuses its arguments before it sets up a run (nothing is written)."""
    from compat.lm_eval import LibaiLiteLM
    from libai_lite.utils.errors import UsageError

    with pytest.raises(UsageError) as e:
        LibaiLiteLM(config="projects/GPT/configs/gpt2_pretrain.py")
    assert str(e.value) == "the libai_lite model needs --model_args config=CONFIG.py,checkpoint=DIR"
    with pytest.raises(UsageError) as e:
        LibaiLiteLM(config="projects/GPT/configs/gpt2_pretrain.py", checkpoint="ckpt", batch=4)
    assert str(e.value) == ("unknown libai_lite model_args ['batch']: use config, checkpoint, max_length, max_gen_toks, "
                            "add_bos_token, verify or a dotted config override such as train.dist.tensor_parallel_size=2")


def test_a_missing_extra_is_one_line(tmp_path):
    from tests.launch import env

    hide = "import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['tools/eval_harness.py']; " \
           "runpy.run_path('tools/eval_harness.py', run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: lm-evaluation-harness is not installed; install the extra: "
                                "pip install -e '.[eval]'"), r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.slow
def test_tensor_parallel_harness_gives_the_one_process_log_likelihoods(gpt_run, trained):
    """torchrun with tp=2: both ranks run the requests on the vocabulary-split model; rank 0 reports."""
    from tests.launch import free_port

    tmp, ckpt, *_ = gpt_run
    out = tmp / "tp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "tools/eval_harness.py", "--model", "libai_lite", "--model_args",
           f"{GPT_ARGS},checkpoint={ckpt},train.output_dir={out / 'run'},train.dist.tensor_parallel_size=2",
           "--tasks", "lambada_local", "--include_path", str(tmp / "tasks"), "--output_path", str(out / "out"),
           "--log_samples", "--batch_size", "4"]
    r = subprocess.run(cmd, cwd=ROOT, env=harness_env(out), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("|lambada_local|") == 1  # one report, from rank 0
    one = samples(tmp / "out", "lambada_local")
    two = samples(out / "out", "lambada_local")
    for a, b in zip(one, two):
        assert float(b["filtered_resps"][0][0]) == pytest.approx(float(a["filtered_resps"][0][0]), rel=1e-5)
        assert b["filtered_resps"][0][1] == a["filtered_resps"][0][1]


def test_add_bos_token_starts_each_decoder_request_with_bos_but_not_a_rolling_document():
    from compat.lm_eval import LibaiLiteLM

    class Tok:
        bos_token_id = 7

        @staticmethod
        def encode(text):
            return [ord(c) for c in text]

    lm = object.__new__(LibaiLiteLM)  # tok_encode alone, without a run behind it
    lm.tokenizer, lm.backend, lm._add_bos = Tok(), "causal", True
    assert lm.tok_encode("ab") == [7, 97, 98]
    assert lm.tok_encode("ab", add_special_tokens=False) == [97, 98]  # the harness's empty-context case
    ctx, cont = lm._encode_pair("x", " y")
    assert ctx == [7, 120] and cont == [32, 121]
    lm._add_bos = False
    assert lm.tok_encode("ab") == [97, 98]
