"""tunerd: host-tuning agent for Linux GPU training nodes."""

__version__ = "0.1.0"
__all__ = ["__version__"]
