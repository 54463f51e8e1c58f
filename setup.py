"""Install libai_lite.

torch: every release the project is tested on, from 2.11 (the oldest run on a GPU) to 2.13.0
(what CI tests), so `pip install -e .` keeps a CUDA torch a machine already has instead of
replacing it. With no torch installed, pip takes the newest release in range, 2.13.0: where a
CPU wheel of it lies in pip's find-links (our CPU machines), `2.13.0+cpu` sorts above PyPI's
CUDA `2.13.0` and is taken; the upper bound is that exact release, so a later patch on PyPI
(a CUDA build of several GB) is never picked in its place.
"""
from setuptools import find_packages, setup

setup(
    name="libai_lite",
    version="0.1.0",
    description="LiBai-style lazy-config toolbox for GPT and T5 pretraining on torch.distributed",
    python_requires=">=3.10",
    # configs, projects and compat are installed too: configs import each other and the models as
    # `configs.*` / `projects.*`, so tools, benchmarks and user configs anywhere need no sys.path edits.
    packages=find_packages(
        include=["libai_lite", "libai_lite.*", "configs", "configs.*", "projects", "projects.*", "compat", "compat.*"]
    ),
    # Plugins the core finds without naming another framework (libai_lite/utils/plugins.py reads the groups):
    # compat's LiBai config dialect, and its recognition of Megatron-LM and LiBai checkpoints.
    entry_points={
        "libai_lite.config_dialects": ["libai = compat.libai:LibaiDialect"],
        "libai_lite.checkpoint_formats": ["foreign = compat.checkpoints:foreign_checkpoint_error"],
    },
    install_requires=[
        # 2.11.0a0 as the floor admits the pre-release builds NVIDIA's containers ship (2.11.0a0+<git>).
        "torch>=2.11.0a0,<=2.13.0",
        "numpy>=1.24",
        "omegaconf>=2.3,<2.4",
        "hydra-core>=1.3,<1.4",
        "sentencepiece>=0.2",
        "tokenizers>=0.15",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "tensorboard>=2.14",
    ],
    extras_require={
        # nltk: the --split-sentences tests run (on a punkt model they write themselves).
        # wandb, matplotlib: the W&B writer and tools/plot_metrics.py tests run (skipped without them).
        # lm-eval: the harness adapter's tests (it depends on no torch of its own).
        # pytest-xdist: the suite's two workers (pyproject.toml's addopts).
        # Upper bounds: the newest releases the suite passes on (.ci/run installs them in a new environment);
        # raise one only after the suite passed on the new release.
        "test": ["pytest>=7,<9.3", "pytest-xdist>=3.5,<3.9", "transformers>=4.40,<5.25", "nltk>=3.8,<3.11",
                 "wandb>=0.16,<0.32", "matplotlib>=3.7,<3.12", "lm-eval>=0.4.13,<0.4.14", "torchao>=0.12,<0.19"],
        # tools/preprocess_data.py --split-sentences: nltk's punkt (its model is installed apart,
        # python -m nltk.downloader punkt_tab, never fetched at run time).
        "sentences": ["nltk>=3.8"],
        # tools/preprocess_data.py parses JSON lines faster with it; the same output without.
        "preprocess": ["orjson>=3.8"],
        # tools/preprocess_data.py --input of Parquet, a Hugging Face datasets folder, .zst corpora.
        "corpora": ["pyarrow>=14", "datasets>=2.14", "zstandard>=0.22"],
        # train.wandb.enabled=True: a Weights & Biases run beside TensorBoard.
        "wandb": ["wandb>=0.16"],
        # tools/plot_metrics.py.
        "plot": ["matplotlib>=3.7"],
        # tools/eval_harness.py: lm-evaluation-harness tasks on a checkpoint.
        "eval": ["lm-eval>=0.4.13,<0.5"],
        # train.fp8: torchao's float8 linears (on GPUs of compute capability 8.9+); it depends on no torch.
        "fp8": ["torchao>=0.12"],
        # Liger-Kernel's fused LM head + cross entropy on CUDA, opt-in with LIBAI_LITE_CE_KERNEL=liger
        # (libai_lite/layers/fused_linear_ce.py; by default plain logits + cross entropy where they fit, the
        # compiled chunked kernel beyond: neither reads the host). It needs torch>=2.1.2 and triton, which
        # CUDA builds of torch bring: it pulls no other torch. 0.8.5: the release whose backward is read.
        "gpu": ["liger-kernel>=0.8.5"],
    },
)
