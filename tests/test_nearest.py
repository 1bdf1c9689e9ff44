"""kernels/nearest.py: the fused nearest-destination kernel (token merging's similarity search)
against float64 products of the same rounded operands. CPU: Triton interpreter; GPU: real sizes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from elsa_vision.kernels import nearest as KN


def _rows(n, c, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, c, generator=g), dim=-1).to(dtype).to(DEVICE)


def _check(src, dst, val, idx):
    exact = src.double() @ dst.double().T                                  # [Ns, Nd]
    top = exact.max(dim=1).values
    chosen = exact.gather(1, idx[:, None]).squeeze(1)
    # float32 accumulation of C products of unit rows: a few ulps of 1
    tol = 1e-6 * src.shape[1] ** 0.5 + 1e-6
    assert (val.double() - chosen).abs().max() <= tol
    assert (top - chosen).max() <= 2 * tol  # the choice is a maximum up to the accumulation's rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ns,nd,c", [(37, 23, 64), (5, 50, 40), (1, 1, 16), (70, 17, 1024)])
def test_nearest_matches_float64(ns, nd, c, dtype):
    src, dst = _rows(ns, c, dtype, 0), _rows(nd, c, dtype, 1)
    val, idx = KN.nearest(src, dst)
    assert val.dtype == torch.float32 and idx.dtype == torch.int64 and val.shape == idx.shape == (ns,)
    _check(src, dst, val, idx)


def test_nearest_ties_go_to_the_first_destination_and_strides_are_read():
    dst = _rows(40, 32, torch.bfloat16, 2)
    dst[33] = dst[7]   # same row twice: index 7 must win, across tiles
    dst[8] = dst[7]    # and within a tile
    src = torch.cat([dst[7:8], _rows(9, 32, torch.bfloat16, 3)])
    wide = torch.zeros(src.shape[0], 48, dtype=src.dtype, device=DEVICE)
    wide[:, :32] = src
    val, idx = KN.nearest(wide[:, :32], dst)  # a row stride other than C
    assert int(idx[0]) == 7
    _check(src, dst, val, idx)


def test_nearest_rejects_what_it_cannot_serve():
    a = _rows(4, 16, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="bf16/fp16"):
        KN.nearest(a.float(), a.float())
    with pytest.raises(ValueError, match=r"\[Nd, C\]"):
        KN.nearest(a, a[:, :8])
    with pytest.raises(ValueError, match="no destination"):
        KN.nearest(a, a[:0])


@pytest.mark.gpu
def test_nearest_gpu_real_size():
    """One VGGT-like global block at 40 frames: 26K sources × 15K destinations × 1024."""
    src, dst = _rows(26000, 1024, torch.bfloat16, 4), _rows(15000, 1024, torch.bfloat16, 5)
    val, idx = KN.nearest(src, dst)
    sel = torch.arange(0, 26000, 97, device=DEVICE)
    _check(src[sel], dst, val[sel], idx[sel])
    again = KN.nearest(src, dst)
    assert torch.equal(again[0], val) and torch.equal(again[1], idx)


def test_nan_scores_as_torch_max():
    """A NaN score wins a row, at its first index, as in torch.max over the scores (the token
    merging's torch path): a NaN source row, and a NaN destination row every source sees."""
    g = torch.Generator().manual_seed(3)
    src, dst = torch.randn(4, 8, generator=g), torch.randn(70, 8, generator=g)
    src[0, 0] = float("nan")
    dst[66, 1] = float("nan")
    src, dst = src.to(DEVICE, torch.bfloat16), dst.to(DEVICE, torch.bfloat16)
    val, idx = KN.nearest(src, dst)
    want = (src.float() @ dst.float().T).max(1)
    assert torch.equal(val.isnan(), want.values.isnan()) and val.isnan().all()
    assert torch.equal(idx, want.indices)
