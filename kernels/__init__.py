"""Kernel families of elsa_vision (installed as ``elsa_vision.kernels``).

attention.py — Triton ELSA attention (forward scan, backward, custom ops)
reference.py — pure-torch chunked monoid scan (any device, autograd)
window.py    — windowed attention for Swin
nearest.py   — fused nearest-row search (token merging's similarity)
rope.py      — q/k LayerNorm + 2-D RoPE in one pass (VGGT)
"""
