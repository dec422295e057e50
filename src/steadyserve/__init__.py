"""steadyserve: a PyTorch language-model server that stays correct under load."""

__version__ = "0.1.0"
