"""A process that has imported what the project's tools import and forks one run of a tool per request.

Each run is still its own process (its pid, environment, working directory, stdout, stderr, exit code
and interpreter shutdown: non-daemon threads joined, atexit handlers run) but skips the seconds a fresh
interpreter spends importing torch and the project, which dominate a tiny test run on a CPU.

A request for ``nproc`` ranks forks that many, each with the environment torchrun gives its workers, and
ends them all once one fails, as torchrun does; the tests' own worker scripts launch this way, while
tools/train.sh runs keep the real launcher.

Protocol, one JSON line each way: a request ``{"argv", "env", "cwd", "stdout", "stderr"[, "nproc"]}`` (the
two file paths receive the output of every process) is answered by ``{"pids"}`` at the forks, then
``{"code"}`` once all have exited.
"""
import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time

# Imported here so that no run pays for them; a tool that imports more imports it itself.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "libai_lite.engine.default",
           "libai_lite.engine.launch", "libai_lite.config", "projects.GPT.modeling", "projects.Llama.modeling",
           "projects.MT5.modeling")


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # what the interpreter does with ``sys.exit("message")``
    return 1


def _run(request: dict, reply_fd: int) -> None:
    """The forked child: become the requested process, run its script as ``__main__``, exit as Python would."""
    code = 1
    try:
        os.close(reply_fd)
        os.setsid()  # a timeout kills the run's whole group, as a launcher would
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        # The interpreter's own shutdown order: wait for non-daemon threads, then the atexit handlers.
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _rank_env(env: dict, rank: int, nproc: int) -> dict:
    """What torchrun's agent sets for worker ``rank`` of a one-node job of ``nproc`` workers."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")


def _wait(pids: list) -> int:
    """The job's exit code: a single process's own; for ranks, 0 if all succeeded, else 1 after the others are ended."""
    codes, deadline = {}, None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                _signal_all([p for p in pids if p not in codes], signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and deadline is None and len(pids) > 1:
            _signal_all([p for p in pids if p not in codes], signal.SIGTERM)
            deadline = time.monotonic() + 30
    if len(pids) == 1:
        return codes[pids[0]]
    return 0 if all(code == 0 for code in codes.values()) else 1


def _signal_all(pids: list, sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def serve() -> None:
    # Replies go to our own copy of stdout; fd 1 becomes stderr so nothing a preload prints mixes with them.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    # The checkout's root, not tests/ (this script's folder), where tests/projects would stand for the real
    # projects/ package, and an editable install's finder would fill it in from another checkout.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in PRELOAD:
        __import__(name)
    for line in sys.stdin:
        request = json.loads(line)
        nproc = request.get("nproc")
        for path in (request["stdout"], request["stderr"]):
            open(path, "w").close()
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(nproc or 1):
            if nproc:
                request = dict(request, env=_rank_env(request["env"], rank, nproc))
            pid = os.fork()
            if pid == 0:
                _run(request, reply.fileno())
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.write(json.dumps({"code": _wait(pids)}) + "\n")


if __name__ == "__main__":
    serve()
