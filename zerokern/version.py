"""The package version, importable from any layer (the root package imports the engine)."""

__version__ = "0.1.0"
