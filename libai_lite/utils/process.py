"""The job as a set of processes: stop signals, workers that die with their launcher, one run per output directory."""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import datetime
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time

from .errors import UsageError, write_error

logger = logging.getLogger("libai_lite")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# ----------------------------------------------------------------------------------- stop signals
class _StopSignals:
    """SIGTERM/SIGINT/SIGHUP for the training process, installed once at start-up.

    Before ``defer``, a signal raises SystemExit so ``finally`` blocks run; while training, it is only
    recorded and the trainer saves and stops at the next step boundary. A forked child (a DataLoader
    worker) inherits the handler and ignores the signal, which is its trainer's to handle.
    """

    def __init__(self):
        self.owner = None
        self.deferring = False
        self.leaving = False
        self.received: int | None = None

    def install(self) -> None:
        if self.owner is None:
            # Registered after torch's own exit callbacks, so it runs before them (last in, first out).
            atexit.register(self._leave)
        self.owner = os.getpid()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)

    def _leave(self) -> None:
        if os.getpid() == self.owner:
            self.leaving = True

    def _handler(self, signum, frame):
        if os.getpid() != self.owner:
            return
        if self.leaving:
            # In interpreter teardown (the launcher stopping the other ranks of a failed job): an exception
            # here would only print a traceback from an atexit callback.
            os._exit(128 + signum)
        if not self.deferring:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.received = signum


_STOP = _StopSignals()


def install_stop_signals() -> None:
    """Route SIGTERM/SIGINT/SIGHUP of this process through one handler (once, at start-up)."""
    _STOP.install()


def defer_stop_signals(on: bool) -> None:
    """While on, a stop signal is recorded for ``stop_requested`` instead of ending the process."""
    if _STOP.owner != os.getpid():
        install_stop_signals()
    _STOP.deferring = on
    if on:
        _STOP.received = None


def stop_requested() -> int | None:
    """The stop signal received while deferred, or None."""
    return _STOP.received


def leave_job_process_group(worker_id: int | None = None) -> None:
    """DataLoader ``worker_init_fn``: move the worker out of its trainer's process group.

    A signal to the job's process group would kill the worker, and a worker dying of a SIGTERM not sent by
    its trainer crashes the trainer before it can save. Out of the group, torch still ends the worker
    its own ways. Ignoring SIGTERM instead would hang the trainer joining the worker at exit.
    """
    try:
        os.setpgid(0, 0)
    except OSError:  # not permitted (already a session leader): nothing to leave
        pass


class _LeaveJobGroupThen:
    """``worker_init_fn`` that leaves the job's process group, then runs the loader's own (picklable for spawn)."""

    def __init__(self, then):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        leave_job_process_group(worker_id)
        if self.then is not None:
            self.then(worker_id)


def shield_workers_from_stop_signals(loader) -> None:
    """Start a ``torch.utils.data.DataLoader``'s workers out of the job's process group (keeping its own init)."""
    import torch.utils.data

    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers:
        return
    if not isinstance(loader.worker_init_fn, _LeaveJobGroupThen):
        loader.worker_init_fn = _LeaveJobGroupThen(loader.worker_init_fn)


# ------------------------------------------------------------------------- rank-local failures
_FAILURE: list = []


def fail_at_step_boundary(error: Exception) -> None:
    """Record a rank-local failure (a write to a full disk) for the step-boundary check to stop on.

    Raising on the spot would stop this rank alone and leave the others waiting in the next
    collective; at the boundary every rank learns of it and stops with the same one-line error.
    """
    if not _FAILURE:
        _FAILURE.append(error)


def pending_failure() -> Exception | None:
    """The first failure recorded on this rank (also a failed log.txt write), or None."""
    from .logger import log_file_error

    return _FAILURE[0] if _FAILURE else log_file_error()


# --------------------------------------------------------------------------------- parent death
_PR_SET_PDEATHSIG = 1


LAUNCHER_PID_ENV = "LIBAI_LITE_LAUNCHER_PID"
_watching = False


def die_with_parent(poll_s: float = 1.0) -> None:
    """End this process with SIGKILL as soon as the process that started it (torchrun) is gone.

    torchrun puts each worker in its own session, so killing the launcher's group would leave workers
    training on as orphans. Linux uses PR_SET_PDEATHSIG; a watchdog thread comparing ``os.getppid()`` covers
    other systems. A parent that died before this call cannot be recognised by pid, so ``tools/train.sh``
    also exports ``LIBAI_LITE_LAUNCHER_PID``, and a worker whose launcher is gone ends too. Idempotent.
    """
    global _watching
    if _watching:
        return
    _watching = True
    parent = os.getppid()
    try:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        launcher = 0
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(os, "sched_getaffinity"):  # Linux
        try:
            ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def orphaned() -> bool:
        return os.getppid() != parent or (launcher > 0 and not _pid_alive(launcher))

    def watch():
        while not orphaned():
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    if orphaned():
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def die_with_launcher() -> None:
    """``die_with_parent`` for a worker of torchrun (a no-op otherwise); call it first thing in a tool.

    A worker killed with its job while still importing torch would otherwise be left orphaned, waiting
    forever on the dead launcher's rendezvous.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


# ----------------------------------------------------------------------------- output dir lock
LOCK_NAME = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputDirLock:
    """One run per ``train.output_dir``: ``OUTPUT_DIR/.lock`` holds the owner's host and pid under flock.

    The kernel drops the flock when its process dies, so a killed run's lock is taken over with a log line;
    a live owner gets the second run refused by name. An flock stays held while any descriptor of its file
    is open, so the descriptor is closed on exec and a forked child closes its copy at once.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._fd: int | None = None

    def _owner(self, fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def _in_use(self, owner: dict) -> UsageError:
        who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}"
        since = f", running since {owner['started']}" if owner.get("started") else ""
        return UsageError(f"train.output_dir={self.output_dir} is in use by another run ({who}{since}); "
                          f"wait for it to end or stop it, or choose another train.output_dir")

    def refuse_if_held(self) -> None:
        """Raise ``acquire``'s ``UsageError`` if a live run holds the lock; reads only (no file is created)."""
        if any(os.path.realpath(held.path) == os.path.realpath(self.path) for held in _HELD):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            # A shared lock is refused only while an owner holds its exclusive one; dropped at once.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise self._in_use(self._owner(fd)) from None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        """Take the lock or raise ``UsageError`` naming the run that holds it.

        A process that already holds the lock of this directory keeps it (a tool evaluating several
        tasks in one process builds one trainer per task over the same output directory).
        """
        if any(os.path.realpath(held.path) == os.path.realpath(self.path) for held in _HELD):
            return
        host = socket.gethostname()
        if os.path.isdir(self.path):
            # Not the folder's fault: something made a directory where the run keeps its lock file.
            raise UsageError(f"{self.path} is a directory where the run's lock file goes; no run made it: remove it "
                             f"(rmdir {self.path}) or choose another train.output_dir")
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                owner = self._owner(fd)
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise self._in_use(owner) from None
            # A run releasing the lock unlinks the file: if ours is no longer the one at the path, retry.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = self._owner(fd)
        if stale.get("pid"):
            gone = "" if stale.get("host") != host or _pid_alive(int(stale["pid"])) else ", which is gone"
            logger.info(f"Took over the lock {self.path} left by pid {stale['pid']} on host {stale.get('host', '?')}"
                        f"{gone} (that run ended without releasing it)")
        record = json.dumps({"host": host, "pid": os.getpid(),
                             "started": datetime.datetime.now().isoformat(timespec="seconds")})
        self._fd = fd
        _HELD.append(self)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
        except OSError as e:
            self.release()
            raise write_error(self.path, e) from e

    def release(self) -> None:
        """Remove the lock file and drop the flock (idempotent)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        if self in _HELD:
            _HELD.remove(self)


_HELD: list[OutputDirLock] = []


def _forget_locks_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (the flock stays the parent's) and forget them,
    so neither the child's exit nor its ``release_locks`` touches the parent's lock file."""
    for lock in _HELD:
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def release_locks() -> None:
    """Release every output-directory lock this process holds (end of a run, also after an error)."""
    for lock in list(_HELD):
        lock.release()


atexit.register(release_locks)
