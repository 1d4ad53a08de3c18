"""The bottom layer: errors, CPU lists, text, safe file reads, logging, small locks.

Nothing here imports any other part of tunerd (docs/layers.md)."""
