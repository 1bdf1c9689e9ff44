"""Kernel families of elsa_vision (installed as ``elsa_vision.kernels``).

Triton-free (importable without Triton):
  limits.py     what the Triton kernels accept (read by the dispatcher's capability table)
  reference.py  pure-torch chunked monoid scan (any device, autograd), window geometry
Shared machinery (Triton):
  launch.py     launch cache, planned launches, the registry of caches (clear_caches)
  common.py     @triton.jit building blocks and precision codes
  tiles.py      tile / launch-shape tables of every family
  ops.py        the op-registration path: custom ops + fakes + autograd, eager Function, chooser
  native.py     eager calls replayed from C++ (native.cpp, a PyTorch extension built on first use)
Kernel families (Triton), one file each:
  attention.py  ELSA attention (forward scan, backward)
  window.py     windowed attention for Swin (plain and shifted windows)
  nearest.py    fused nearest-row search (token merging's similarity)
  segment_mean.py  segment means of token rows (token merging's merge)
  rope.py       q/k LayerNorm + 2-D RoPE in one pass (VGGT)
  position_bias.py  Swin's position biases: v1's table gathered, v2's MLP + sigmoid + gather, in one launch each; their backwards
  residual.py   a pre-norm block's residual add (+ LayerScale) and LayerNorm in one pass, and its backward (ViT, VGGT)
"""
