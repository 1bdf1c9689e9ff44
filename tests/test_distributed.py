"""elsa_vision.distributed on CPU processes (gloo): sharded attention, forward and gradients, equal to
one process's attention over the whole sequence."""
import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import elsa_vision
from elsa_vision import distributed
from oracle_check import torch_same_dtype

B, H, D = 2, 3, 16


@contextlib.contextmanager
def _group(kind: str, init_file: str, rank: int, world: int):
    """The process group of one rank's test body. On a normal exit every rank passes a barrier
    before any tears the group down: gloo aborts a rank whose peer closes the connection while it
    is still finishing (seen on a loaded 2-core machine: SIGABRT, "terminate called without an
    active exception"). A body that raises skips the barrier (its peers may never reach it)."""
    dist.init_process_group(kind, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _full(n: int, dtype, d: int = D, heads: int = H):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, heads, n, d, generator=g).to(dtype) for _ in range(4)]  # q, k, v, dO


def _worker(rank, world, init_file, lengths, cases, out_dir, gpu=False):
    """One rank: gloo on CPU tensors, or (gpu) NCCL with rank r on cuda:r, the head size of a real
    model. Runs every case (causal, backend, dtype, grad) in one process group, so that a test
    pays the ranks' start-up once: case i's results go to <rank>-<i>.pt."""
    if gpu:
        torch.cuda.set_device(rank)
    with _group("nccl" if gpu else "gloo", init_file, rank, world):
        for i, (causal, backend, dtype, grad) in enumerate(cases):
            torch.save(_case(rank, lengths, causal, backend, dtype, grad, gpu), os.path.join(out_dir, f"{rank}-{i}.pt"))


def _case(rank, lengths, causal, backend, dtype, grad, gpu):
    """One rank's results of one case: its rows of the output (and of the q/k/v gradients), or
    without gradients the ring schedule's variants: the shards' lengths gathered, or given with the
    transfers overlapped, a pass of the ring per head, and whether wrong lengths are refused."""
    q, k, v, do = (t.to(f"cuda:{rank}" if gpu else "cpu") for t in _full(sum(lengths), dtype, *GPU_SHAPE[gpu]))
    start = sum(lengths[:rank])
    rows = slice(start, start + lengths[rank])
    if not grad:
        shard = (q[:, :, rows], k[:, :, rows], v[:, :, rows])
        with torch.no_grad():
            out = distributed.attention(*shard, causal=causal, backend=backend)
            given = distributed.attention(*shard, causal=causal, backend=backend, lengths=lengths, overlap=True)
            heads, distributed.RING_HEADS = distributed.RING_HEADS, 1  # a pass of the ring per head
            try:
                by_head = distributed.attention(*shard, causal=causal, backend=backend)
            finally:
                distributed.RING_HEADS = heads
            try:  # (refused before any collective: every rank raises)
                distributed.attention(*shard, backend=backend, lengths=[n + 1 for n in lengths])
                refused = False
            except ValueError as e:
                refused = "lengths must give every rank's key count" in str(e)
        return {"out": out, "given": given, "by_head": by_head, "refused": refused}
    ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
    out = distributed.attention(ql, kl, vl, causal=causal, backend=backend)
    out.backward(do[:, :, rows])
    return {"out": out.detach().cpu(), "dq": ql.grad.cpu(), "dk": kl.grad.cpu(), "dv": vl.grad.cpu()}


GPU_SHAPE = {False: (D, H), True: (64, 16)}  # (head size, heads): the CPU tests' small heads; VGGT's on GPUs


def _run_cases(lengths, cases, gpu=False):
    """Every case (causal, backend, dtype, grad) over shards of these lengths, one rank per shard,
    all in one spawned group: per case, the ranks' results joined along the sequence."""
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(len(lengths), init, lengths, cases, tmp, gpu), nprocs=len(lengths))
        results = []
        for i in range(len(cases)):
            parts = [torch.load(os.path.join(tmp, f"{r}-{i}.pt")) for r in range(len(lengths))]
            results.append({key: torch.cat([p[key] for p in parts], dim=2) if isinstance(parts[0][key], torch.Tensor)
                            else [p[key] for p in parts] for key in parts[0]})
    return results


def _run(lengths, causal, backend, dtype, grad=True, gpu=False):
    return _run_cases(lengths, [(causal, backend, dtype, grad)], gpu)[0]


def _backends(combos):
    """combos without the Triton backend's where it does not serve CPU tensors (without
    TRITON_INTERPRET=1); a test with none left skips."""
    served = [c for c in combos if c[0] != "triton" or elsa_vision.dispatch.triton_serves("cpu")]
    if not served:
        pytest.skip("the Triton kernels serve CPU tensors only under TRITON_INTERPRET=1")
    return served


LENGTHS = [[5, 9], [4, 7, 6], [1, 12, 3], [6, 0, 5], [0, 7, 4]]


@pytest.mark.parametrize("lengths", LENGTHS)
def test_sharded_equals_one_process(lengths):
    """Uneven shards over 2 and 3 ranks: every rank's output rows and its q/k/v gradients equal one
    process's attention over the whole sequence (float32: the ring forward and backward, reference
    backend and the Triton kernels under the interpreter; float64: the all-gather), causal or not."""
    combos = _backends([("reference", torch.float64, 1e-12), ("reference", torch.float32, 2e-6),
                        ("triton", torch.float32, 2e-6)])
    cases = [(causal, backend, dtype, True) for causal in (False, True) for backend, dtype, _ in combos]
    for (causal, backend, dtype, _), got, tol in zip(cases, _run_cases(lengths, cases), [c[2] for c in combos] * 2):
        q, k, v, do = _full(sum(lengths), dtype)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = elsa_vision.attention(q, k, v, causal=causal, backend=backend)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        for name, want in (("out", out.detach()), ("dq", dq), ("dk", dk), ("dv", dv)):
            torch.testing.assert_close(got[name], want, rtol=0, atol=tol, msg=f"{name} ({backend}, {dtype}, "
                                                                              f"causal={causal})")


@pytest.mark.parametrize("lengths", LENGTHS)
def test_ring_equals_one_process(lengths):
    """Without gradients the shards travel around the ring and the steps merge by the monoid: the
    same rows as one process's attention (an empty shard included), causal or not."""
    combos = _backends([("reference", torch.float32, 2e-6), ("triton", torch.float32, 2e-6)])
    cases = [(causal, backend, dtype, False) for causal in (False, True) for backend, dtype, _ in combos]
    for (causal, backend, dtype, _), got, tol in zip(cases, _run_cases(lengths, cases), [c[2] for c in combos] * 2):
        what = f"({backend}, causal={causal})"
        q, k, v, _ = _full(sum(lengths), dtype)
        want = elsa_vision.attention(q, k, v, causal=causal, backend=backend)
        torch.testing.assert_close(got["out"], want, rtol=0, atol=tol, msg=what)
        assert torch.equal(got["given"], got["out"]), what  # the same steps: given lengths and the transfers'
        # order change no bit
        torch.testing.assert_close(got["by_head"], want, rtol=0, atol=tol, msg=what)
        assert all(got["refused"]), what


def test_ring_bfloat16_follows_the_rule():
    """bf16: each step's output is rounded once before the float32 merge; the result stays within
    the oracle rule (2× plain bf16 attention's error against float64, + 1e-6)."""
    from elsa_vision.verify import max_err, tolerance
    lengths = [40, 30, 50]
    got = _run(lengths, False, "reference", torch.bfloat16, grad=False)["out"]
    q, k, v, _ = _full(sum(lengths), torch.bfloat16)
    oracle = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    same = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    e, r = max_err(got, oracle), max_err(same, oracle)
    assert e <= tolerance(r, torch.bfloat16), f"{e:.3g} vs {r:.3g}"


def test_ring_backward_bfloat16_follows_the_rule():
    """bf16 gradients through the ring (each step's terms rounded once before the float32 sums):
    within the oracle rule for gradients, against plain bf16 autograd's error."""
    from elsa_vision.verify import max_err, tolerance
    lengths = [40, 30, 50]
    got = _run(lengths, True, "reference", torch.bfloat16)
    q, k, v, do = _full(sum(lengths), torch.bfloat16)
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*ins64, is_causal=True), ins64, do.double())
    insb = [t.clone().requires_grad_() for t in (q, k, v)]
    same = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(*insb, is_causal=True), insb, do)
    for name, g, r, s_ in zip(("dq", "dk", "dv"), (got["dq"], got["dk"], got["dv"]), ref, same):
        e, ref_e = max_err(g, r), max_err(s_, r)
        assert e <= tolerance(ref_e, torch.bfloat16, grad=True), f"{name}: {e:.3g} vs {ref_e:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_on_gpus_follows_the_rule(dtype, causal):
    """Two GPUs over NCCL, uneven shards of 1041-token frames (3 and 2 frames): the ring forward and
    its backward (dK/dV sums travelling back to their owners) within the oracle rule against
    float64 (the Triton kernels; Gluon's forward where it serves)."""
    from elsa_vision.verify import max_err, tolerance
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    lengths = [3 * 1041, 2 * 1041]
    got = _run(lengths, causal, "triton", dtype, gpu=True)
    q, k, v, do = (t.cuda() for t in _full(sum(lengths), dtype, *GPU_SHAPE[True]))
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = torch.nn.functional.scaled_dot_product_attention(*ins64, is_causal=causal)
    ref = [out64.detach(), *torch.autograd.grad(out64, ins64, do.double())]
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    plain = torch_same_dtype(*ins, causal=causal)
    same = [plain.detach(), *torch.autograd.grad(plain, ins, do)]
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        e, same_e = max_err(got[name].cuda(), ref[i]), max_err(same[i], ref[i])
        assert e <= tolerance(same_e, dtype, grad=i > 0), f"{name}: {e:.3g} against plain torch's {same_e:.3g}"


def _ring_refusal_worker(rank, world, init_file, out_dir):
    """One rank of test_refused_alike_on_every_rank: what each call raised (or "returned")."""
    results = {}
    with _group("gloo", init_file, rank, world):
        q, k, v, _ = (t[:, :, :4] for t in _full(4, torch.float32))
        for name, call in (
                ("dtypes", lambda: distributed.attention(*(t.to(torch.float64 if rank else torch.float32)
                                                          for t in (q, k, v)))),
                ("eca", lambda: distributed.attention(q, k, v, causal=True, backend="eca")),
                # rank 1's own shards do not fit together: it says why, its peers stop with it
                ("shapes", lambda: distributed.attention(q, k, v[..., :2] if rank == 1 else v)),
                # a named backend that refuses rank 1's dtype only: rank 0 must not wait for it
                ("dtype_backend", lambda: distributed.attention(*(t.to(torch.float64 if rank == 1 else torch.float32)
                                                                 for t in (q, k, v)), backend="triton")),
                # gradients on rank 0 only: its backward would wait for the others' exchanges
                ("grads", lambda: distributed.attention(q.clone().requires_grad_(rank == 0), k, v))):
            try:
                call()
                results[name] = "returned"
            except (ValueError, RuntimeError) as e:
                results[name] = f"{type(e).__name__}: {e}"
    torch.save(results, os.path.join(out_dir, f"{rank}.pt"))


def test_refused_alike_on_every_rank():
    """Ranks whose shards differ in dtype (they would take different paths: a crash or a hang), a
    named backend that cannot run a rank's queries against another rank's keys (ECA: causal,
    n_q = n_k only; rank 0 once returned while the others raised), a rank whose own shards do not
    fit together, and gradients wanted on some ranks only raise on every rank before the ring's
    exchanges, saying what is wrong."""
    world = 3
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ring_refusal_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]
    for r in results:
        assert r["dtypes"].startswith("ValueError") and "or dtype" in r["dtypes"] and "float64" in r["dtypes"]
        assert r["eca"].startswith("NotSupportedError") and "backend='eca' cannot run" in r["eca"]
        assert r["grads"].startswith("ValueError") and "gradients are wanted on ranks [0] only" in r["grads"]
    assert results[1]["dtype_backend"].startswith("NotSupportedError")
    assert all("rank(s) [1] of the group refused" in results[r]["dtype_backend"] for r in (0, 2))
    assert "must agree" in results[1]["shapes"]
    assert all("rank(s) [1] of the group refused" in results[r]["shapes"] for r in (0, 2))


def test_needs_a_process_group():
    q = torch.randn(1, 1, 4, 8)
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.attention(q, q, q)


# --- VGGT with its frames sharded across ranks: patch(model, process_group=group) ---

OUTPUTS = ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf")


def _standin_vggt(dtype):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vggt_standin as V
    from elsa_vision.adapters import vggt as A
    remove = A.register_classes(**V.CLASSES)
    torch.manual_seed(0)
    model = V.VGGT().to(dtype)
    images = torch.rand(1, 5, 3, 28, 42, generator=torch.Generator().manual_seed(1)).to(dtype)
    weights = {k: torch.randn(256, generator=torch.Generator().manual_seed(i)).to(dtype)
               for i, k in enumerate(OUTPUTS)}
    return model, images, weights, remove


def _loss(out, weights):
    """A loss that reads every output of every frame (sums of frame-local terms)."""
    return sum((out[k] * weights[k][:out[k].shape[-1]]).sum() for k in OUTPUTS)


def _vggt_worker(rank, world, init_file, lengths, train, options, dtype, out_dir):
    with _group("gloo", init_file, rank, world):
        model, images, weights, _ = _standin_vggt(dtype)
        start = sum(lengths[:rank])
        local = images[:, start:start + lengths[rank]]
        report = elsa_vision.patch(model, process_group=dist.group.WORLD, **options)
        assert report.patched.get("vggt-camera-head") and report.patched.get("vggt-aggregator"), str(report)
        if train:  # True: training mode; "eval": eval mode (token merging on) with gradients
            model.train(train is True)
            out = model(local)
            _loss(out, weights).backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            for g in grads.values():
                dist.all_reduce(g)
            torch.save({"grads": grads}, os.path.join(out_dir, f"{rank}.pt"))
        else:
            with torch.no_grad():
                out = model.eval()(local)
            torch.save({k: out[k] for k in OUTPUTS}, os.path.join(out_dir, f"{rank}.pt"))


def _vggt_run(lengths, train, options, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_vggt_worker, args=(len(lengths), init, lengths, train, options, dtype, tmp), nprocs=len(lengths))
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(len(lengths))]


@pytest.mark.parametrize("lengths,options,dtype,tol", [
    ([2, 3], {"backend": "reference"}, torch.float64, 1e-10),
    ([1, 3, 1], {"backend": "reference", "lean_memory": [1, 3]}, torch.float64, 1e-10),
    ([3, 2], {"backend": "triton"}, torch.float32, 2e-5),
    # token merging: the whole sequence's merged set (every source merges / the top-ratio choice /
    # projected similarities with plans reused across blocks)
    ([2, 3], {"backend": "reference", "token_merging": elsa_vision.TokenMerging(ratio=0.9)}, torch.float64, 1e-10),
    ([1, 3, 1], {"backend": "reference", "lean_memory": [1, 3],
                 "token_merging": elsa_vision.TokenMerging(ratio=0.3, protect=0.0, seed=3)}, torch.float64, 1e-10),
    ([3, 2], {"backend": "reference", "token_merging": elsa_vision.TokenMerging(ratio=0.5, similarity_dim=4, reuse=2)},
     torch.float64, 1e-10),
    ([2, 3], {"backend": "triton", "token_merging": elsa_vision.TokenMerging(ratio=0.6)}, torch.float32, 2e-5),
])
def test_vggt_sharded_equals_one_process(lengths, options, dtype, tol):
    """The VGGT stand-in with its 5 frames split over 2 or 3 ranks (uneven): every rank's predictions
    of its frames equal one process's predictions of all frames (the same patched model without a
    group; the special tokens of frame 0 only on rank 0, global attention and the camera trunk
    over every rank's frames)."""
    if options["backend"] == "triton" and not elsa_vision.dispatch.triton_serves("cpu"):
        pytest.skip("the Triton kernels serve CPU tensors only under TRITON_INTERPRET=1")
    parts = _vggt_run(lengths, False, options, dtype)
    model, images, _, remove = _standin_vggt(dtype)
    try:
        elsa_vision.patch(model, **options)
        with torch.no_grad():
            want = model.eval()(images)
        if "token_merging" in options:  # (merging is on: the merged predictions differ from exact ones)
            elsa_vision.unpatch(model)
            elsa_vision.patch(model, backend=options["backend"])
            with torch.no_grad():
                exact = model.eval()(images)
            diff = (exact["depth"] - want["depth"]).abs().max().item()
            assert diff > 10 * tol, diff
    finally:
        remove()
    for k in OUTPUTS:
        torch.testing.assert_close(torch.cat([p[k] for p in parts], dim=1), want[k], rtol=0, atol=tol, msg=k)


@pytest.mark.parametrize("train", [True, "eval"], ids=["train", "eval-merging"])
def test_vggt_sharded_training_gradients(train):
    """Training mode over 2 ranks, or eval mode with gradients and token merging (its merged set
    summed across the ranks): the parameter gradients summed over the ranks (what DDP's all-reduce
    forms) equal one process's gradients of the same loss over all frames."""
    options = {"backend": "reference"}
    if train == "eval":
        options["token_merging"] = elsa_vision.TokenMerging(ratio=0.9)
    parts = _vggt_run([3, 2], train, options, torch.float64)
    model, images, weights, remove = _standin_vggt(torch.float64)
    try:
        elsa_vision.patch(model, **options)
        model.train(train is True)
        _loss(model(images), weights).backward()
    finally:
        remove()
    grads = parts[0]["grads"]
    assert len(grads) > 20
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-9, msg=n)


def test_key_lengths_of_a_sharded_aggregator_call(monkeypatch):
    """Inside a sharded aggregator call its global blocks know every rank's key count from the frame
    counts (no all-gather per block); elsewhere, or with a rank holding no frame, None on every rank."""
    from elsa_vision.adapters.vggt import sharded
    monkeypatch.setattr(sharded, "rank_of", lambda group: 1)
    assert sharded.key_lengths(None, 3 * 7) is None
    with sharded.spanning_call([2, 3, 1]):
        assert sharded.key_lengths(None, 3 * 7) == [14, 21, 7]
        with pytest.raises(RuntimeError, match="not a whole number per frame"):
            sharded.key_lengths(None, 3 * 7 + 1)
    with sharded.spanning_call([2, 3, 0]):  # a rank without frames: every rank gathers
        assert sharded.key_lengths(None, 3 * 7) is None
    assert sharded.key_lengths(None, 3 * 7) is None


def test_vggt_process_group_refusals():
    model, _, _, remove = _standin_vggt(torch.float32)
    try:
        if not (dist.is_available() and dist.is_initialized()):
            with pytest.raises(RuntimeError, match="init_process_group"):
                elsa_vision.patch(model, process_group=object())
        assert not elsa_vision.adapters.registry.patched_modules(model)
    finally:
        remove()


def _refusal_worker(rank, world, init_file, out_dir):
    """What a sharded model refuses rather than attending to this rank's frames alone."""
    found = {}
    with _group("gloo", init_file, rank, world):
        group = dist.group.WORLD
        model, images, _, _ = _standin_vggt(torch.float32)
        local = images[:, rank * 2:rank * 2 + 2]
        elsa_vision.patch(model, process_group=group, backend="reference", exclude=["aggregator.global_blocks.1.*"])
        try:
            with torch.no_grad():
                model.eval()(local)
        except RuntimeError as e:
            found["excluded"] = str(e)
        elsa_vision.unpatch(model)
        elsa_vision.patch(model, process_group=group, backend="reference")
        hook = model.aggregator.global_blocks[0].attn.attn_drop.register_forward_hook(lambda *a: None)
        try:
            with torch.no_grad():
                model.eval()(local)
        except RuntimeError as e:
            found["fallback"] = str(e)
        hook.remove()
        # a hook on rank 0 only (attention maps captured on the logging rank): every rank raises
        hook = model.aggregator.global_blocks[0].attn.attn_drop.register_forward_hook(lambda *a: None) \
            if rank == 0 else None
        try:
            with torch.no_grad():
                model.eval()(local)
        except RuntimeError as e:
            found["one_rank"] = str(e)
        if hook is not None:
            hook.remove()
        try:  # rank 1 with no frame: every rank raises (none waits in a collective the other left)
            with torch.no_grad():
                model.eval()(local if rank == 0 else local[:, :0])
        except ValueError as e:
            found["empty"] = str(e)
        try:
            elsa_vision.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)), process_group=group)
        except ValueError as e:
            found["no_aggregator"] = str(e)
        import streamvggt_standin as SV
        from elsa_vision.adapters import streamvggt as AS
        remove = AS.register_classes(**SV.CLASSES)
        try:
            elsa_vision.patch(SV.StreamVGGT(), process_group=group)
        except ValueError as e:
            found["streamvggt"] = str(e)
        remove()
        torch.save(found, os.path.join(out_dir, f"{rank}.pt"))


def test_vggt_sharded_refuses_local_attention():
    """A global block left unpatched, or one whose call needs the original forward, raises instead of
    attending to this rank's frames only, as does a call where a rank holds no frame (on every rank);
    a process_group no module can use raises at patch()."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_refusal_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2)
        found = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    for f in found:
        assert "global_blocks[1].attn is not patched with this process_group" in f["excluded"]
        assert "spans the ranks" in f["fallback"] and "hooks on attn_drop" in f["fallback"]
        assert "process_group works through vggt-aggregator modules" in f["no_aggregator"]
        assert "process_group is a VGGT option" in f["streamvggt"]
        assert "rank 1 holds no frame" in f["empty"]
    assert "hooks on attn_drop" in found[0]["one_rank"]
    assert "rank(s) [0] of the process group cannot run" in found[1]["one_rank"]


def test_process_group_none_under_a_launch(monkeypatch):
    model, _, _, remove = _standin_vggt(torch.float32)
    try:
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="init_process_group"):
            elsa_vision.patch(model, process_group=None)
        monkeypatch.setenv("WORLD_SIZE", "1")
        elsa_vision.patch(model, process_group=None)  # off: one process
    finally:
        remove()
