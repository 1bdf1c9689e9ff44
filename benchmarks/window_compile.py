"""Compile the window kernels (or, with --attention, the attention kernels) for a GPU target on any
machine (no GPU needed) and report, per kernel, registers, spill bytes per thread, shared memory, and
warps laid out beyond the tile (replicated work).

    python benchmarks/window_compile.py                       # Swin sizes, all precisions and blocks, sm_90
    python benchmarks/window_compile.py --n 49,144 --d 32,64 --arch 90 --blocks 64,256
    python benchmarks/window_compile.py --attention --d 16,32,64,128,256   # kernels/attention.py tile table
    python benchmarks/window_compile.py --static --n 49,64 --blocks 64    # can inductor's static launcher take them?
    python benchmarks/window_compile.py --hopper --d 64,128               # the Gluon forward's SASS: P·V overlap?

Run it with the Triton version the GPU machine has (registers and spills differ between releases;
e.g. ``pip install --target /tmp/t36 triton==3.6.0`` and ``PYTHONPATH=/tmp/t36``). It runs the real launchers (kernels/window.py forward + backward on small CPU tensors) with Triton's
driver replaced by a stand-in that reports the target, and every launch replaced by a warm-up
compile, so the kernels see exactly the specialisations of a real call. ptxas (shipped with Triton)
gives the register and spill counts. This is how the tile table of kernels/window.py was chosen.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STATIC = False  # --static: report inductor's static launcher per kernel
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
COMPILED: list = []


class _TargetOnly:
    """Stands in for the CUDA driver: says which GPU to compile for, launches nothing."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _compile_only(self, grid):
    def launch(*args, **kwargs):
        kern = self.run(*args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kern))
        return kern
    return launch


def ptxas_report(kern) -> tuple[int, int]:
    """(registers, spill bytes per thread) from ptxas -v on the kernel's PTX."""
    ptx = kern.asm["ptx"]
    arch = "sm_90a" if "sm_90a" in ptx else f"sm_{kern.metadata.target.arch}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(ptx)
        r = subprocess.run([PTXAS, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    txt = r.stdout + r.stderr
    regs = int(re.search(r"Used (\d+) registers", txt).group(1))
    spill = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", txt)] or [0])
    return regs, spill


def mma_operands(kern) -> str:
    """Warpgroup MMAs by where operand A comes from: "smem" ones are re-read from shared memory by every
    MMA (a tile that comes straight from a load), "regs" ones are register operands (a computed tile)."""
    found = re.findall(r"wgmma\.mma_async\.sync\.aligned\.[\w.]+\s+\{[^}]*\},\s*(\{|%rd)", kern.asm["ptx"])
    regs = sum(a == "{" for a in found)
    return f"wgmma A: {regs} regs / {len(found) - regs} smem" if found else ""


def replication(kern) -> float:
    """How many times over the warps of the worst dot cover its tile (1 = no replicated work)."""
    ttgir = kern.asm["ttgir"]
    layouts = {m.group(1): tuple(int(x) for x in m.groups()[1:]) for m in re.finditer(
        r"^#(mma\d*) = #ttg.nvidia_mma<\{versionMajor = (\d), versionMinor = \d+, warpsPerCTA = \[(\d+), (\d+)\], "
        r"instrShape = \[(\d+), (\d+)(?:, \d+)?\]\}>", ttgir, re.M)}
    worst = 1.0
    for m in re.finditer(r"= (?:tt\.dot|ttng\.warp_group_dot) .*?-> tensor<(\d+)x(\d+)xf32, #(mma\d*)>", ttgir):
        rows, cols, lay = int(m.group(1)), int(m.group(2)), m.group(3)
        _, wm, wn, _, inst_n = layouts[lay]
        worst = max(worst, max(1.0, wm * 16 / rows) * max(1.0, wn * inst_n / cols))
    return worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="49,64,144,256", help="window tokens")
    ap.add_argument("--d", default="32", help="head dims")
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--precisions", default="fp32:tf32x3,fp32:tf32,fp32:ieee,bf16:native")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--attention", action="store_true", help="the attention kernels' tile table instead")
    ap.add_argument("--hopper", action="store_true",
                    help="the Hopper (Gluon) bf16 forward instead: per consumer warpgroup's steady-state key "
                         "tile, whether the wait for P·V_(j-1) comes before tile j's exponentials (no overlap)")
    ap.add_argument("--tokens", type=int, default=4096, help="--hopper: query and key tokens")
    ap.add_argument("--static", action="store_true",
                    help="also say per kernel whether torch.compile's static launcher (inductor's C++ launch path, "
                         "which user-defined kernels take only under static_launch_user_defined_triton_kernels) "
                         "can launch it, with the argument types it would pass")
    a = ap.parse_args(argv)
    bad = [p for p in a.precisions.split(",") if p.count(":") != 1]
    if bad:
        ap.error(f"--precisions takes dtype:precision pairs (e.g. fp32:tf32x3,bf16:native), got {bad}")
    global STATIC
    STATIC = a.static
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: this compiles for the GPU")
    print(f"triton {triton.__version__}, target sm_{a.arch}", flush=True)
    driver.set_active(_TargetOnly(a.arch))
    JITFunction.__getitem__ = _compile_only
    os.environ["ELSA_TRITON_LAUNCH"] = "triton"  # the cached fast path asks CUDA for the device
    from elsa_vision.kernels import window as W
    dts = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if a.attention:
        return attention_report(a, dts)
    if a.hopper:
        return hopper_report(a)
    for N in map(int, a.n.split(",")):
        for D in map(int, a.d.split(",")):
            for spec in a.precisions.split(","):
                dname, prec = spec.split(":")
                for block in map(int, a.blocks.split(",")):
                    H, BW, nW = 3, 8, 4
                    qkv = torch.randn(BW, N, 3, H, D, dtype=dts[dname]).permute(2, 0, 3, 1, 4)
                    q, k, v = qkv.unbind(0)
                    bias, mask = torch.randn(H, N, N), torch.zeros(nW, N, N)
                    COMPILED.clear()
                    out, stats = W.forward(q, k, v, bias, mask, D ** -0.5, prec, block)
                    W.backward(out, q, k, v, bias, mask, out, stats, D ** -0.5, prec, block, True)
                    print(f"N={N} D={D} {spec} block={block} | " + _cells(), flush=True)


def static_launch(kern) -> str:
    """Whether torch's StaticallyLaunchedCudaKernel takes the compiled kernel: its argument type codes (one
    per runtime argument: O pointer, i int32, f float32, ...) or the reason it refuses."""
    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    if not hasattr(kern, "_cubin_path"):  # inductor sets it to the cache's cubin before it builds one
        kern._cubin_path = os.path.join(tempfile.gettempdir(), f"{kern.src.fn.__name__}.cubin")
    try:
        return f"static launch: {StaticallyLaunchedCudaKernel(kern).arg_tys}"
    except (NotImplementedError, RuntimeError, KeyError) as e:
        return f"static launch: NO ({type(e).__name__}: {e})"


def _cells() -> str:
    """One report cell per kernel compiled since COMPILED was cleared."""
    cells = []
    for name, kern in COMPILED:
        regs, spill = ptxas_report(kern)
        smem, rep = kern.metadata.shared, replication(kern)
        flags = ("  SPILL" if spill else "") + ("  SMEM>227K" if smem > 232448 else "") + \
                (f"  REPLICATED×{rep:g}" if rep > 1 else "") + (f"  {static_launch(kern)}" if STATIC else "")
        ops = mma_operands(kern)
        cells.append(f"{name.replace('_win_', '').replace('_kernel', '')}: {kern.metadata.num_warps}w "
                     f"{regs}r {spill}B-spill {smem // 1024}K-smem{flags}" + (f" ({ops})" if ops else ""))
    return " | ".join(cells)


def attention_report(a, dts):
    """Forward and backward of kernels/attention.py (with and without a bias) per precision and head dim."""
    from elsa_vision.kernels import attention as K
    for spec in a.precisions.split(","):
        dname, prec = spec.split(":")
        for D in map(int, a.d.split(",")):
            for has_bias in (False, True):
                q, k, v = (torch.randn(1, 2, 40, D, dtype=dts[dname]) for _ in range(3))
                bias = torch.randn(1, 2, 40, 40) if has_bias else None
                COMPILED.clear()
                out, stats = K.forward(q, k, v, bias, D ** -0.5, False, prec)
                K.backward(out, q, k, v, bias, out, stats, D ** -0.5, False, prec, has_bias)
                print(f"D={D} {spec} bias={has_bias} | " + _cells(), flush=True)


def sass(kern) -> str:
    """The kernel's SASS, by the cuobjdump that ships with Triton."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        open(path, "wb").write(kern.asm["cubin"])
        return subprocess.run([os.path.join(os.path.dirname(PTXAS), "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout


def pv_overlap(text: str) -> list[int]:
    """Per steady-state key tile of each consumer warpgroup (a ``WARPGROUP.DEPBAR.LE gsb0, 0x1``:
    QKᵀ_j retired, P·V_(j−1) left in flight; 0x3 with fp16x3's three products each), how many
    MUFU.EX2 (tile j's exponentials) issue before the next ``DEPBAR.LE gsb0, 0x0`` (P·V_(j−1)
    retired): 0 means the softmax does not run under P·V. (Straight-line order of the listing:
    both arms of the mask branch count.)"""
    counts, open_ = [], None
    for line in text.splitlines():
        if re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[1-9]", line):
            open_ = 0
        elif open_ is not None and "MUFU.EX2" in line:
            open_ += 1
        elif open_ is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            counts.append(open_)
            open_ = None
    return counts


def key_loop_spills(text: str) -> list[int]:
    """Local loads/stores (spills) inside each consumer warpgroup's key-tile loop: the innermost
    loops (a backward branch) that hold a ``WARPGROUP.DEPBAR.LE gsb0, 0x1``-or-more wait. The
    out-of-line retries of the mbarrier waits after the last EXIT branch back into the code; they
    are not loops of their own and are left out."""
    lines = text.splitlines()
    addr = [int(m.group(1), 16) if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line)) else None for line in lines]
    last_exit = max((i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line)), default=len(lines))
    loops = []
    for i, line in enumerate(lines[:last_exit]):
        m = re.search(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)", line)
        if m and addr[i] is not None and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            start = addr.index(int(m.group(1), 16))
            if any(re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[1-9]", b) for b in lines[start:i + 1]):
                loops.append((start, i))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    return [sum(" STL" in line or " LDL" in line for line in lines[s:e + 1]) for s, e in inner]


def hopper_report(a):
    """Compile kernels/hopper.py's bf16 forward for one [1, 16, tokens, D] call per head dim at its
    tile config, with hopper.OVERLAP off and on, and report shared memory, code size, local memory
    traffic (spills: all, and inside the key-tile loops, key_loop_spills) and the P·V overlap
    (pv_overlap)."""
    from elsa_vision.kernels import hopper as Hk
    from elsa_vision.kernels.common import LOG2E
    for D in map(int, a.d.split(",")):
        B, H, N = 1, 16, a.tokens
        bm, bn, stages, regs = Hk.config(D, N, False)
        q, k, v, out = (torch.empty(B, H, N, D, dtype=torch.bfloat16) for _ in range(4))
        stats = torch.empty(B, H, 2, N)
        rows, keys = Hk._blocks(64), Hk._blocks(bn)
        n_m = -(-N // bm)
        for overlap in (False, True):
            COMPILED.clear()
            Hk._fwd_kernel[(132,)](rows(q), keys(k), keys(v), out, rows(out), stats, stats, *out.stride()[:3], H, N,
                                   N, n_m, n_m * B * H, n_m * B * H, D ** -0.5 * LOG2E, D=D, BLOCK_M=bm, BLOCK_N=bn,
                                   STAGES=stages, CAUSAL=False, CONSUMER_REGS=regs, PARTS=1, TMA_OUT=True,
                                   OVERLAP=overlap, num_warps=4)
            _, kern = COMPILED[-1]
            text = sass(kern)
            spill = sum(" STL" in line or " LDL" in line for line in text.splitlines())
            print(f"D={D} N={N} OVERLAP={overlap}: BLOCK_M={bm} BLOCK_N={bn} stages={stages} consumer registers="
                  f"{regs} {kern.metadata.shared // 1024}K-smem {len(text.splitlines()) // 2} SASS lines "
                  f"{spill} local loads/stores ({key_loop_spills(text) or 'no key loop found'} in the key loops) "
                  f"| exponentials under "
                  f"P·V per tile: {pv_overlap(text)}", flush=True)


if __name__ == "__main__":
    main()
