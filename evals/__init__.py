"""Evaluations that run against a served model (outside the runtime package)."""
