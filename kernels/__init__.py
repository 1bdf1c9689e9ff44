"""Kernel families of elsa_vision (installed as ``elsa_vision.kernels``).

attention.py — Triton ELSA attention (forward scan, backward, custom ops)
reference.py — pure-torch chunked monoid scan (any device, autograd)
"""
