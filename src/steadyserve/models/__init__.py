"""Model definitions (our own forward pass) and loading."""

from .args import ModelArgs
from .loader import Fingerprint, LoadedModel, LoadError, load_model
from .transformer import ForwardBatch, Transformer

__all__ = ["ModelArgs", "Fingerprint", "LoadedModel", "LoadError", "load_model", "ForwardBatch", "Transformer"]
