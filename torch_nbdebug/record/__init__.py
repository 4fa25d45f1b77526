"""Recorders: hooks, dispatch modes and allocator history that produce plain data.

Modules here import torch (and the standard library) only: never IPython, never render/.
"""
