"""``tools/train_net.py`` with one save held: with LIBAI_LITE_TEST_PAUSE_SAVE="NAME:STEP:FLAG_FILE", rank 0
creates FLAG_FILE and waits forever at STEP of saving checkpoint NAME (``Checkpointer``'s ``on_save_step``),
so a test can kill the process exactly there. The variable is read here, by the test, not by the package."""
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pause_at(spec: str):
    """An ``on_save_step`` that holds the save forever at ``spec``'s ("NAME:STEP:FLAG_FILE") step, FLAG_FILE made."""
    want_name, want_step, flag = spec.split(":", 2)

    def on_save_step(name: str, step: str) -> None:
        if (want_name, want_step) == (name, step):
            open(flag, "w").close()
            while True:
                time.sleep(1)

    return on_save_step


def hold_every_checkpointer(spec: str) -> None:
    """Give every ``Checkpointer`` built from now on ``pause_at(spec)`` as its ``on_save_step``."""
    from libai_lite.checkpoint import Checkpointer

    init = Checkpointer.__init__

    def held_init(self, *args, **kwargs):
        kwargs.setdefault("on_save_step", pause_at(spec))
        init(self, *args, **kwargs)

    Checkpointer.__init__ = held_init


if __name__ == "__main__":
    hold_every_checkpointer(os.environ["LIBAI_LITE_TEST_PAUSE_SAVE"])
    script = os.path.join(ROOT, "tools", "train_net.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
