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
