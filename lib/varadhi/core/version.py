"""The package's version (also `varadhi.__version__`), which the HTTP engine's User-Agent names."""

__version__ = "0.1.0"
