"""Helpers for tests and benchmarks: tiny random models made on the spot, no network."""

from .tiny_model import build_tiny_model

__all__ = ["build_tiny_model"]
