"""docs/bad_input.md's section on silent wrong training and lost runs quotes the messages its tests check."""
import re

from tests.launch import ROOT

# case -> a part of the message the row's test asserts, as the row quotes it.
DOC_CASES = {
    "nonfinite_weight_not_saved": "is NaN or inf: training diverged, so checkpoint",
    "fp16_overflow_at_the_minimum_scale": "fp16 overflow at iteration 7 with the loss scale at 1",
    "resume_with_another_model": "train.resume_model_changes=[num_attention_heads]",
    "run_already_in_the_output_dir": "already holds a run (last checkpoint",
    "virtual_stages_without_a_pipeline": "pipeline_parallel_size=1 (no pipeline)",
    "eval_metric_not_given": "is not a metric the evaluator gives (",
    "evaluate_window_of_zero": "--seq-length 0 must be at least 1",
    "compiled_numbers_differ": "differs from the eager module's",
    "override_without_a_key": "Override '=x' names no key; write KEY=VALUE",
    "blend_weight_not_finite": "a blend weight is not a finite number; give each prefix a finite weight",
    "config_path_is_a_directory": "is a directory; pass one of its .py or .yaml config files",
    "data_file_is_a_directory": "is a directory, not the corpus file; point the prefix at a .bin/.idx",
    "lock_is_a_directory": "is a directory where the run's lock file goes; no run made it: remove it",
    "save_fails_not_for_space": "make out writable (and its checkpoints movable) or point train.output_dir elsewhere",
    "metrics_json_garbage": "line 1 is not a metrics row",
}


def test_the_documented_rows_are_these_cases_with_the_messages_they_check():
    text = (ROOT / "docs" / "bad_input.md").read_text()
    section = text.split("\n## Silent wrong training and lost runs\n")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(test_[a-z0-9_]+\.py)::([a-z0-9_]+)`", cells[-1]) if len(cells) >= 4 else None
        if m:
            rows[m.group(2)] = (m.group(1), cells[-2])
    assert set(rows) == set(DOC_CASES)
    for case, needle in DOC_CASES.items():
        assert needle in rows[case][1], (case, needle)
        assert list(ROOT.glob(f"tests/**/{rows[case][0]}")), f"{case}: no test file {rows[case][0]}"
