"""``tools/train_net.py`` with one save held: with LIBAI_LITE_TEST_PAUSE_SAVE="NAME:STEP:FLAG_FILE", rank 0
creates FLAG_FILE and waits forever at STEP of saving checkpoint NAME (``hold_save_at``), so a test can kill
the process exactly there. The variable is read here, by the test, not by the package.

A step is a call of a function of the checkpoint modules, wrapped here (``hold_save``): "partial" (files written,
before the manifest), "background" (a background write, before its manifest), then the steps of
``protocol.publish``: "written" (before it), "aside" and "published" (after each rename), "marked" (after
``last_checkpoint``). All but "background" count only for a save that replaces an existing checkpoint.
"""
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps(name: str | None):
    """step -> (module, function, hold after the call?, whether this call is the step of a save of ``name``)."""
    from libai_lite.checkpoint import checkpointer, dcp_io, protocol
    from libai_lite.utils.distributed import get_rank

    def named(path: str) -> bool:
        return name is None or os.path.basename(path) == name

    def replaced(tmp, *a, **kw):  # the files of a save that replaces NAME are written, its manifest is not
        return named(tmp[:-len(".tmp")]) and os.path.isdir(tmp[:-len(".tmp")])

    return {
        "partial": (checkpointer, "write_manifest", False, replaced),
        "background": (dcp_io, "write_manifest", False, lambda tmp, *a, **kw: named(tmp[:-len(".tmp")])),
        "written": (protocol, "publish", False,
                    lambda save_dir, n, *a, **kw: named(n) and os.path.isdir(os.path.join(save_dir, n))),
        "aside": (protocol, "_rename", True, lambda src, dst: dst.endswith(".old") and named(src)),
        "published": (protocol, "_rename", True,
                      lambda src, dst: src.endswith(".tmp") and named(dst) and os.path.isdir(dst + ".old")),
        "marked": (protocol, "_write_text_atomic", True,
                   lambda path, text: os.path.basename(path) == protocol.LAST_CHECKPOINT and named(text) and
                   os.path.isdir(os.path.join(os.path.dirname(path), text + ".old"))),
    }, get_rank


def hold_save(step: str, hold, name: str | None = None, setattr=setattr) -> None:
    """Call ``hold()`` on rank 0 at ``step`` of each save of checkpoint ``name`` (any when None); ``setattr`` is
    how the function is replaced (pytest's ``monkeypatch.setattr`` undoes it after the test)."""
    steps, get_rank = _steps(name)
    module, attr, after, is_step = steps[step]
    original = getattr(module, attr)

    def held(*args, **kwargs):
        due = get_rank() == 0 and is_step(*args, **kwargs)
        if due and not after:
            hold()
        out = original(*args, **kwargs)
        if due and after:
            hold()
        return out

    setattr(module, attr, held)


def hold_save_at(spec: str) -> None:
    """Hold every save forever at ``spec``'s ("NAME:STEP:FLAG_FILE") step, FLAG_FILE made."""
    name, step, flag = spec.split(":", 2)

    def forever():
        open(flag, "w").close()
        while True:
            time.sleep(1)

    hold_save(step, forever, name)


if __name__ == "__main__":
    hold_save_at(os.environ["LIBAI_LITE_TEST_PAUSE_SAVE"])
    script = os.path.join(ROOT, "tools", "train_net.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
