"""The console log follows sys.stdout: a stream replaced and closed since setup (a redirect, a capture)
must not turn every later record into a 'Logging error' traceback on stderr."""
import io
import logging
import sys
from contextlib import redirect_stderr, redirect_stdout

from libai_lite.utils.logger import setup_logger


def test_console_writes_to_the_current_stdout_not_the_one_at_setup():
    first = io.StringIO()
    with redirect_stdout(first):
        logger = setup_logger(0)
    first.close()
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            logger.info("after the stream closed")
    finally:
        setup_logger(0)
    assert "after the stream closed" in out.getvalue()
    assert "Logging error" not in err.getvalue(), err.getvalue()
    assert sys.stdout is not first


def test_a_dead_dataloader_workers_error_raised_inside_a_write_is_raised_not_printed_as_a_logging_error():
    """torch's SIGCHLD handler raised it while the console wrote a line: logging printed '--- Logging error ---'
    with a traceback on stderr, and the run went on to misreport its end."""
    class Dying(io.StringIO):
        def write(self, text):
            raise RuntimeError("DataLoader worker (pid 5624) is killed by signal: Killed. ")

    err = io.StringIO()
    try:
        with redirect_stdout(Dying()), redirect_stderr(err):
            logger = setup_logger(0)
            try:
                logger.info("Total training time: 0:00:00")
                raised = None
            except RuntimeError as e:
                raised = e
    finally:
        setup_logger(0)
    assert raised is not None and str(raised).startswith("DataLoader worker (pid 5624)")
    assert "Logging error" not in err.getvalue(), err.getvalue()
