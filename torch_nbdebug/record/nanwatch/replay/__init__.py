"""Replay: forward calls kept and re-run under the per-op watch when non-finite; the backward per call."""
