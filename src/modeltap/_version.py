"""The version, imported by any module that records it (never from the package facade)."""

__version__ = "0.1.0"
