"""A run's config.yaml records what the launch decided without requiring it: train.dist keeps the layout asked
for and the global batch is kept with its accumulation left to derive, so a rerun or an evaluation from it on
another process count derives its own layout (its start-up line says which); the launch is in its header."""
from tests.launch import tiny, train_ranks


def test_a_dp2_runs_config_yaml_reruns_on_one_process_with_the_same_global_batch(tmp_path):
    first = tmp_path / "dp2"
    r = train_ranks(2, tiny(first, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False",
                            "train.log_period=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    text = (first / "config.yaml").read_text()
    assert text.startswith("# Launched on 2 process(es): layout pp=1 dp=2 tp=1 cp=1, global batch "), text[:300]
    global_batch = int(text.split("global batch ")[1].split(" ")[0])
    second = tmp_path / "dp1"
    r = train_ranks(1, [f"train.output_dir={second}"], config=str(first / "config.yaml"))
    assert r.returncode == 0, r.stderr[-3000:]
    log = (second / "log.txt").read_text()
    assert "layout pp=1 dp=1 tp=1" in log, log[-3000:]
    assert f"global batch {global_batch} = micro {global_batch // 2} x dp 1 x accumulation 2" in log, log[-3000:]
