"""Text generation: the decoding loop models' ``generate`` methods share, and its logits processors."""
from .generation import *  # noqa: F401,F403 - the public names are generation.__all__
from .generation import __all__  # noqa: F401
