"""The version of eqxpar: written here only (pyproject.toml reads it from this file)."""

__version__ = "0.1.0"
