"""The one launcher of the test suite's processes: tools/train.sh the way a user runs it; tools/train_net.py,
the other tools and the tests' rank workers forked from a warm interpreter (tests/forkserver.py), each
still its own process; and in-process rank workers (spawn_ranks)."""
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "projects/GPT/configs/gpt2_pretrain.py"
DATA = "data_test/gpt2/demo_gpt2_text_document"


def tiny(out, cache, *extra):
    """Overrides that shrink the demo to a model that takes milliseconds per step."""
    return [
        f"train.output_dir={out}",
        f"dataloader.train.cache_dir={cache}",
        "dataloader.train.num_workers=0",
        "model.cfg.hidden_layers=2",
        "model.cfg.hidden_size=64",
        "model.cfg.ffn_hidden_size=128",
        "model.cfg.num_attention_heads=2",
        "model.cfg.max_seq_length=32",
        "model.cfg.attention_dropout_prob=0.1",
        "model.cfg.output_dropout_prob=0.1",
        "train.train_micro_batch_size=4",
        "train.global_batch_size=8",
        "train.test_micro_batch_size=4",
        "train.log_period=1",
        "train.evaluation.eval_iter=2",
        # Tests that want the start-up memory estimate turn it back on.
        "train.log_memory_estimate=False",
        *extra,
    ]


def env(**extra):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e.update(extra)
    return e


def train_cmd(args, config=CONFIG):
    return [sys.executable, "tools/train_net.py", "--config-file", config, *args]


class _ForkServer:
    """This test process's tests/forkserver.py: single-process tool runs forked from a warm interpreter."""

    # Variables torch or its libraries read when they load: a run that sets them otherwise needs a fresh interpreter.
    IMPORT_TIME = ("TORCH", "PYTORCH", "ATEN", "OMP_", "MKL", "CUDA", "NCCL", "TRITON", "PYTHON", "LD_")

    def __init__(self):
        self.env = env()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py")], cwd=ROOT, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.pending = b""

    def serves(self, run_env: dict) -> bool:
        keys = {k for k in {*run_env, *self.env} if k.startswith(self.IMPORT_TIME)}
        return self.proc.poll() is None and all(run_env.get(k) == self.env.get(k) for k in keys)

    def _reply(self, timeout):
        """The server's next reply line, or None after ``timeout`` seconds; read unbuffered so select sees all."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"tests/forkserver.py exited with code {self.proc.wait()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd, argv, run_env, timeout, nproc=None):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"argv": argv, "env": run_env, "cwd": str(ROOT), "stdout": out, "stderr": err, "nproc": nproc}
            self.proc.stdin.write(json.dumps(request) + "\n")
            pids = self._reply(300)["pids"]  # the first waits for the preload
            done = self._reply(timeout)
            if done is None:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                self._reply(60)
            output = [open(path, encoding="utf-8", errors="replace").read() for path in (out, err)]
        if done is None:
            raise subprocess.TimeoutExpired(cmd, timeout, *output)
        return subprocess.CompletedProcess(cmd, done["code"], *output)


_FORK_SERVER = None


def _fork_server(run_env):
    """This process's fork server if it can start ``run_env``'s run, else None (LIBAI_LITE_TEST_FORK=0: never)."""
    global _FORK_SERVER
    if os.environ.get("LIBAI_LITE_TEST_FORK", "1") == "0":
        return None
    if _FORK_SERVER is None or _FORK_SERVER.proc.poll() is not None:
        _FORK_SERVER = _ForkServer()
    return _FORK_SERVER if _FORK_SERVER.serves(run_env) else None


def python_tool(cmd, timeout=300):
    """Run ``[sys.executable, script, *args]`` from the repository root and wait for it, as subprocess.run with
    captured text output would; forked from a warm interpreter unless LIBAI_LITE_TEST_FORK=0."""
    run_env = env()
    server = _fork_server(run_env)
    if server is not None:
        return server.run(cmd, cmd[1:], run_env, timeout)
    return subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout)


def train_net(args, config=CONFIG, timeout=300):
    """Run tools/train_net.py in one process and wait for it."""
    return python_tool(train_cmd(args, config), timeout=timeout)


def train_ranks(nproc, args, config=CONFIG, timeout=300):
    """tools/train_net.py on ``nproc`` ranks, forked as torchrun's agent would start them (one process: train_net).

    For runs whose losses a test compares across layouts; tests of the launcher itself use ``train_sh``.
    """
    if nproc == 1:
        return train_net(args, config=config, timeout=timeout)
    return torchrun(nproc, "tools/train_net.py", "--config-file", config, *args, timeout=timeout, check=False)


def train_sh(nproc, args, config=CONFIG, timeout=300, **env_extra):
    """Run tools/train.sh with `nproc` processes on a free port."""
    e = env(PORT=str(free_port()), **env_extra)
    return subprocess.run(["bash", "tools/train.sh", "tools/train_net.py", config, str(nproc), *args],
                          cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def torchrun(nproc, script, *args, timeout=300, check=True):
    """Run ``script args`` (a path from the repository root) under torchrun with ``nproc`` processes
    on a free port, gloo on the CPU; with ``check``, a failure fails the test with the output's tail."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(script), *map(str, args)]
    run_env = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The ranks forked as torchrun's agent would start them: these scripts test layouts, not the launcher.
    server = _fork_server(run_env)
    if server is not None:
        r = server.run(cmd, [str(script), *map(str, args)], run_env, timeout, nproc=nproc)
    else:
        r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def losses(out, key="total_loss") -> dict:
    """iteration -> `key` (total_loss), the last row for each iteration (a resumed run appends)."""
    rows = {}
    path = Path(out) / "metrics.json"
    if not path.exists():
        return rows
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line being written while we read
                continue
            if "total_loss" in row:
                rows[row["iteration"]] = row[key]
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_error_line(r) -> str:
    """The single `error: ...` line of a refused run (and no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) >= 1, r.stderr[-3000:]
    assert len(set(errors)) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return errors[0]


def tree_snapshot(path) -> dict:
    """Relative path -> (size, mtime) of every file under `path`, to show nothing changed."""
    path = Path(path)
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


def tree_hashes(path) -> dict:
    """Relative path -> sha256 of every file under `path`, to show a command left each one byte-identical."""
    import hashlib

    path = Path(path)
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def mounted_tmpfs(path, size: str, readonly: bool = False):
    """A real small filesystem: a tmpfs of ``size`` (mount's syntax, "2m"; read-only with ``readonly``) mounted
    at ``path`` for the block and always unmounted after; the test is skipped where mounting is not permitted."""
    import pytest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if readonly else ""), "tmpfs",
                            str(path)],
                           capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command: a small real filesystem cannot be made here")
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root or CAP_SYS_ADMIN: {r.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it anyway


def _run_then_exit(rank, fn, args):
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: with gloo's worker threads still alive (a DTensor model keeps
    # its process group referenced after destroy_process_group), tearing the interpreter down can
    # abort with "terminate called without an active exception" after every check has passed
    # (pytorch/pytorch#179291, pytorch/gloo#155), failing a test that passed.
    os._exit(0)


def spawn_ranks(fn, nprocs, args=(), start_method="spawn"):
    """Run `fn(rank, *args)` in `nprocs` processes; a worker that raises fails the caller with its
    traceback, a worker that returns exits at once without interpreter teardown."""
    import torch.multiprocessing as mp

    mp.start_processes(_run_then_exit, args=(fn, tuple(args)), nprocs=nprocs, join=True, start_method=start_method)


def start_train_sh(nproc, args, config=CONFIG, port=None, **env_extra):
    """Start tools/train.sh in a session of its own (so a test can signal or kill its process group)."""
    e = env(PORT=str(port or free_port()), **env_extra)
    return subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", config, str(nproc), *args], cwd=ROOT,
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_torchrun_train(nproc, args, config=CONFIG):
    """Start tools/train_net.py under torchrun directly (no train.sh), in a session of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "tools/train_net.py", "--config-file", config, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def job_pids(out) -> list:
    """Pids of every process whose command line names train.output_dir=`out` (launcher, torchrun, workers,
    their DataLoader workers), read from /proc."""
    needle = f"train.output_dir={out}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if needle in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def kept_logger(name="libai_lite"):
    """Give the logger back as it was (handlers, propagation, level) after an in-process launch changed it."""
    import logging

    log = logging.getLogger(name)
    saved = (list(log.handlers), log.propagate, log.level)
    try:
        yield
    finally:
        for h in list(log.handlers):
            if h not in saved[0]:
                log.removeHandler(h)
                h.close()
        for h in saved[0]:
            if h not in log.handlers:
                log.addHandler(h)
        log.propagate, log.level = saved[1], saved[2]
