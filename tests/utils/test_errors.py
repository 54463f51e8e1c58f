"""The one-line errors every command shares (libai_lite/utils/errors.py)."""


def test_a_failed_write_says_resume_from_a_checkpoint_only_where_one_was_saved(tmp_path):
    """The write-failure line once told every run to continue from the last checkpoint, runs with none too."""
    import errno

    from libai_lite.utils.errors import write_error

    full = OSError(errno.ENOSPC, "No space left on device")
    assert str(write_error(tmp_path / "log.txt", full)).endswith("; free space there or choose another "
                                                                 "train.output_dir, then run it again")
    (tmp_path / "metrics.json").write_text('{"iteration": 0}\n')
    fresh = str(write_error(tmp_path / "metrics.json", full))
    assert fresh.endswith("run it again with --resume (no checkpoint was saved yet: it starts from iteration 0)")
    (tmp_path / "last_checkpoint").write_text("model_0000009\n")
    for path in (tmp_path / "metrics.json", tmp_path / "tb" / "events.out", tmp_path):
        assert str(write_error(path, full)).endswith("then continue with --resume from the last checkpoint"), path
