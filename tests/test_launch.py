"""The suite's launcher (tests/launch.py) forks tool runs and ranks from a warm interpreter: each run
must end as a fresh interpreter would, or tests that check exit codes and error lines would pass wrongly."""
import sys
import textwrap

import pytest

from tests import launch
from tests.launch import python_tool, torchrun

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading, time
    out = sys.argv[1]
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    def late():
        time.sleep(0.3)
        open(out + ".thread", "w").write("joined")
    threading.Thread(target=late).start()
    print("stdout line")
    print("LIBAI_LITE_PROBE=" + os.environ.get("LIBAI_LITE_PROBE", "unset"), file=sys.stderr)
    kind = sys.argv[2]
    if kind == "message":
        sys.exit("error: the message")
    if kind == "raise":
        raise ValueError("the value")
    sys.exit(int(kind))
""")


@pytest.fixture(params=["forked", "fresh"])
def mode(request, monkeypatch):
    monkeypatch.setenv("LIBAI_LITE_TEST_FORK", "1" if request.param == "forked" else "0")
    return request.param


@pytest.mark.parametrize("kind,code,err", [("0", 0, None), ("3", 3, None), ("message", 1, "error: the message"),
                                           ("raise", 1, "ValueError: the value")])
def test_a_forked_run_ends_as_a_fresh_interpreter_would(tmp_path, monkeypatch, mode, kind, code, err):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = str(tmp_path / "out")
    monkeypatch.setenv("LIBAI_LITE_PROBE", f"{kind} in {tmp_path.name}")
    r = python_tool([sys.executable, str(script), out, kind], timeout=120)
    assert r.returncode == code, r.stderr
    assert r.stdout == "stdout line\n"
    # The caller's environment at the call, whatever the server started with.
    assert f"LIBAI_LITE_PROBE={kind} in {tmp_path.name}" in r.stderr
    if err is not None:
        assert err in r.stderr
    assert ("Traceback" in r.stderr) == (kind == "raise")
    # Interpreter shutdown: the non-daemon thread finished, then the atexit handlers ran.
    assert open(out + ".thread").read() == "joined" and open(out + ".atexit").read() == "ran"
    if mode == "forked":
        assert launch._FORK_SERVER is not None and launch._FORK_SERVER.proc.poll() is None


RANKS = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    dist.init_process_group("gloo")
    line = f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']}"
    os.write(1, (line + chr(10)).encode())  # one write, so the ranks' lines cannot interleave
    if dist.get_rank() == 1 and sys.argv[1] == "fail":
        sys.exit("error: rank 1 gives up")
    dist.barrier()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("what", ["pass", "fail"])
def test_forked_ranks_meet_and_one_failing_rank_ends_the_job(tmp_path, what):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    # Rank 0 waits in a barrier rank 1 never reaches: ended by the launcher, not by the timeout.
    r = torchrun(2, script, what, timeout=120, check=False)
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank"))
    if what == "pass":
        assert r.returncode == 0, r.stderr
        assert lines == ["rank 0 of 2 local 0", "rank 1 of 2 local 1"]
    else:
        assert r.returncode == 1
        assert "error: rank 1 gives up" in r.stderr
