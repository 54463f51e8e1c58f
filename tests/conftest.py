"""Shared pytest fixtures."""
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """``../shared/fixtures`` beside the clone: files made by other tools (Megatron-LM, ...)."""
    path = REPO_ROOT.parent / "shared" / "fixtures"
    if not path.is_dir():
        pytest.skip(
            "../shared/fixtures not found: these tests compare against files made by Megatron-LM "
            "and need the shared fixtures beside the clone"
        )
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA device (the default suite on a CPU)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
