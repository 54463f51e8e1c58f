#!/usr/bin/env python
"""lm-evaluation-harness's command line with the `libai_lite` model registered.

    pip install -e '.[eval]'
    python tools/eval_harness.py --model libai_lite \\
        --model_args config=projects/GPT/configs/gpt2_pretrain.py,checkpoint=output/gpt2_pretrain/model_final \\
        --tasks lambada_openai --batch_size 8 --output_path results/
    torchrun --nproc_per_node 2 tools/eval_harness.py --model libai_lite \\
        --model_args config=CONFIG,checkpoint=DIR,train.dist.tensor_parallel_size=2 --tasks TASKS

Every option is the harness's (`lm_eval --help`); `compat.lm_eval` lists the
model_args. The harness has no plugin entry point for models, so its own `lm_eval` command cannot
see ours: this script registers the model and then hands over. Under torchrun only rank 0 prints.
The model's log and config go to `<train.output_dir>/lm_eval/`, the harness's results to `--output_path`.
"""
import os
import sys


def main(argv=None) -> int:
    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import destroy

    try:
        import compat.lm_eval  # noqa: F401 - registers the model
        from lm_eval.__main__ import cli_evaluate
    except Exception as e:  # noqa: BLE001 - a missing extra is one line
        return report_cli_error(e)
    if int(os.environ.get("RANK", "0")) != 0:
        # Every tensor-parallel rank runs the same requests; one report is enough.
        sys.stdout = open(os.devnull, "w")
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001 - our model's errors are one line, as in the other tools
        return report_cli_error(e)
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
