"""tunerd: host-tuning agent for Linux GPU training nodes."""

__version__ = "0.2.0"
__all__ = ["__version__"]
