"""Scripts the multi-process tests launch under torchrun, and how they end."""
import os
import sys


def run_and_exit(main, *args) -> None:
    """Run a torchrun worker's ``main(*args)``, then leave without the interpreter's finalization.

    gloo's C++ threads can abort a process while Python tears down after every collective finished
    and the results are written ("terminate called without an active exception", SIGABRT): a CI run
    once failed so in dp_worker.py. A worker whose work succeeded exits 0 at once; an exception
    still ends it with its traceback and a non-zero status.
    """
    main(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
