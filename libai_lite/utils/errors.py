"""The error type for input a user can fix: the launcher prints it as one line and exits non-zero."""
import errno
import os


class UsageError(ValueError):
    """Bad input (config, data, layout): the message names the problem and the fix."""


def write_error(path, exc: OSError) -> UsageError:
    """The one-line error for a failed write of a run's output `path` (full disk, quota, read-only)."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there or choose another train.output_dir"
    else:
        fix = "make it writable or choose another train.output_dir"
    return UsageError(f"cannot write {os.fspath(path)}: {reason}; {fix}, then {_how_to_go_on(path)}")


def _how_to_go_on(path) -> str:
    """How a run whose output ``path`` failed goes on: from its last checkpoint where its folder (``path`` or up
    to two folders above) names one, else from the start."""
    folder = os.path.abspath(os.fspath(path))
    started = False
    for _ in range(3):
        if os.path.isfile(os.path.join(folder, "last_checkpoint")):
            return "continue with --resume from the last checkpoint"
        started = started or os.path.isfile(os.path.join(folder, "metrics.json"))
        folder = os.path.dirname(folder)
    if not started:  # failed before its first logged step: nothing there to continue or to refuse a new run over
        return "run it again"
    return "run it again with --resume (no checkpoint was saved yet: it starts from iteration 0)"
