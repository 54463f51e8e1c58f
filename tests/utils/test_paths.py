"""check_outputs: an output that is, lies in or holds an input, or is the wrong kind of path, is refused in one
line naming both paths and the fix; paths beside the inputs pass."""
import os

import pytest

from libai_lite.utils.errors import UsageError
from libai_lite.utils.paths import check_outputs


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "run" / "model_final").mkdir(parents=True)
    (tmp_path / "run" / "metrics.json").write_text("{}\n")
    (tmp_path / "data.jsonl").write_text("{}\n")
    return tmp_path


def refused(outputs, inputs, **kw) -> str:
    with pytest.raises(UsageError) as e:
        check_outputs(outputs, inputs, option="--output", **kw)
    msg = str(e.value)
    assert "\n" not in msg and "; give --output " in msg, msg
    return msg


def test_the_input_itself_through_any_name_is_refused(tree):
    data = tree / "data.jsonl"
    os.symlink(data, tree / "link.jsonl")
    os.link(data, tree / "hard.jsonl")
    for out in (data, tree / "link.jsonl", tree / "hard.jsonl", tree / "." / "data.jsonl"):
        msg = refused([out], [data])
        assert f"would write {out}, which is the input {data}; give --output a path other than {data}" in msg
    run = tree / "run" / "model_final"
    assert f"give --output a path outside {run}" in refused([run], [run], directory=True)


def test_inside_an_input_directory_or_holding_an_input_is_refused(tree):
    ckpt = tree / "run" / "model_final"
    msg = refused([ckpt / "hf"], [ckpt], directory=True)
    assert f"{ckpt / 'hf'}, inside the input {ckpt}; give --output a path outside {ckpt}" in msg
    msg = refused([tree / "run"], [ckpt], directory=True)
    assert f"{tree / 'run'}, which holds the input {ckpt}; give --output a path that does not hold {ckpt}" in msg


def test_a_directory_where_a_file_goes_and_a_file_where_a_directory_goes(tree):
    assert "but that is a directory; give --output the path of a file" in refused([tree / "run"], [tree / "data.jsonl"])
    assert "but that is a file; give --output a new or existing directory" in refused(
        [tree / "data.jsonl"], [], directory=True)
    msg = refused([tree / "data.jsonl" / "x.json"], [])
    assert f"but {tree / 'data.jsonl'} is a file, not a directory" in msg


def test_paths_beside_or_apart_from_the_inputs_pass(tree):
    run = tree / "run"
    check_outputs([run / "metrics.png"], [run / "metrics.json"], option="-o")
    check_outputs([run / "hf"], [run / "model_final", run / "config.yaml"], option="--output", directory=True)
    check_outputs([tree / "new" / "deeper" / "out.json"], [tree / "data.jsonl", None], option="--output")
