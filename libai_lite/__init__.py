"""libai_lite: a LiBai-style toolbox for pretraining language models on torch.distributed."""
import re as _re
from importlib import metadata as _metadata

# The oldest torch supported; checked here too because a checkout on PYTHONPATH bypasses pip.
MIN_TORCH = (2, 11)


def _check_torch(version: str | None = None) -> None:
    """Refuse, in one line naming both versions, a torch older than ``MIN_TORCH``. Read from the
    package's metadata, not by importing torch: tools/train_net.py loads this package first and
    must stay light until its launcher guard is in place."""
    if version is None:
        try:
            version = _metadata.version("torch")
        except _metadata.PackageNotFoundError:
            return  # a source build without metadata: nothing to compare, torch's own imports decide
    m = _re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"libai_lite needs torch {need} or newer (the oldest it is tested on) and this is torch "
                          f"{version}: pip install 'torch>={need},<=2.13.0', or keep a CUDA build of {need} or newer")


_check_torch()
