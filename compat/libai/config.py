"""LiBai's config files, loaded unchanged: the names they import and the keys whose meaning differs here.

A LiBai config imports ``libai.config``, ``libai.scheduler``, ``libai.data...``, ``libai.models`` and
``oneflow``. While (and only while) the core's config loader runs a config file, :class:`LibaiDialect`
answers those imports from the tables below and ``compat.libai.models`` instead of ``sys.modules``: no
top-level ``libai`` or ``oneflow`` package is installed or registered, so a real LiBai install keeps
working in the same environment. A table entry also answers a ``projects.*`` module of LiBai's tree, even
where an installed project of the same name would hide LiBai's; LiBai code from its tree that no table
maps is refused, naming the module. After the load, :func:`translate_libai_config` rewrites the keys that
mean something else here (``train.amp.enabled`` is fp16 in LiBai) and names, in one warning line, every
LiBai key that has no effect here.
"""
from __future__ import annotations

import importlib
import logging
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, open_dict

from libai_lite.utils.errors import UsageError

__all__ = ["LIBAI_TOPS", "LibaiDialect", "translate_libai_config"]

logger = logging.getLogger("libai_lite")

# Top-level module names a LiBai config imports that are answered here.
LIBAI_TOPS = ("libai", "oneflow")

# LiBai's NLP loader builders (libai.data.build, re-exported by libai.data); its image loaders have no counterpart.
_LOADERS = ("build_nlp_train_val_test_loader", "build_nlp_train_loader", "build_nlp_test_loader")
# LiBai module -> {name: "module:attribute" of its counterpart here}.
_CORE_NAMES: Dict[str, Dict[str, str]] = {
    "libai.config": {n: f"libai_lite.config:{n}" for n in ("LazyCall", "LazyConfig", "instantiate",
                                                            "default_argument_parser", "try_get_key")},
    "libai.evaluation": {
        "PPLEvaluator": "libai_lite.evaluation:PPLEvaluator",
        "DatasetEvaluator": "libai_lite.evaluation:DatasetEvaluator",
        "inference_on_dataset": "libai_lite.evaluation:inference_on_dataset",
        "ClsEvaluator": "compat.libai.config:ClsEvaluator",
    },
    "libai.scheduler": {n: f"libai_lite.scheduler:{n}" for n in (
        "WarmupCosineLR", "WarmupExponentialLR", "WarmupPolynomialLR", "WarmupLinearLR", "WarmupConstantLR")},
    "libai.optim": {"get_default_optimizer_params": "libai_lite.optim:get_default_optimizer_params"},
    "libai.tokenizer": {n: f"compat.libai.data:{n}" for n in ("GPT2Tokenizer", "BertTokenizer")},
    "libai.evaluation.evaluator": {n: f"libai_lite.evaluation:{n}" for n in (
        "DatasetEvaluator", "inference_on_dataset")},
    "libai.data": {n: f"compat.libai.data:{n}" for n in _LOADERS},
    "libai.data.build": {n: f"compat.libai.data:{n}" for n in _LOADERS},
    "libai.data.datasets": {"GPT2Dataset": "compat.libai.data:GPT2Dataset"},
    "libai.data.data_utils": {"get_indexed_dataset": "compat.libai.data:get_indexed_dataset"},
    "libai.models.utils": {"GraphBase": "compat.libai.config:GraphBase"},
    "oneflow": {},
    "oneflow.optim": {n: f"compat.libai.optim:{n}" for n in ("AdamW", "Adam", "SGD")},
}

# train.* keys LiBai reads that nothing reads here, with why.
_NO_EFFECT = {
    "graph": "OneFlow's static graph mode; here torch.compile takes its place (train.compile, on by default on a GPU)",
    "train.input_placement_device": "inputs go straight to each rank's device",
    "train.rdma_enabled": "OneFlow's RDMA switch; torch.distributed picks its transport",
    "train.nccl_fusion_threshold_mb": "OneFlow's NCCL fusion; torch.distributed buckets collectives itself",
    "train.nccl_fusion_max_ops": "OneFlow's NCCL fusion; torch.distributed buckets collectives itself",
    "train.consumed_train_samples": "the data position is restored from the checkpoint with --resume",
    "train.consumed_valid_samples": "the valid position follows the iteration, as in Megatron-LM",
    "train.start_iter": "the start iteration is restored from the checkpoint with --resume",
    "train.train_samples": "set train.train_iter or train.train_epoch",
    "train.checkpointer.save_model_after_n_epoch": "checkpoints follow train.checkpointer.period",
    "train.evaluation.eval_after_n_epoch": "evaluation follows train.evaluation.eval_period",
    "tokenization.append_eod": "end-of-document tokens are added when preprocessing (tools/preprocess_data.py)",
    "tokenization.setup": "the tokenizer is always built from tokenization.tokenizer",
    "model.cfg.bias_gelu_fusion": "kernel fusion is torch.compile's here (train.compile)",
    "model.cfg.bias_dropout_fusion": "kernel fusion is torch.compile's here (train.compile)",
    "model.cfg.scale_mask_softmax_fusion": "attention is SDPA/FlexAttention, fused by PyTorch",
    "model.cfg.apply_query_key_layer_scaling": "an fp16 overflow guard of Megatron's; softmax runs in fp32 here",
    "model.cfg.amp_enabled": "mixed precision follows train.amp",
}


class GraphBase:
    """LiBai's ``nn.Graph`` wrapper: nothing here builds it (``graph`` is dropped at load, with a log line)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass


def ClsEvaluator(*args: Any, **kwargs: Any):  # noqa: N802 - LiBai's class name
    """LiBai's top-k classification evaluator: refused when built (LiBai's pretraining configs replace it)."""
    raise UsageError("LiBai's ClsEvaluator (top-k accuracy of a classifier) has no counterpart here; set "
                     "train.evaluation.evaluator=LazyCall(PPLEvaluator)() or train.evaluation.enabled=False")


def _resolve(spec: Any) -> Any:
    if not isinstance(spec, str) or ":" not in spec:
        return spec
    module, attr = spec.split(":")
    return getattr(importlib.import_module(module), attr)


class LibaiDialect:
    """LiBai's dialect of one config load (the core's ``libai_lite.config_dialects`` entry point): answers its
    ``libai``/``oneflow`` imports (and ``projects.*`` names LiBai's tree has but this project's differ in meaning,
    once a ``libai`` import marked the load as a LiBai config), then translates its keys."""

    def __init__(self):
        self.seen = False
        self._tables: Optional[Dict[str, Dict[str, Any]]] = None

    def tables(self) -> Dict[str, Dict[str, Any]]:
        if self._tables is None:
            from .models import LIBAI_NAMES  # the projects' models: imported by a LiBai config only

            tables = {k: dict(v) for k, v in _CORE_NAMES.items()}
            for module, names in LIBAI_NAMES.items():
                tables.setdefault(module, {}).update(names)
            self._tables = tables
        return self._tables

    def handles(self, name: str) -> bool:
        """Whether an absolute import of ``name`` in a config file is answered here."""
        if name.split(".")[0] in LIBAI_TOPS:
            return True
        return self.seen and name.startswith("projects.") and name in self.tables()

    def _children(self, name: str) -> Dict[str, str]:
        """``{attribute: module}`` of the answered modules right below ``name`` (``evaluation`` of ``libai``)."""
        prefix = name + "."
        tops = {m[len(prefix):].split(".")[0] for m in self.tables() if m.startswith(prefix)}
        return {top: prefix + top for top in tops}

    def _module(self, name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__doc__ = f"LiBai's {name} as libai_lite serves it to a config file"
        for attr, spec in self.tables().get(name, {}).items():
            setattr(module, attr, _resolve(spec))
        # ``from libai import evaluation``, ``flow.optim.AdamW``: submodules are attributes.
        for attr, child in self._children(name).items():
            setattr(module, attr, self._module(child))
        return module

    def load(self, name: str, fromlist) -> Any:
        """The module (or, for ``import a.b``, the top of a chain reaching it) a config's import statement gets."""
        if name.split(".")[0] == "libai":
            self.seen = True
        names = [n for n in (fromlist or ()) if n != "*"]
        table = self.tables().get(name)
        children = self._children(name)
        known = set(table or ()) | set(children)
        missing = [n for n in names if n not in known]
        if table is None and not children or missing:
            what = ", ".join(f"{name}.{n}" for n in missing) if missing else name
            raise ImportError(
                f"LiBai's {what} has no counterpart in libai_lite; replace it in the config (docs/migrating.md lists "
                f"what maps: {', '.join(sorted(known)) or 'nothing'} from {name})")
        module = self._module(name)
        if names:
            return module
        # ``import libai.models.utils`` binds ``libai`` and reaches the leaf by attribute.
        for part in reversed(name.split(".")[1:]):
            module = types.SimpleNamespace(**{part: module})
        return module

    def code_error(self, name: str, fromlist, importer: Path, missing: str) -> Optional[ImportError]:
        """The refusal of LiBai code (not a config) that a config in a LiBai tree imports and nothing here answers,
        or None when the failed import of ``missing`` is not LiBai's.

        Such code needs LiBai itself (it imports libai/oneflow), or an installed project of the same name hides it;
        what it defines has no counterpart unless ``compat.libai.models`` maps the module (docs/migrating.md lists
        those).
        """
        if not (self.seen and missing and (missing.split(".")[0] in LIBAI_TOPS or name.startswith(missing))):
            return None
        names = [n for n in (fromlist or ()) if n != "*"]
        what = ", ".join(f"{name}.{n}" for n in names) if names else name
        parts = importer.parts
        at = parts.index("projects") if "projects" in parts[:-1] else None
        project = "/".join(parts[at:at + 2]) if at is not None and at + 2 < len(parts) else importer.name
        mapped = sorted(m for m in self.tables() if m.startswith("projects."))
        return ImportError(
            f"LiBai's {project} needs {what}, which libai_lite has no counterpart for: it is LiBai's own code, not a "
            f"config (LiBai modules mapped here: {', '.join(mapped) or 'none'}; docs/migrating.md); replace the "
            f"import in the config")

    def translate(self, namespace: dict) -> List[str]:
        """:func:`translate_libai_config` of the loaded namespace."""
        return translate_libai_config(namespace)


def _select(cfg: Any, path: str) -> Any:
    """The node at dotted ``path`` of a config (or of a load's namespace dict), or None."""
    node = cfg
    for part in path.split("."):
        if not isinstance(node, (dict, DictConfig)) or part not in node:
            return None
        node = node[part]
    return node


def _target_name(node: Any) -> str:
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    return getattr(target, "__qualname__", None) or str(target or "")


def _share_tokenizer(node: Any, tokenizer: DictConfig) -> None:
    """Point every ``tokenizer`` argument under ``node`` that is a copy of ``tokenization.tokenizer`` at it.

    A LiBai config hands its tokenizer to a dataset by value (``SomeDataset(tokenizer=tokenization.tokenizer)``),
    a copy that a command-line override of ``tokenization.tokenizer.*`` would leave behind.
    """
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node)) if isinstance(node, ListConfig) \
        else ()
    for key in keys:
        child = node._get_node(key)  # unresolved: the node may hold interpolations of the whole config
        if key == "tokenizer" and isinstance(child, DictConfig) and child == tokenizer:
            with open_dict(node):
                node[key] = "${tokenization.tokenizer}"
        elif isinstance(child, (DictConfig, ListConfig)):
            _share_tokenizer(child, tokenizer)


def translate_libai_config(cfg: Any) -> List[str]:
    """Rewrite a loaded LiBai config (a ``DictConfig`` or the load's namespace dict) into this project's meaning;
    warn once about the keys with none. Returns the keys named in the warning.

    Translated: ``train.amp.enabled=True`` (fp16 in LiBai) gets ``train.amp.dtype="fp16"`` unless a dtype is
    set; ``train.dist.data_parallel_size`` becomes null (LiBai always derives it from the launch), and so does
    ``train.dist.pipeline_num_layers`` where it is the model's layer count (derived here from the model); ``train.evaluation.eval_metric`` naming a metric ``PPLEvaluator`` does not report (LiBai's default
    ``Acc@1``) becomes ``PPL``; the ``graph`` section is dropped (named in the warning); ``dataloader.train``
    gets the run's tokenizer, which LiBai's T5 dataset needs, and a dataset's copy of ``tokenization.tokenizer``
    becomes a reference to it, so an override of the tokenizer reaches the dataset.
    """
    names: List[str] = []
    if "graph" in cfg:
        names.append(f"graph ({_NO_EFFECT['graph']}; loaded as a no-op and left out of config.yaml)")
        del cfg["graph"]
    amp = _select(cfg, "train.amp")
    if isinstance(amp, DictConfig) and amp.get("enabled") and "dtype" not in amp:
        # LiBai's amp is OneFlow's fp16 autocast with a dynamic loss scale: the same here.
        with open_dict(amp):
            amp.dtype = "fp16"
        logger.warning("LiBai key translated: train.amp.enabled=True is fp16 with loss scaling in LiBai, so "
                       "train.amp.dtype=fp16 here (set train.amp.dtype=bf16 for bfloat16)")
    dist = _select(cfg, "train.dist")
    if isinstance(dist, DictConfig) and dist.get("data_parallel_size") is not None:
        # LiBai derives it from the launch whatever the file says; here a number must match the launch.
        logger.warning(f"LiBai key translated: train.dist.data_parallel_size={dist.data_parallel_size} is "
                       f"world / (tp x pp) in LiBai whatever the file says, so null here (the launch decides)")
        with open_dict(dist):
            dist.data_parallel_size = None
    layers = _select(cfg, "model.cfg.hidden_layers")
    if isinstance(dist, DictConfig) and isinstance(layers, int) and dist.get("pipeline_num_layers") in (
            layers, 2 * layers):
        # LiBai's configs compute it from hidden_layers when loaded, so a command-line hidden_layers left it stale.
        logger.warning(f"LiBai key translated: train.dist.pipeline_num_layers={dist.pipeline_num_layers} is the "
                       f"model's layer count, derived from the model here (null), so an override of "
                       f"model.cfg.hidden_layers keeps it in step")
        with open_dict(dist):
            dist.pipeline_num_layers = None
    ev = _select(cfg, "train.evaluation")
    if isinstance(ev, DictConfig) and "PPLEvaluator" in _target_name(ev.get("evaluator")) \
            and ev.get("eval_metric") not in (None, "PPL"):
        names.append(f"train.evaluation.eval_metric={ev.eval_metric} (PPLEvaluator reports PPL; "
                     f"the best checkpoint follows PPL, eval_mode min)")
        with open_dict(ev):
            ev.eval_metric, ev.eval_mode = "PPL", "min"
    loader = _select(cfg, "dataloader.train")
    tokenizer = _select(cfg, "tokenization.tokenizer")
    if isinstance(loader, DictConfig) and _target_name(loader).startswith("build_nlp_train") \
            and "tokenizer" not in loader and tokenizer is not None:
        with open_dict(loader):
            loader.tokenizer = "${tokenization.tokenizer}"
    if isinstance(tokenizer, DictConfig):
        _share_tokenizer(_select(cfg, "dataloader"), tokenizer)
    if isinstance(loader, DictConfig) and _target_name(loader) == "build_nlp_train_loader" \
            and isinstance(ev, DictConfig) and ev.get("enabled"):
        names.append("train.evaluation.enabled (dataloader.train is build_nlp_train_loader, which makes no valid "
                     "split, so nothing is evaluated while training; LiBai evaluates dataloader.test there, which "
                     "tools/train_net.py --eval-only evaluates here)")
    for key, why in _NO_EFFECT.items():
        # Only keys set to something: LiBai's defaults of 0/None/False ask for nothing.
        if key != "graph" and _select(cfg, key):
            names.append(f"{key} ({why})")
    if names:
        logger.warning("LiBai keys with no effect here: " + "; ".join(names))
    return names
