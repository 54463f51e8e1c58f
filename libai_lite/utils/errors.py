"""The error type for input a user can fix: the launcher prints it as one line and exits non-zero."""


class UsageError(ValueError):
    """Bad input (config, data, layout): the message names the problem and the fix."""
