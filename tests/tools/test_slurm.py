"""tools/slurm/train.sbatch: NODE, NODE_RANK, ADDR and PORT from Slurm's variables; two "nodes" on this
machine (a stand-in srun starting the script twice, as Slurm's would) train as a single-node 2-process run."""
import os
import stat
import subprocess

import pytest

from tests.launch import CONFIG, ROOT, env, free_port, losses, one_error_line, tiny, train_sh

SCRIPT = ROOT / "tools" / "slurm" / "train.sbatch"


def path_without(*commands) -> str:
    """PATH minus the directories holding `commands` (a machine with Slurm installed tests the fallback too)."""
    dirs = os.environ["PATH"].split(os.pathsep)
    return os.pathsep.join(d for d in dirs if not any(os.path.exists(os.path.join(d, c)) for c in commands))


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def job_env(bin_dir=None, **extra):
    """Environment of a Slurm job's batch step, without scontrol/srun unless `bin_dir` provides them."""
    e = env()
    e["PATH"] = (f"{bin_dir}{os.pathsep}" if bin_dir else "") + path_without("scontrol", "srun")
    for k in [k for k in e if k.startswith("SLURM_") or k in ("NODE", "NODE_RANK", "ADDR", "PORT")]:
        del e[k]
    e.update(extra)
    return e


def dry_run(**slurm):
    r = subprocess.run(["bash", str(SCRIPT), "cfg.py", "4", "a=1"], cwd=ROOT,
                       env=job_env(DRY_RUN="1", **slurm), capture_output=True, text=True, timeout=60)
    return r


@pytest.mark.parametrize("nodelist,first", [
    ("host[1-3,5]", "host1"),
    ("node[01-04,07],gpu[1-2]", "node01"),
    ("a,b", "a"),
    ("single", "single"),
    ("gpu-a100-[3-4],cpu1", "gpu-a100-3"),
    ("rack[1-2]-n[08-09]", "rack1-n08"),
    ("n[5]", "n5"),
])
def test_node_rank_addr_and_port_come_from_slurm(nodelist, first):
    r = dry_run(SLURM_JOB_ID="1234567", SLURM_JOB_NUM_NODES="3", SLURM_NODEID="2", SLURM_PROCID="2",
                SLURM_JOB_NODELIST=nodelist)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"NODE=3 NODE_RANK=2 ADDR={first} PORT={10000 + 1234567 % 50000} bash "
                                f"{ROOT}/tools/train.sh {ROOT}/tools/train_net.py cfg.py 4 a=1")


def test_older_variable_names_and_the_users_own_values():
    r = dry_run(SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_PROCID="1", SLURM_NODELIST="x[3-4]")
    assert r.stdout.startswith("NODE=2 NODE_RANK=1 ADDR=x3 PORT=10007 "), r.stderr
    # ADDR and PORT from the user win; NODE and NODE_RANK copied from the submitting shell do not.
    r = dry_run(SLURM_JOB_ID="7", SLURM_NNODES="2", SLURM_PROCID="1", SLURM_NODELIST="x[3-4]", ADDR="10.0.0.1",
                PORT="2222", NODE="5", NODE_RANK="0")
    assert r.stdout.startswith("NODE=2 NODE_RANK=1 ADDR=10.0.0.1 PORT=2222 "), r.stderr


def test_scontrol_is_preferred_where_it_exists(tmp_path):
    executable(tmp_path / "scontrol", '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames w[1-2]" ] && printf "w1\\nw2\\n"\n')
    r = subprocess.run(["bash", str(SCRIPT), "cfg.py", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=job_env(tmp_path, DRY_RUN="1", SLURM_JOB_ID="1", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="0",
                                   SLURM_JOB_NODELIST="w[1-2]"))
    assert " ADDR=w1 " in r.stdout, r.stderr


@pytest.mark.parametrize("slurm,expected", [
    ({}, "error: SLURM_JOB_ID is not set: submit with sbatch (or run tools/train.sh directly)"),
    ({"LIBAI_LITE_ROOT": "/nonexistent_libai"}, "error: /nonexistent_libai is not a libai_lite checkout (no "
     "tools/train.sh); submit from the checkout or set LIBAI_LITE_ROOT=/path/to/libai_lite"),
    ({"LIBAI_LITE_SLURM_STEP": "1", "SLURM_JOB_ID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "a"},
     "error: SLURM_JOB_NUM_NODES is not set (is this a Slurm job step?); run it through sbatch"),
    ({"LIBAI_LITE_SLURM_STEP": "1", "SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
      "SLURM_JOB_NODELIST": "a[1-"}, "error: cannot read the Slurm node list 'a[1-'; set ADDR=first-node-hostname"),
])
def test_outside_a_job_or_an_unreadable_node_list_is_one_line(slurm, expected):
    r = subprocess.run(["bash", str(SCRIPT), "cfg.py", "1"], cwd=ROOT, env=job_env(**slurm), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert one_error_line(r) == expected


# Slurm's srun as far as this script uses it: one task per node, each with its SLURM_NODEID/SLURM_PROCID.
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >> "$SRUN_LOG"
nodes=${1#--nodes=}
shift 3  # --nodes=N --ntasks-per-node=1 --kill-on-bad-exit=1
pids=()
for ((i = 0; i < nodes; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_STEP_ID=0 "$@" > "$SRUN_LOG.$i.out" 2> "$SRUN_LOG.$i.err" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_two_processes(tmp_path):
    args_of = lambda name: tiny(tmp_path / name, tmp_path / "cache", "train.train_iter=2",  # noqa: E731
                                "train.evaluation.enabled=False")
    r = train_sh(2, args_of("single"))
    assert r.returncode == 0, r.stderr[-3000:]

    port = free_port()
    while not 10000 <= port < 60000:  # the script's port is 10000 + SLURM_JOB_ID % 50000
        port = free_port()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "srun", FAKE_SRUN)
    srun_log = tmp_path / "srun.log"
    # The batch step's environment as sbatch sets it on the first node; the script starts the steps.
    r = subprocess.run(["bash", str(SCRIPT), CONFIG, "1", *args_of("slurm")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300,
                       env=job_env(bin_dir, SLURM_JOB_ID=str(port - 10000), SLURM_JOB_NUM_NODES="2",
                                   SLURM_NNODES="2", SLURM_JOB_NODELIST="localhost,node2", SLURM_NODEID="0",
                                   SLURM_PROCID="0", SLURM_SUBMIT_DIR=str(ROOT), SRUN_LOG=str(srun_log)))
    outputs = [(srun_log.with_name(f"srun.log.{i}.out"), srun_log.with_name(f"srun.log.{i}.err")) for i in (0, 1)]
    assert r.returncode == 0, "\n".join(err.read_text()[-3000:] for _, err in outputs if err.exists())
    assert srun_log.read_text().startswith(f"srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash "
                                           f"{ROOT}/tools/slurm/train.sbatch {CONFIG} 1 ")
    log = (tmp_path / "slurm" / "log.txt").read_text()
    assert "Rank 0 of 2; layout pp=1 dp=2 tp=1" in log
    single, slurm = losses(tmp_path / "single"), losses(tmp_path / "slurm")
    assert sorted(single) == [1, 2]
    # The same two ranks on the same data in the same order: the same float32 computation, bit for bit.
    assert slurm == single
