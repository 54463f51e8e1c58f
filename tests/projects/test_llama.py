"""projects/Llama: Hugging Face Llama, Mistral, Qwen2, Qwen3 and Mixtral in and out, generation, training under layouts.

Tiny randomly initialised transformers models are saved with save_pretrained, imported with
tools/hf_convert.py, compared logit for logit with transformers, exported and reloaded with
transformers' from_pretrained, and decoded greedily against transformers' generate. A GQA shape
trains under tp=2, pp=2 (1F1B) and dp=2 ZeRO-3 on the one-process loss curve, a Qwen3 shape (per-head
q/k norms) under tp=2 on its curve and to its norm scales. A Llama over a
tokenizer.json that adds BOS exports a tokenizer AutoTokenizer loads with our ids, and generates and
scores (perplexity, LAMBADA) with BOS first, as transformers does.
"""
import os
import shutil
import sys

import pytest
import torch
from omegaconf import OmegaConf

from libai_lite.checkpoint import Checkpointer
from libai_lite.config import LazyConfig
from libai_lite.parallel.tensor_parallel import check_declared_splits
from libai_lite.utils.errors import UsageError
from projects.Llama.modeling import LlamaForPreTraining
from tests.launch import ROOT, losses, one_error_line, python_tool, torchrun, train_net, train_ranks, train_sh

sys.path.insert(0, str(ROOT / "tools"))
from hf_convert import main  # noqa: E402

CONFIG = "projects/Llama/configs/llama_demo.py"
VOCAB = 8000  # data_test/gpt2's tokenizer, which the imported config trains with
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
STEPS = 6


def _hf_model(kind):
    """llama: GQA 4/2 with Llama 3 rope scaling, untied; mistral: multi-query, a sliding window of 5 positions
    (shorter than the test sequences and the cached decoding); qwen2: q/k/v bias, tied; qwen3: per-head q/k norms,
    head_dim 32 over hidden 64 / 4 heads, tied (as its small sizes); mixtral: top-2 of 4 experts; qwen3_moe: Qwen3's
    attention, layer 0 dense (decoder_sparse_step 2) and layer 1 top-2 of 4 experts of width 48, untied."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, rms_norm_eps=1e-6)
    config, model = {
        "llama": (transformers.LlamaConfig(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3, **common),
                  transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig(num_key_value_heads=1, sliding_window=5, rope_theta=1e6, **common),
                    transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common),
                  transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                           rope_theta=1e6, **common), transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig(num_key_value_heads=2, head_dim=32, rope_theta=1e6, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=2,
                                                  norm_topk_prob=True, **common), transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                               **common), transformers.MixtralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    hf = model(config)
    with torch.no_grad():
        # transformers starts norms at 1 and biases at 0: random values expose a swapped one.
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return hf.eval()


def _batch(length=20):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (3, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 13:] = 0
    mask[2, 6:] = 0
    return ids, mask


def _logits_match(ours, hf):
    """Our logits at the real positions of a right-padded batch equal transformers' (causal: padding after)."""
    ids, mask = _batch()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids)["logits"][..., :VOCAB]
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_import_matches_transformers_export_reloads_and_greedy_decoding_agrees(kind, tmp_path):
    hf = _hf_model(kind)
    hf_dir, out, exp = tmp_path / "hf", tmp_path / "imported", tmp_path / "exported"
    hf.save_pretrained(hf_dir)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(ROOT / "data_test" / "gpt2" / name, hf_dir)
    assert main(["import", "--model", kind, "--hf-dir", str(hf_dir), "--output", str(out)]) == 0
    cfg = LazyConfig.load(out / "config.py")
    assert cfg.train.load_weight == str(out) and cfg.model.cfg.vocab_size == 8064  # padded as the trainer pads
    model_cfg = OmegaConf.to_container(cfg.model.cfg, resolve=True)
    assert model_cfg["num_key_value_heads"] == hf.config.num_key_value_heads
    assert model_cfg["qkv_bias"] == (kind == "qwen2") and model_cfg["qk_norm"] == (kind in ("qwen3", "qwen3_moe"))
    assert model_cfg["tie_word_embeddings"] == (kind in ("qwen2", "qwen3"))
    assert model_cfg["head_size"] == (32 if kind in ("qwen3", "qwen3_moe") else None)
    if kind == "qwen3_moe":
        assert (model_cfg["moe"]["every_n_layers"], model_cfg["moe"]["ffn_hidden_size"]) == (2, 48)
    assert model_cfg["sliding_window"] == (5 if kind == "mistral" else None)
    ours = LlamaForPreTraining(model_cfg)
    Checkpointer(ours).load(str(out), weights_only=True)
    ours.eval()
    _logits_match(ours, hf)

    assert main(["export", "--config-file", str(out / "config.py"), "--checkpoint", str(out),
                 "--output", str(exp)]) == 0
    back = type(hf).from_pretrained(exp).eval()
    assert back.config.sliding_window == hf.config.sliding_window if kind == "mistral" else True
    assert back.config.vocab_size == VOCAB
    _logits_match(ours, back)

    # Greedy decoding of a left-padded batch: the cache holds only the key/value heads.
    prompts = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    expected = hf.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=8, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    got = ours.generate(prompts, mask, max_new_tokens=8, vocab_size=VOCAB)
    assert torch.equal(got, expected)
    assert torch.equal(ours.generate(prompts, mask, max_new_tokens=8, vocab_size=VOCAB, use_cache=False), expected)
    # Seeded sampling: transformers draws from the global generator, ours from the one given, seeded alike.
    options = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(123)
    expected = hf.generate(input_ids=prompts, attention_mask=mask, pad_token_id=0, eos_token_id=None, **options)
    got = ours.generate(prompts, mask, vocab_size=VOCAB, generator=torch.Generator().manual_seed(123), **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_tool_on_a_llama_directory_under_tp2_gives_transformers_tokens(kind, tmp_path):
    """tools/generate.py --hf-dir, split over 2 ranks (a key/value head each), decodes as transformers."""
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path / "hf")
    prompt = [5, 17, 300, 42, 7]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(prompt):].tolist()
    r = torchrun(2, "tools/generate.py", "--hf-dir", tmp_path / "hf", "--prompt-ids", " ".join(map(str, prompt)),
                 "--max-new-tokens", "6", "--show-ids", "train.dist.tensor_parallel_size=2")
    ids = next(line for line in r.stdout.splitlines() if line.startswith("ids 0:"))
    assert [int(t) for t in ids.split(":")[1].split()] == expected


def test_import_refuses_biases_llama_lacks_in_one_line(tmp_path, capsys):
    hf = _hf_model("llama")
    hf.config.mlp_bias = True
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "--hf-dir", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "mlp_bias=true" in errors[0]
    assert not os.path.exists(tmp_path / "out")


def test_qwen3_sliding_window_import_and_qk_norm_with_biases_export_are_refused_in_one_line(tmp_path, capsys):
    from projects.Llama.modeling.hf_mapping import config_to_hf

    hf = _hf_model("qwen3")
    hf.config.use_sliding_window = True
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "--hf-dir", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "use_sliding_window=true" in errors[0]
    assert not os.path.exists(tmp_path / "out")
    cfg = dict(hidden_layers=2, vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
               qk_norm=True, qkv_bias=True)
    with pytest.raises(UsageError, match="qk_norm .* cannot be exported"):
        config_to_hf(cfg)
    assert config_to_hf({**cfg, "qkv_bias": False})["architectures"] == ["Qwen3ForCausalLM"]
    moe = dict(enabled=True, num_experts=4, top_k=2, every_n_layers=1, ffn_hidden_size=16)
    assert config_to_hf({**cfg, "qkv_bias": False, "moe": moe})["architectures"] == ["Qwen3MoeForCausalLM"]
    with pytest.raises(UsageError, match="Mixtral's experts are as wide as its feed-forward"):
        config_to_hf({**cfg, "qkv_bias": False, "qk_norm": False, "moe": moe})
    with pytest.raises(UsageError, match="routes by softmax without shared experts"):
        config_to_hf({**cfg, "qkv_bias": False, "moe": {**moe, "router": "sigmoid_bias"}})
    with pytest.raises(UsageError, match="routes by softmax without shared experts"):
        config_to_hf({**cfg, "qkv_bias": False, "moe": {**moe, "num_shared_experts": 1}})


@pytest.mark.parametrize("change, says", [({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
                                          ({"norm_topk_prob": False}, "norm_topk_prob=false")])
def test_qwen3_moe_layouts_not_built_here_are_refused_at_import_in_one_line(tmp_path, capsys, change, says):
    hf = _hf_model("qwen3_moe")
    for key, value in change.items():
        setattr(hf.config, key, value)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "--hf-dir", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0]
    assert not os.path.exists(tmp_path / "out")


# ----------------------------------------------------------------------------------- training

TINY = [
    "dataloader.train.num_workers=0",
    "model.cfg.hidden_layers=2",
    "model.cfg.hidden_size=64",
    "model.cfg.ffn_hidden_size=128",
    "model.cfg.num_attention_heads=4",
    "model.cfg.num_key_value_heads=2",
    "model.cfg.max_seq_length=32",
    "train.train_micro_batch_size=2",
    "train.global_batch_size=8",
    "train.log_period=1",
    f"train.train_iter={STEPS}",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=1000",
    # 8000 ids pad to 8192 for tp 1 and 2 alike, so every layout builds the same model.
    "tokenization.make_vocab_size_divisible_by=256",
]


def _args(tmp, *extra):
    return [f"train.output_dir={tmp / 'out'}", f"dataloader.train.cache_dir={tmp / 'cache'}", *TINY, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama_ref")
    r = train_net(_args(tmp), config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(tmp / "out")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


def test_demo_trains_on_one_process_with_falling_loss(reference):
    assert reference[STEPS] < reference[1] - 0.1


LAYOUTS = {
    "tp2": ["train.dist.tensor_parallel_size=2"],
    "pp2_1f1b": ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=1f1b"],
}

ZERO = "train.zero_optimization.enabled=True"
# One default run covers ZeRO-2 and activation checkpointing together; the rest run with -m slow.
LAYOUTS["dp2_zero2_activation_checkpoint"] = [ZERO, "train.zero_optimization.stage=2",
                                              "train.activation_checkpoint.enabled=True"]

SLOW_LAYOUTS = {
    "dp2_zero1": (2, [ZERO, "train.zero_optimization.stage=1"]),
    "dp2_zero3": (2, [ZERO, "train.zero_optimization.stage=3"]),
    "dp2_zero3_offload": (2, [ZERO, "train.zero_optimization.stage=3", "train.zero_optimization.offload=True"]),
    "tp2_sequence_parallel": (2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
    "tp2_pp2": (4, ["train.dist.tensor_parallel_size=2", "train.dist.pipeline_parallel_size=2"]),
}


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS)])
def test_gqa_shape_trains_the_one_process_curve_under(name, reference, tmp_path):
    nproc, extra = (2, LAYOUTS[name]) if name in LAYOUTS else SLOW_LAYOUTS[name]
    r = train_ranks(nproc, _args(tmp_path, *extra), config=CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(tmp_path / "out")
    assert sorted(curve) == sorted(reference)
    for it in reference:
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), (name, it)


MOE = ["model.cfg.moe.enabled=True", "model.cfg.moe.num_experts=4", "model.cfg.moe.top_k=2"]


@pytest.mark.slow
def test_mixtral_shape_trains_the_one_process_curve_under_expert_parallel_2(tmp_path):
    """Top-2 of 4 experts in every layer, no capacity limit: ep=2 holds two experts per rank."""
    r = train_net(_args(tmp_path / "one", *MOE), config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = losses(tmp_path / "one" / "out")
    assert sorted(reference) == list(range(1, STEPS + 1))
    r = train_ranks(2, _args(tmp_path / "ep2", *MOE, "model.cfg.moe.ep_size=2"), config=CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(tmp_path / "ep2" / "out")
    assert sorted(curve) == sorted(reference)
    for it in reference:
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), it


def test_tensor_parallel_size_not_dividing_the_key_value_heads_is_refused():
    cfg = LazyConfig.load(str(ROOT / CONFIG)).model.cfg
    cfg.update(hidden_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=8192)
    with torch.device("meta"):
        model = LlamaForPreTraining(cfg)
    check_declared_splits(model, 2, cfg)
    with pytest.raises(UsageError) as e:
        check_declared_splits(model, 4, cfg)
    assert str(e.value).startswith("tensor_parallel_size=4 does not divide model.cfg.num_key_value_heads=2;")


@pytest.mark.slow
def test_tensor_parallel_4_over_2_key_value_heads_is_refused_by_the_launcher(tmp_path):
    r = train_sh(4, _args(tmp_path, "train.dist.tensor_parallel_size=4"), config=CONFIG)
    assert r.returncode != 0
    assert "tensor_parallel_size=4 does not divide model.cfg.num_key_value_heads=2" in one_error_line(r)
    assert not os.path.exists(tmp_path / "out" / "model_final")


# ----------------------------------------------------------------------------------- shapes and tokenizer

PUBLISHED = {"tinyllama_1.1B": 1_100_048_384, "llama3_8B": 8_030_261_248, "llama3_70B": 70_553_706_496,
             "mistral_7B": 7_248_023_552, "qwen2_7B": 7_615_616_512, "mixtral_8x7B": 46_702_792_704,
             "qwen3_0.6B": 596_049_920, "qwen3_8B": 8_190_735_360, "qwen3_30B_A3B": 30_532_122_624}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_real_shapes_on_meta_match_published_and_transformers(name):
    import transformers

    from projects.Llama.modeling.hf_mapping import config_to_hf

    cfg = OmegaConf.to_container(LazyConfig.load(str(ROOT / f"projects/Llama/configs/{name}.py")).model.cfg,
                                 resolve=True)
    hf_config = config_to_hf(cfg)
    hf_class = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                "qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM}.get(
        hf_config["model_type"], transformers.LlamaForCausalLM)
    with torch.device("meta"):
        ours = LlamaForPreTraining(cfg)
        theirs = hf_class(hf_class.config_class(**hf_config))
    assert ours.num_parameters() == sum(p.numel() for p in theirs.parameters()) == PUBLISHED[name]
    assert ours.llama.layers["0"].self_attention.num_key_value_heads == cfg["num_key_value_heads"]


def test_import_takes_a_tokenizer_json_beside_the_weights(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "hello", "world", "llama"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf_dir = tmp_path / "hf"
    _hf_model("llama").save_pretrained(hf_dir)
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    out = tmp_path / "imported"
    assert main(["import", "--hf-dir", str(hf_dir), "--output", str(out)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    from libai_lite.config import instantiate

    tokenizer = instantiate(LazyConfig.load(out / "config.py").tokenization.tokenizer)
    assert type(tokenizer).__name__ == "HuggingFaceTokenizer"
    assert tokenizer.encode("hello llama", add_special_tokens=True) == [0, 2, 4]


def test_evaluate_tool_on_an_imported_llama_gives_transformers_lambada_and_perplexity(tmp_path):
    """tools/evaluate.py on a Llama checkpoint (imported from transformers) equals transformers' own numbers."""
    import json

    from tests.evaluation.test_evaluation import SAMPLE, read_jsonl_texts, reference_lambada, reference_ppl
    from transformers import GPT2TokenizerFast

    hf = _hf_model("llama")
    hf_dir, out = tmp_path / "hf", tmp_path / "imported"
    hf.save_pretrained(hf_dir)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(ROOT / "data_test" / "gpt2" / name, hf_dir)
    assert main(["import", "--model", "llama", "--hf-dir", str(hf_dir), "--output", str(out)]) == 0
    vocab = json.loads((hf_dir / "vocab.json").read_text())
    merges = [tuple(line.split()) for line in (hf_dir / "merges.txt").read_text().splitlines()[1:] if line.strip()]
    hf_tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
    texts = read_jsonl_texts(SAMPLE)
    results = {}
    for task, args in {"lambada": ["--task", "lambada", "--data", str(SAMPLE)],
                       "ppl": ["--task", "ppl", "--data", str(SAMPLE), "--stride", "16", "--seq-length", "32"]}.items():
        record = tmp_path / f"{task}.json"
        r = python_tool([sys.executable, "tools/evaluate.py", "--config-file", str(out / "config.py"),
                         "--checkpoint", str(out), *args, "--output", str(record),
                         f"train.output_dir={tmp_path / 'eval'}"], timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        results[task] = json.loads(record.read_text())["results"]
    max_len = int(LazyConfig.load(out / "config.py").model.cfg.max_seq_length)
    # Our model carries the vocabulary padded to 8064 rows; probabilities are over the real ids only,
    # as in transformers' model with its VOCAB rows.
    acc, ppl = reference_lambada(hf, hf_tok, texts, max_len, real_vocab=VOCAB)
    assert results["lambada"]["lambada_examples"] == len(texts)
    assert results["lambada"]["lambada_acc"] == pytest.approx(acc)
    # fp32 logits over a 2-layer model, accumulated in float64 on both sides: 1e-5 relative.
    assert results["lambada"]["lambada_ppl"] == pytest.approx(ppl, rel=1e-5)
    # Perplexity comes from the model's own loss, whose log-softmax runs over the padded rows
    # (zeros after import) as Megatron's does: give transformers' model the same rows.
    hf.resize_token_embeddings(8064, mean_resizing=False)
    with torch.no_grad():
        hf.get_input_embeddings().weight[VOCAB:] = 0
        hf.get_output_embeddings().weight[VOCAB:] = 0
    ppl, count = reference_ppl(hf, hf_tok, texts, 33, 16)
    assert results["ppl"]["tokens"] == count
    assert results["ppl"]["PPL"] == pytest.approx(ppl, rel=1e-5)


# ----------------------------------------------------------------------------------- tokenizer.json and BOS


def _llama_with_tokenizer_json(hf_dir, style="llama3"):
    """A tiny Llama over tests/tokenizer's byte-level BPE ``tokenizer.json`` (Llama 3's BOS template, side files)."""
    import transformers

    from tests.tokenizer.test_tokenizer import write_hf_tokenizer

    hf_dir.mkdir(parents=True)
    write_hf_tokenizer(hf_dir, style)
    vocab = len(transformers.AutoTokenizer.from_pretrained(hf_dir))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    # The model's weights and config only: the tokenizer's generation_config.json stays.
    hf.save_pretrained(hf_dir / "weights")
    for name in ("config.json", "model.safetensors"):
        shutil.move(hf_dir / "weights" / name, hf_dir / name)
    shutil.rmtree(hf_dir / "weights")
    return hf


@pytest.mark.parametrize("side_files", ["tokenizer_config", "generation_config_only"])
def test_export_writes_a_tokenizer_json_that_autotokenizer_loads_with_our_ids(side_files, tmp_path):
    """import -> export of a Llama with a tokenizer.json: AutoTokenizer.from_pretrained(export) encodes as ours,
    BOS included, and names the bos/eos tokens even when only generation_config.json gave their ids."""
    import json

    from transformers import AutoTokenizer, LlamaForCausalLM

    from libai_lite.tokenizer import HuggingFaceTokenizer
    from tests.tokenizer.test_tokenizer import HF_TEXTS

    hf_dir, out, exp = tmp_path / "hf", tmp_path / "imported", tmp_path / "exported"
    _llama_with_tokenizer_json(hf_dir)
    if side_files == "generation_config_only":
        (hf_dir / "tokenizer_config.json").unlink()
    ours = HuggingFaceTokenizer(hf_dir)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (0, 1, True)
    assert main(["import", "--hf-dir", str(hf_dir), "--output", str(out)]) == 0
    assert main(["export", "--config-file", str(out / "config.py"), "--checkpoint", str(out),
                 "--output", str(exp)]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(exp))
    written = json.loads((exp / "tokenizer_config.json").read_text())
    assert (written["bos_token"], written["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    theirs = AutoTokenizer.from_pretrained(exp)
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (0, 1, ours.vocab_size)
    for text in HF_TEXTS:
        assert theirs(text).input_ids == ours.encode(text, add_special_tokens=True), text
        assert theirs.decode(theirs(text).input_ids) == ours.decode(ours.encode(text, add_special_tokens=True))
    model = LlamaForCausalLM.from_pretrained(exp)
    assert (model.config.vocab_size, model.config.bos_token_id, model.config.eos_token_id) == (ours.vocab_size, 0, 1)


BOS_PROMPTS = ["The history of the", "It's what we'll do; they're done"]


def test_generate_tool_puts_the_tokenizers_bos_first_as_transformers(tmp_path):
    """tools/generate.py --prompt on a Llama whose tokenizer.json adds BOS decodes transformers' tokens for
    tokenizer(prompt), BOS included (and these differ from those of the bare prompt)."""

    from transformers import AutoTokenizer


    hf = _llama_with_tokenizer_json(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    expected, bare = [], []
    for prompt in BOS_PROMPTS:
        for out, ids in ((expected, tok(prompt).input_ids), (bare, tok(prompt, add_special_tokens=False).input_ids)):
            assert (ids[0] == tok.bos_token_id) == (out is expected)
            new = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id,
                              eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
            out.append(new)
    assert expected != bare  # the test can tell a missing BOS
    args = [a for p in BOS_PROMPTS for a in ("--prompt", p)]
    r = python_tool([sys.executable, "tools/generate.py", "--hf-dir", str(tmp_path / "hf"), *args,
                     "--max-new-tokens", "6", "--show-ids"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [[int(t) for t in line.split(":")[1].split()] for line in r.stdout.splitlines() if line.startswith("ids ")]
    assert got == expected


def test_perplexity_and_lambada_put_the_tokenizers_bos_first_as_transformers(tmp_path):
    """JSON-lines perplexity and LAMBADA of a Llama whose tokenizer.json adds BOS equal transformers' numbers for
    tokenizer(text) (BOS first in every document and LAMBADA context); a cut LAMBADA passage keeps its BOS."""
    import json
    import math

    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from libai_lite.checkpoint.hf import load_hf_model
    from libai_lite.data.jsonl_dataset import build_ppl_eval_loader, read_jsonl_texts
    from libai_lite.evaluation import EvalContext, LambadaEvaluator, PPLEvaluator, inference_on_dataset
    from libai_lite.evaluation.lambada import load_lambada, tokenize_lambada
    from libai_lite.tokenizer import HuggingFaceTokenizer
    from tests.evaluation.test_evaluation import SAMPLE

    hf_dir = tmp_path / "hf"
    hf = _llama_with_tokenizer_json(hf_dir)
    tok, ours_tok = AutoTokenizer.from_pretrained(hf_dir), HuggingFaceTokenizer(hf_dir)
    _, _, ours = load_hf_model(str(hf_dir))  # no padded rows: the same vocabulary as transformers' model
    texts = read_jsonl_texts(SAMPLE)[:8]
    max_len = 128

    # Perplexity: consecutive windows of `seq` inputs over tokenizer(text) + [eos] per document.
    seq = 32
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    stream = torch.tensor([t for text in texts for t in tok(text).input_ids + [tok.eos_token_id]])
    nll = 0.0
    with torch.no_grad():
        for begin in range(0, len(stream) - 1, seq):
            window = stream[begin:begin + seq + 1]
            logits = hf(window[None, :-1]).logits[0].double()
            nll -= F.log_softmax(logits, -1).gather(-1, window[1:, None]).sum().item()
    loader = build_ppl_eval_loader(str(path), seq_length=seq, tokenizer=ours_tok, micro_batch_size=2)
    got = inference_on_dataset(ours, loader, PPLEvaluator())
    assert got["tokens"] == len(stream) - 1
    # fp32 logits of a 2-layer model, summed in float64 on both sides: 1e-5 relative.
    assert got["PPL"] == pytest.approx(math.exp(nll / (len(stream) - 1)), rel=1e-5)

    # LAMBADA: tokenizer(context), BOS first, then the bare " word".
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    correct, nll, count = 0, 0.0, 0
    for text in texts:
        context, word = text.rsplit(" ", 1)
        ctx, tgt = tok(context).input_ids, tok(" " + word, add_special_tokens=False).input_ids
        assert ctx[0] == tok.bos_token_id and len(ctx + tgt) <= max_len + 1
        with torch.no_grad():
            logits = hf(torch.tensor([(ctx + tgt)[:-1]])).logits[0].double()
        pos = torch.arange(len(ctx) - 1, len(ctx) + len(tgt) - 1)
        nll -= F.log_softmax(logits[pos], -1).gather(-1, torch.tensor(tgt)[:, None]).sum().item()
        correct += bool((logits[pos].argmax(-1) == torch.tensor(tgt)).all())
        count += len(tgt)
    results = LambadaEvaluator(str(lambada), max_seq_length=max_len).evaluate_model(
        ours, EvalContext(tokenizer=ours_tok, micro_batch_size=3, max_seq_length=max_len))
    assert results["lambada_target_tokens"] == count
    assert results["lambada_acc"] == pytest.approx(correct / len(texts))
    assert results["lambada_ppl"] == pytest.approx(math.exp(nll / count), rel=1e-5)

    # A passage longer than the model reads keeps BOS, then its rightmost tokens.
    pairs = load_lambada(lambada)[:1]
    (full,), _ = tokenize_lambada(pairs, ours_tok, max_len)
    (cut,), n_cut = tokenize_lambada(pairs, ours_tok, 8)
    assert n_cut == 1 and cut.ids == [tok.bos_token_id] + full.ids[-8:] and cut.num_target == full.num_target


# With -m slow: GPT's and T5's tied heads run under pp=2 by default; this is Llama's declaration of it.
@pytest.mark.slow
def test_qwen2_shape_tied_head_trains_the_one_process_curve_under_pp2(tmp_path):
    """Qwen2's small models tie the LM head to the embedding: under pp=2 the two stages hold copies whose
    gradients are summed over the tied-weight group, so the curve is one process's."""
    tied = ["model.cfg.tie_word_embeddings=True", "model.cfg.qkv_bias=True"]
    r = train_net(_args(tmp_path / "one", *tied), config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = losses(tmp_path / "one" / "out")
    r = train_ranks(2, _args(tmp_path / "pp2", *tied, "train.dist.pipeline_parallel_size=2",
                             "train.dist.pipeline_schedule=1f1b"), config=CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(tmp_path / "pp2" / "out")
    assert sorted(curve) == sorted(reference) == list(range(1, STEPS + 1))
    for it in reference:
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), it


QWEN3 = ["model.cfg.qk_norm=True", "model.cfg.head_size=32", "model.cfg.tie_word_embeddings=True"]


def test_qwen3_shape_trains_the_one_process_curve_under_tp2(tmp_path):
    """Per-head q/k norms (replicated scales over split heads), heads of 32 over hidden 64 / 4 heads and a tied
    head: tp=2 trains one process's curve."""
    r = train_net(_args(tmp_path / "one", *QWEN3), config=CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    reference = losses(tmp_path / "one" / "out")
    r = train_ranks(2, _args(tmp_path / "tp2", *QWEN3, "train.dist.tensor_parallel_size=2"), config=CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(tmp_path / "tp2" / "out")
    assert sorted(curve) == sorted(reference) == list(range(1, STEPS + 1))
    for it in reference:
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), it
    # The saved norm scales are rank 0's copy: trained on its own heads' gradients only, they would differ.
    # (Adam turns float noise in near-zero gradients into lr-sized steps, so other weights are not compared.)
    cfg = LazyConfig.load(str(ROOT / CONFIG)).model.cfg
    cfg.update(hidden_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_seq_length=32, vocab_size=8192, qk_norm=True, head_size=32, tie_word_embeddings=True)
    trained = {}
    for run in ("one", "tp2"):
        model = LlamaForPreTraining(cfg)
        Checkpointer(model).load(str(tmp_path / run / "out" / "model_final"), weights_only=True)
        trained[run] = model.state_dict()
    norms = [name for name in trained["one"] if name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4
    for name in norms:
        torch.testing.assert_close(trained["tp2"][name], trained["one"][name], atol=1e-5, rtol=0, msg=name)
