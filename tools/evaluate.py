#!/usr/bin/env python
"""Evaluate a checkpoint: perplexity over a JSON-lines file or a `.bin/.idx` prefix, or LAMBADA accuracy.

    python tools/evaluate.py --config-file projects/GPT/configs/gpt2_pretrain.py \\
        --checkpoint output/gpt2_pretrain/model_final --task lambada --data data_test/lambada_sample.jsonl
    python tools/evaluate.py --config-file CONFIG --checkpoint DIR --task ppl --data held_out.jsonl --stride 512
    python tools/evaluate.py --config-file CONFIG --checkpoint DIR --task ppl      # the config's test split
    torchrun --nproc_per_node 2 tools/evaluate.py ... train.dist.tensor_parallel_size=2

The config gives the model, tokenizer and parallel layout (overrides work as for train_net.py);
the checkpoint loads on any layout. Prints one result line and writes nothing else, unless
`--output FILE` is given: then the results go to FILE as JSON, and the log and config.yaml to
`<train.output_dir>/evaluate/`.
"""
import argparse
import json
import os
import sys

from libai_lite.utils.errors import UsageError
from libai_lite.utils.paths import check_outputs


def ppl_loader_fn(data, json_key, stride, split, seq_length):
    """A loader builder for `EvalOnlyTrainer`: perplexity windows over `data` (a config prefix when None)."""

    def build(trainer):
        from libai_lite.data.jsonl_dataset import build_ppl_eval_loader, is_jsonl_path

        cfg = trainer.cfg
        path, which = data, split
        if path is None:
            prefix = cfg.dataloader.train.get("data_prefix")
            if not isinstance(prefix, str):
                raise UsageError("--task ppl without --data evaluates the config's single data prefix, but "
                                 "dataloader.train.data_prefix is a blend; pass --data PREFIX or FILE.jsonl")
            path, which = prefix, split or "test"
        if not is_jsonl_path(path) and os.path.isfile(path) and not path.endswith((".bin", ".idx")):
            raise UsageError(f"{path} is neither a .jsonl file nor a .bin/.idx prefix; name JSON-lines files *.jsonl")
        seq = seq_length if seq_length is not None else cfg.model.cfg.get("max_seq_length") or cfg.dataloader.train.get("seq_length")
        if seq_length is not None:
            from libai_lite.model import max_seq_length

            # The model refused the first window in its forward, a traceback after the checkpoint had loaded.
            positions = max_seq_length(trainer.spec.meta_model or trainer.build_meta_model(cfg.model))
            if positions is not None and seq_length > positions:
                raise UsageError(f"--seq-length {seq_length} is longer than the {positions} positions the model "
                                 f"takes; give at most {positions}, or leave it out for the model's own")
        return build_ppl_eval_loader(
            path, seq_length=int(seq), json_key=json_key, stride=stride, split=which or "all",
            splits_string=cfg.dataloader.train.get("splits_string", "949,50,1"), tokenizer=trainer.tokenizer,
            micro_batch_size=trainer.spec.batch.test_micro_batch_size, data_parallel_rank=trainer.layout.dp_rank,
            data_parallel_size=trainer.layout.data_parallel_size,
            batches_multiple_of=trainer.spec.batch.num_accumulation_steps if trainer.layout.pipeline_parallel_size > 1 else 1,
            vocab_size=trainer.tokenizer.vocab_size if trainer.tokenizer is not None else None,
        )

    return build


def check_utf8(path: str) -> None:
    """Refuse, before anything is set up or written, a text file that is not UTF-8 (as preprocessing does)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"{path} line {number} is not UTF-8 text; re-encode the file as UTF-8") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", required=True, metavar="FILE", help="the config the checkpoint was trained with")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a checkpoint directory (model_XXXXXXX, model_final)")
    p.add_argument("--task", required=True, choices=("ppl", "lambada"))
    p.add_argument("--data", metavar="FILE.jsonl|PREFIX",
                   help="JSON lines (ppl, lambada) or a .bin/.idx prefix (ppl); ppl defaults to the config's data")
    p.add_argument("--json-key", default="text", help="the JSON field holding the text (default: text)")
    p.add_argument("--stride", type=int, default=None,
                   help="ppl: sliding windows that start every STRIDE tokens and score only their new tokens "
                        "(default: non-overlapping windows)")
    p.add_argument("--split", choices=("all", "train", "valid", "test"), default=None,
                   help="ppl on a prefix: the documents of one split of dataloader.train.splits_string "
                        "(default: all of --data, the test split of the config's own prefix)")
    p.add_argument("--seq-length", type=int, default=None, help="ppl window length (default: model.cfg.max_seq_length)")
    p.add_argument("--output", metavar="FILE.json", help="also write the results here as JSON")
    p.add_argument("--no-verify", action="store_true",
                   help="load --checkpoint without checking its files against the checksums in its manifest.json")
    p.add_argument("opts", nargs="*", help="config overrides, key=value (flags may come before or after them)")
    return p


def evaluate(args) -> dict:
    """Set up the run from `args`, evaluate, and return the results (identical on every rank)."""
    from libai_lite.data.jsonl_dataset import is_jsonl_path
    from libai_lite.engine.launch import build_eval_trainer
    from libai_lite.evaluation import LambadaEvaluator, PPLEvaluator

    if args.output:
        data = [args.data] + ([args.data + ".bin", args.data + ".idx"] if args.data and not os.path.isfile(args.data)
                              else [])
        check_outputs([args.output], [*data, args.checkpoint, args.config_file], option="--output")
    subdir = "evaluate" if args.output else None
    if args.seq_length is not None and args.seq_length < 1:
        raise UsageError(f"--seq-length {args.seq_length} must be at least 1 (the perplexity window, in tokens); "
                         f"leave it out for model.cfg.max_seq_length")
    if args.task == "lambada" and not args.data:
        raise UsageError("--task lambada needs --data FILE.jsonl (LAMBADA format: one {\"text\": ...} per line)")
    if args.data and args.task == "lambada" and not os.path.isfile(args.data):
        raise UsageError(f"data file {args.data} not found (relative paths start at {os.getcwd()})")
    if args.data and os.path.isfile(args.data) and (args.task == "lambada" or is_jsonl_path(args.data)):
        check_utf8(args.data)
    if args.task == "lambada":
        trainer = build_eval_trainer(args.config_file, args.checkpoint, args.opts, subdir=subdir,
                                     verify=not args.no_verify)
        return trainer._inference(None, LambadaEvaluator(args.data, json_key=args.json_key), None)
    trainer = build_eval_trainer(args.config_file, args.checkpoint, args.opts, subdir=subdir, verify=not args.no_verify,
                                 data_loader_fn=ppl_loader_fn(args.data, args.json_key, args.stride, args.split,
                                                              args.seq_length))
    return trainer._inference(trainer.test_loader, PPLEvaluator(), None)


def write_results(args, results: dict) -> None:
    """`--output`'s JSON record, whole or not at all."""
    from libai_lite.utils.files import atomic_write

    record = {"task": args.task, "data": args.data, "checkpoint": args.checkpoint, "results": results}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        atomic_write(args.output, lambda f: f.write(json.dumps(record, indent=2) + "\n"), mode="w", fsync=False)
    except OSError as e:
        raise UsageError(f"cannot write --output {args.output}: {e.strerror or e}; make its folder writable or "
                         f"give --output another path, then evaluate again") from e


def main(argv=None) -> int:
    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import destroy
    from libai_lite.utils.process import release_locks

    args = build_parser().parse_intermixed_args(argv)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        results = evaluate(args)
        if rank0:
            print(f"{args.task}: " + "  ".join(f"{k}: {v:.6g}" for k, v in results.items()), flush=True)
            if args.output:
                write_results(args, results)
    except Exception as e:  # noqa: BLE001 - user errors arrive wrapped by instantiate; find them
        return report_cli_error(e)
    finally:
        destroy()
        # The log folder's lock goes with any end, a traceback's too (a tool run in-process does not exit).
        release_locks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
