"""Text generation: the decoding loop models' ``generate`` methods share, and its logits processors."""
from . import generation
from .generation import *  # noqa: F401,F403 - the public names are generation.__all__

__all__ = list(generation.__all__)
