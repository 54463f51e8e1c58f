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
    return UsageError(f"cannot write {os.fspath(path)}: {reason}; {fix}, then continue with --resume from the last "
                      f"checkpoint")
