"""torch-tweak's version, at the bottom of the package: the modules that write it into a file or
a cache key read it here, not from the package face (which imports them)."""

__version__ = "0.1.0"
