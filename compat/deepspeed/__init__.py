"""DeepSpeed's ``ds_config.json`` read as this project's config overrides (``config.read_ds_config``)."""
from .config import DeepSpeedRun, read_ds_config, to_overrides

__all__ = ["DeepSpeedRun", "read_ds_config", "to_overrides"]
