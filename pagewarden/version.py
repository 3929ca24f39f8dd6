"""The package's version, in a leaf module that any layer may read."""

__version__ = "0.1.0"
