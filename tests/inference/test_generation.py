"""Text generation: greedy and seeded sampling against transformers' own generate (GPT-2 with left padding,
T5 and mT5 with a padded encoder), the KV cache against full recomputation, the logits processors against
transformers' LogitsProcessor classes, the padded vocabulary, EOS, and tools/generate.py (one process, tp=2
under torchrun, a Hugging Face directory, refusals)."""
import importlib.util
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from tests.launch import ROOT, env, torchrun
from libai_lite.checkpoint.hf import load_hf_model
from libai_lite.inference import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    build_logits_processors,
    pad_prompts,
)
from libai_lite.layers.attention import KVCache
from libai_lite.utils.errors import UsageError
from projects.MT5.modeling.relative_position import RelativePositionBias
import projects.GPT.modeling  # noqa: F401,E402  (registers the GPT-2 Hugging Face mapping)

VOCAB = 96
GPT_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [40, 41, 42, 43]]
T5_PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 1], [12, 13, 1], [20, 21, 22, 23, 1]]


def _randomise(hf, std):
    """Random T5 weights (norm scales around 1) so greedy decoding does not collapse onto one token."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.3) if "layer_norm" in name else p.normal_(0.0, std)
    return hf.eval()


def _gpt2(vocab_size, n_positions, **kw):
    """A random GPT2LMHeadModel whose greedy continuations vary (wide init; biases and norms randomised too)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3, **kw)
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in name:
                p.normal_(1.0, 0.3)
    return hf.eval()


def _to_ours(hf, tmp_path, name):
    """Our pretraining module for ``hf``, through the library's Hugging Face loader."""
    path = tmp_path / name
    hf.save_pretrained(path)
    _, _, ours = load_hf_model(str(path))
    return ours.eval()


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    torch.manual_seed(0)
    hf = _gpt2(VOCAB, 48, bos_token_id=None, eos_token_id=None)
    return hf, _to_ours(hf, tmp_path_factory.mktemp("gpt"), "gpt2")


@pytest.fixture(scope="module", params=["t5", "mt5"])
def t5(request, tmp_path_factory):
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(1)
    kw = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if request.param == "t5":
        hf = T5ForConditionalGeneration(T5Config(feed_forward_proj="relu", **kw))
    else:
        hf = MT5ForConditionalGeneration(MT5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **kw))
    hf = _randomise(hf, 0.5 if request.param == "t5" else 0.3)
    return hf, _to_ours(hf, tmp_path_factory.mktemp("t5"), request.param)


def _hf_greedy(hf, ids, mask, n, **kw):
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1)


# --------------------------------------------------------------------------------- GPT


@pytest.mark.parametrize("use_cache", [True, False])
def test_gpt_greedy_matches_transformers_with_left_padding(gpt, use_cache):
    hf, ours = gpt
    ids, mask = pad_prompts(GPT_PROMPTS, 0, side="left")
    expected, expected_logits = _hf_greedy(hf, ids, mask, 16, pad_token_id=0)
    got, logits = ours.generate(ids, mask, max_new_tokens=16, use_cache=use_cache, return_logits=True)
    assert torch.equal(got, expected)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    # Not a degenerate model that repeats one token, and the padding really mattered.
    assert all(len(set(row[-16:].tolist())) >= 4 for row in got)
    unmasked = ours.generate(ids, max_new_tokens=16, use_cache=use_cache)
    assert not torch.equal(unmasked, got)


def test_gpt_cache_and_recomputation_give_the_same_logits(gpt):
    _, ours = gpt
    ids, mask = pad_prompts(GPT_PROMPTS, 0, side="left")
    cached, cached_logits = ours.generate(ids, mask, max_new_tokens=20, return_logits=True)
    full, full_logits = ours.generate(ids, mask, max_new_tokens=20, use_cache=False, return_logits=True)
    assert torch.equal(cached, full)
    assert (cached_logits - full_logits).abs().max() <= 1e-5
    # The last step's logits are also those of one plain forward over the whole sequence.
    positions = (torch.cat([mask, torch.ones(3, 19, dtype=torch.long)], 1).cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain = ours.GPT_model(cached[:, :-1], torch.cat([mask, torch.ones(3, 19, dtype=torch.long)], 1), positions)
    assert (plain[:, -1] - cached_logits[:, -1]).abs().max() <= 1e-5


@pytest.mark.parametrize("options", [
    dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3),
    dict(top_p=0.8, top_k=0),
    dict(temperature=1.6, top_k=0),
])
def test_gpt_seeded_sampling_matches_transformers(gpt, options):
    """transformers samples from the global generator; ours from the one given, seeded alike."""
    hf, ours = gpt
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15], [40, 41, 42, 43, 44]])
    torch.manual_seed(123)
    expected = hf.generate(ids, max_new_tokens=16, do_sample=True, pad_token_id=0, **options)
    got = ours.generate(ids, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(123), **options)
    assert torch.equal(got, expected)
    again = ours.generate(ids, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(123), **options)
    other = ours.generate(ids, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(7), **options)
    assert torch.equal(again, got) and not torch.equal(other, got)


def test_top_k_1_sampling_is_greedy(gpt):
    _, ours = gpt
    ids, mask = pad_prompts(GPT_PROMPTS, 0, side="left")
    greedy = ours.generate(ids, mask, max_new_tokens=12)
    sampled = ours.generate(ids, mask, max_new_tokens=12, do_sample=True, top_k=1, temperature=2.0,
                            generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, greedy)


def test_eos_stops_its_row_as_transformers_does(gpt):
    hf, ours = gpt
    ids, mask = pad_prompts(GPT_PROMPTS, 0, side="left")
    free = ours.generate(ids, mask, max_new_tokens=12)
    eos = int(free[0, ids.shape[1] + 3])  # row 0's fourth new token
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)
    got = ours.generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected)
    row = got[0, ids.shape[1]:].tolist()
    stop = row.index(eos)
    assert stop <= 3 and set(row[stop + 1:]) == {0}
    # Rows without that token run on as before; when every row has finished decoding stops early.
    for r in range(3):
        if eos not in got[r, ids.shape[1]:].tolist():
            assert torch.equal(got[r], free[r])
    firsts = free[:, ids.shape[1]].tolist()
    assert ours.generate(ids, mask, max_new_tokens=12, eos_token_id=firsts).shape[1] == ids.shape[1] + 1


def test_padded_vocabulary_ids_are_never_produced(gpt):
    """Our vocabulary is padded to a multiple of 128 x tp; those rows must never be chosen."""
    from projects.GPT.modeling import GPTForPreTraining

    _, ours = gpt
    cfg = {k: getattr(ours.GPT_model, k) for k in ("vocab_size", "hidden_size", "max_seq_length")}
    padded = GPTForPreTraining(dict(hidden_layers=2, vocab_size=128, hidden_size=cfg["hidden_size"],
                                    ffn_hidden_size=128, num_attention_heads=4, max_seq_length=cfg["max_seq_length"],
                                    embedding_dropout_prob=0.0, attention_dropout_prob=0.0,
                                    output_dropout_prob=0.0)).eval()
    sd = ours.GPT_model.state_dict()
    wte = sd["embeddings.token_embeddings.weight"]
    # Untrained padding rows as large as the real ones would win the argmax everywhere.
    sd["embeddings.token_embeddings.weight"] = torch.cat([wte, 5 * wte[:128 - VOCAB]])
    sd["lm_head.weight"] = sd["embeddings.token_embeddings.weight"]
    padded.GPT_model.load_state_dict(sd)
    ids, mask = pad_prompts(GPT_PROMPTS, 0, side="left")
    unrestricted = padded.generate(ids, mask, max_new_tokens=10)
    assert (unrestricted[:, ids.shape[1]:] >= VOCAB).any()
    for options in (dict(), dict(do_sample=True, temperature=3.0, generator=torch.Generator().manual_seed(0))):
        out, logits = padded.generate(ids, mask, max_new_tokens=10, vocab_size=VOCAB, return_logits=True, **options)
        assert (out < VOCAB).all() and logits.shape[-1] == VOCAB
    assert torch.equal(padded.generate(ids, mask, max_new_tokens=10, vocab_size=VOCAB),
                       ours.generate(ids, mask, max_new_tokens=10))


def test_too_long_generation_is_refused(gpt):
    _, ours = gpt
    with pytest.raises(UsageError, match="max_seq_length=48"):
        ours.generate(torch.ones(1, 40, dtype=torch.long), max_new_tokens=9)


# --------------------------------------------------------------------------------- T5 / mT5


@pytest.mark.parametrize("use_cache", [True, False])
def test_t5_greedy_matches_transformers_with_padded_encoder(t5, use_cache):
    hf, ours = t5
    ids, mask = pad_prompts(T5_PROMPTS, 0, side="right")
    expected, expected_logits = _hf_greedy(hf, ids, mask, 14)
    got, logits = ours.generate(ids, mask, max_new_tokens=14, eos_token_id=1, pad_token_id=0, use_cache=use_cache,
                                return_logits=True)
    assert torch.equal(got, expected)
    tol = _fp32_logit_tolerance(expected_logits)
    torch.testing.assert_close(logits, expected_logits[:, : logits.shape[1]], atol=tol, rtol=0)
    assert len(set(got[:, 1:].flatten().tolist())) >= 8  # random T5s like to copy; this one varies enough
    assert not torch.equal(ours.generate(ids, max_new_tokens=14, eos_token_id=1, use_cache=use_cache), got)


def test_t5_cache_and_recomputation_give_the_same_logits(t5):
    _, ours = t5
    ids, mask = pad_prompts(T5_PROMPTS, 0, side="right")
    cached, a = ours.generate(ids, mask, max_new_tokens=20, return_logits=True)
    full, b = ours.generate(ids, mask, max_new_tokens=20, use_cache=False, return_logits=True)
    assert torch.equal(cached, full) and (a - b).abs().max() <= _fp32_logit_tolerance(b)


def _fp32_logit_tolerance(reference: torch.Tensor) -> float:
    """How far two fp32 computations of the same logits may differ: the kernels (AVX2 vs AVX-512,
    cached vs recomputed attention) sum the same terms in other orders, and the rounding of every
    layer's sums carries to the logits in proportion to their size. 256 ulps of the largest logit
    bounds it with room (measured: under 64)."""
    return 256 * torch.finfo(torch.float32).eps * float(reference.abs().max())


def test_decoder_bias_for_a_cached_position_is_the_row_of_the_full_bias():
    table = RelativePositionBias(32, 4, bidirectional=False, max_distance=128)
    full = table.compute_bias(40, 40)
    for t in (0, 7, 20, 39):
        torch.testing.assert_close(table.compute_bias(1, t + 1, query_offset=t), full[:, :, t:t + 1, : t + 1])


# --------------------------------------------------------------------------------- processors and cache


@pytest.fixture
def scores_and_ids():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 50, generator=g) * 3
    ids = torch.randint(0, 50, (4, 12), generator=g)
    return ids, scores


@pytest.mark.parametrize("ours,theirs,args", [
    (RepetitionPenaltyLogitsProcessor, "RepetitionPenaltyLogitsProcessor", (1.5,)),
    (RepetitionPenaltyLogitsProcessor, "RepetitionPenaltyLogitsProcessor", (0.7,)),
    (TemperatureLogitsWarper, "TemperatureLogitsWarper", (0.6,)),
    (TopKLogitsWarper, "TopKLogitsWarper", (1,)),
    (TopKLogitsWarper, "TopKLogitsWarper", (7,)),
    (TopPLogitsWarper, "TopPLogitsWarper", (0.3,)),
    (TopPLogitsWarper, "TopPLogitsWarper", (0.9,)),
    (TopPLogitsWarper, "TopPLogitsWarper", (1e-4,)),
])
def test_processors_match_transformers(scores_and_ids, ours, theirs, args):
    import transformers

    ids, scores = scores_and_ids
    expected = getattr(transformers, theirs)(*args)(ids, scores.clone())
    got = ours(*args)(ids, scores.clone())
    assert torch.equal(got, expected)
    assert not torch.equal(got, scores)


def test_repetition_penalty_skips_ids_marked_as_padding(scores_and_ids):
    ids, scores = scores_and_ids
    masked = ids.clone()
    masked[:, :4] = -1
    expected = RepetitionPenaltyLogitsProcessor(1.5)(ids[:, 4:], scores)
    assert torch.equal(RepetitionPenaltyLogitsProcessor(1.5)(masked, scores), expected)


def test_processor_order_and_refusals():
    chain = build_logits_processors(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.2)
    assert [type(p) for p in chain] == [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                                        TopPLogitsWarper]
    assert [type(p) for p in build_logits_processors(top_k=3, top_p=0.9, repetition_penalty=1.2)] == [
        RepetitionPenaltyLogitsProcessor]
    assert build_logits_processors(do_sample=True) == []
    for bad in (dict(top_p=1.5), dict(top_p=0.0), dict(temperature=0.0), dict(top_k=-1), dict(repetition_penalty=0.0)):
        with pytest.raises(UsageError) as info:
            build_logits_processors(do_sample=True, **bad)
        assert "\n" not in str(info.value)


def test_kv_cache_with_capacity_equals_a_growing_one():
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 3, n, 4, generator=g) for n in (5, 1, 1, 2)]
    fixed, growing = KVCache(capacity=9), KVCache()
    for k in steps:
        a, b = fixed.update(k, -k), growing.update(k, -k)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert fixed.length == growing.length == 9 and torch.equal(fixed.key, torch.cat(steps, dim=2))
    with pytest.raises(ValueError, match="holds 9 positions"):
        fixed.update(steps[1], steps[1])


# --------------------------------------------------------------------------------- tools/generate.py

TOOL = [sys.executable, "tools/generate.py"]
CONFIG = "projects/GPT/configs/gpt2_pretrain.py"
TINY = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
        "model.cfg.num_attention_heads=4", "model.cfg.max_seq_length=64"]
PROMPTS = ["--prompt", "The history of", "--prompt", "Once upon a time there was", "--prompt-ids", "464 318"]


def _tool(args, timeout=180):
    return subprocess.run(TOOL + args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tool(monkeypatch, capsys):
    """tools/generate.py's main() in this process (no interpreter start-up): ``tool(args) -> (rc, stdout, stderr)``."""
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(ROOT)

    def run(args):
        capsys.readouterr()
        rc = module.main(args)
        out = capsys.readouterr()
        return rc, out.out, out.err

    return run


def _generated_ids(stdout) -> list:
    return [line.split(":", 1)[1].split() for line in stdout.splitlines() if re.match(r"ids \d+:", line)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny demo-config GPT saved by the Checkpointer with the vocabulary a tp=2 run pads to (8192)."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.config import LazyConfig, instantiate

    cfg = LazyConfig.apply_overrides(LazyConfig.load(str(ROOT / CONFIG)),
                                     TINY + ["model.cfg.vocab_size=8192", "model.cfg.initializer_range=0.2"])
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("ckpt")
    with warnings.catch_warnings():  # DCP notes that it saves without a process group, as intended here
        warnings.simplefilter("ignore", UserWarning)
        return Checkpointer(instantiate(cfg.model), save_dir=str(out)).save("model_final", {"iteration": 0})


@pytest.fixture(scope="module")
def one_process(checkpoint):
    r = _tool(["--config-file", CONFIG, "--checkpoint", checkpoint, *PROMPTS, "--max-new-tokens", "10",
               "--show-ids", *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_tool_generates_from_a_checkpoint_and_reports_speed(one_process):
    out = one_process.stdout
    assert re.search(r"^generated 30 tokens in [\d.]+ s \([\d.]+ tokens/s\)$", out, re.M), out
    assert "prompt 0: The history of" in out and "prompt 2:" in out and out.count("output ") == 3
    ids = _generated_ids(out)
    assert [len(row) for row in ids] == [10, 10, 10]
    # 8192 rows in the checkpoint, 8000 real tokens: nothing from the padding.
    assert all(int(t) < 8000 for row in ids for t in row)


def test_tool_without_cache_prints_the_same(checkpoint, one_process, tool, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('\n{"text": "Once upon a time there was"}\n')  # with PROMPTS' second prompt, in order
    rc, out, err = tool(["--config-file", CONFIG, "--checkpoint", checkpoint, "--prompt", "The history of",
                         "--prompt-file", str(prompts), "--prompt-ids", "464 318", "--max-new-tokens", "10",
                         "--show-ids", "--no-cache", "--batch-size", "2", *TINY])
    assert rc == 0, err[-3000:]
    assert _generated_ids(out) == _generated_ids(one_process.stdout)


def test_tool_under_tp2_matches_one_process(checkpoint, one_process):
    r = torchrun(2, "tools/generate.py", "--config-file", CONFIG, "--checkpoint", checkpoint, *PROMPTS,
                 "--max-new-tokens", "10", "--show-ids", *TINY, "train.dist.tensor_parallel_size=2")
    assert _generated_ids(r.stdout) == _generated_ids(one_process.stdout)
    assert r.stdout.count("tokens/s") == 1  # rank 0 prints


def test_tool_help():
    r = _tool(["--help"])
    assert r.returncode == 0 and "--prompt-file" in r.stdout and "--top-p" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--config-file", CONFIG, "--checkpoint", "no/such/dir", "--prompt", "x"], "no/such/dir is missing or incomplete"),
    (["--prompt", "x"], "give either --config-file CONFIG --checkpoint DIR or --hf-dir DIR"),
    (["--config-file", CONFIG, "--checkpoint", "CKPT", "--prompt", "x", "train.dist.tensor_parallel_size=2"],
     "launch torchrun --nproc_per_node 2"),
    (["--config-file", CONFIG, "--checkpoint", "CKPT", "--prompt-ids", "1 x"], "is not a list of integers"),
    (["--config-file", CONFIG, "--checkpoint", "CKPT", "--prompt", "x", "--top-p", "2"], "top_p=2.0 must be in"),
    (["--config-file", CONFIG, "--checkpoint", "CKPT", "--prompt-ids", "5 9000", *TINY],
     "outside the vocabulary [0, 8000)"),
])
def test_tool_refusals_are_one_line(tool, checkpoint, args, message):
    rc, out, err = tool([checkpoint if a == "CKPT" else a for a in args])
    assert rc == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], err


HF_TEXTS = ["The history of", "Once upon a time there was"]


def _hf_dir(path, kind):
    """A random transformers model saved with the demo tokenizer files in ``path``; returns its greedy
    continuations of ``HF_TEXTS`` (8 new tokens, padding after EOS) and its EOS id."""
    from transformers import T5Config, T5ForConditionalGeneration

    from libai_lite.tokenizer import GPT2Tokenizer, SentencePieceTokenizer

    torch.manual_seed(2)
    if kind == "gpt2":
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(ROOT / "data_test" / "gpt2" / name, path / name)
        tok = GPT2Tokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        hf = _gpt2(tok.vocab_size, 64, bos_token_id=tok.eod_id, eos_token_id=tok.eod_id)
        ids, mask = pad_prompts([tok.encode(t) for t in HF_TEXTS], tok.eod_id, side="left")
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               pad_token_id=tok.eod_id)[:, ids.shape[1]:]
    else:
        shutil.copy(ROOT / "data_test" / "spm" / "spiece.model", path / "spiece.model")
        tok = SentencePieceTokenizer(str(path / "spiece.model"), extra_ids=100, style="t5")
        hf = _randomise(T5ForConditionalGeneration(T5Config(
            vocab_size=tok.vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)), 0.3)
        ids, mask = pad_prompts([tok.encode(t) + [1] for t in HF_TEXTS], 0, side="right")
        expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, 1:]
    hf.save_pretrained(path)
    return expected.tolist(), hf.config.eos_token_id


def _assert_same_continuations(stdout, expected, eos):
    got = _generated_ids(stdout)
    assert len(got) == len(expected), stdout
    for row, exp in zip(got, expected):
        assert [int(t) for t in row] == exp[: len(row)]
        assert len(row) == 8 or exp[len(row) - 1] == eos  # the tool prints up to a row's EOS


HF_ARGS = ["--max-new-tokens", "8", "--show-ids", "--prompt", HF_TEXTS[0], "--prompt", HF_TEXTS[1]]


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_tool_on_a_hugging_face_directory_matches_transformers(tmp_path, tool, kind):
    """The tool's tokenizer handling, padding and special ids, checked against transformers' generate."""
    expected, eos = _hf_dir(tmp_path, kind)
    rc, out, err = tool(["--hf-dir", str(tmp_path), *HF_ARGS])
    assert rc == 0, err[-3000:]
    _assert_same_continuations(out, expected, eos)


@pytest.mark.slow
def test_tool_under_tp2_on_a_t5_directory_matches_transformers(tmp_path):
    """T5 under tensor parallelism: each rank's heads, their share of the relative bias table, both caches."""
    expected, eos = _hf_dir(tmp_path, "t5")
    r = torchrun(2, "tools/generate.py", "--hf-dir", tmp_path, *HF_ARGS)
    _assert_same_continuations(r.stdout, expected, eos)
