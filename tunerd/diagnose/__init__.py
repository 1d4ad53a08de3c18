"""Checks that explain a node or a job: ``tunerctl doctor``, ``advise``, training-env traps."""
