"""Lazy configs: ``LazyCall`` to describe objects, ``LazyConfig`` to load/save/override config files,
``instantiate`` to build them, and the shared command-line parser."""
from .arguments import default_argument_parser
from .instantiate import InstantiationError, instantiate, locate
from .lazy import ConfigKeyError, ConfigLoadError, ConfigTypeError, LazyCall, LazyConfig, try_get_key

__all__ = ["LazyCall", "LazyConfig", "instantiate", "default_argument_parser", "ConfigKeyError", "ConfigTypeError",
           "ConfigLoadError", "InstantiationError", "locate", "try_get_key"]
