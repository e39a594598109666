"""flare.distributed ring attention: real multi-process runs on the CPU (gloo), forward and backward equal to
single-process flare on the whole sequence, for every feature (causal zigzag, windows, softcap, ALiBi,
GQA/MQA, varlen, fp64/fp32/bf16), plus the sharding helpers, input errors and the transformers helper.

One spawn of ring_workers.WORLD processes runs every check, on the whole world and on a 2-rank subgroup
(ring_workers.py says how); each check is one test here, failing with the worker's traceback. The block
planner, the heart of the mask geometry, is also checked in-process against brute force."""

import itertools
import os
import tempfile

import pytest
import torch

import ring_workers
from flare.distributed.blocks import merge_partial, plan_block

_RUN = {}


def _records():
    """Spawn the workers once per session; {"<ring size>/<check>": None or traceback} merged over ranks."""
    if "records" not in _RUN:
        import torch.multiprocessing as mp
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # W processes on a small machine: one thread each
        try:
            with tempfile.TemporaryDirectory() as d:
                mp.spawn(ring_workers.run, args=(os.path.join(d, "store"), d), nprocs=ring_workers.WORLD)
                records = ring_workers.read_records(d, ring_workers.WORLD)
            _RUN["records"] = records
        except Exception as e:  # noqa: BLE001 - every test reports the failed run
            _RUN["records"] = e
        finally:
            if before is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = before
    return _RUN["records"]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("world,check", ring_workers.plan(), ids=[f"{w}ranks-{c}" for w, c in ring_workers.plan()])
def test_ring(world, check):
    records = _records()
    if isinstance(records, Exception):
        raise records
    key = f"{world}/{check}"
    assert key in records, f"{key} did not run"
    assert records[key] is None, records[key]


# ---- in-process: the block planner and the merge --------------------------------------------------------


def _visible(qs, ql, ks, kl, left, right):
    """Brute force: {(i, j): |t|} of the block's visible pairs, t = global query - key position."""
    pairs = {}
    for i, j in itertools.product(range(ql), range(kl)):
        t = (qs + i) - (ks + j)
        if (left < 0 or t <= left) and (right < 0 or t >= -right):
            pairs[i, j] = abs(t)
    return pairs


def _planned(plan, ql, kl):
    """{(i, j): |t|} that one flare call following the plan sees (flare's bottom-right window and ALiBi)."""
    pairs = {}
    rows, keys = plan.query_rows + plan.pad_rows, plan.key_rows
    for io, jo in itertools.product(range(plan.query_rows), range(plan.key_rows)):
        tf = io - jo + keys - rows
        if (plan.window_left < 0 or tf <= plan.window_left) and (plan.window_right < 0 or tf >= -plan.window_right):
            i, j = (ql - 1 - io, kl - 1 - jo) if plan.flip else (io, jo)
            pairs[i, j] = abs(tf) - plan.alibi_shift
    return pairs


@pytest.mark.parametrize("alibi", [False, True])
def test_plan_block_matches_brute_force(alibi):
    windows = (-1, 0, 1, 2, 4, 7, 11)
    for c, qc, kc in itertools.product((1, 2, 3, 5), range(6), range(6)):
        for left, right in itertools.product(windows, windows):
            truth = _visible(qc * c, c, kc * c, c, left, right)
            plan = plan_block(qc * c, c, kc * c, c, left, right, alibi)
            where = f"chunk {c}, chunks ({qc}, {kc}), window ({left}, {right}), alibi {alibi}: {plan}"
            if plan is None:
                assert not truth, where
                continue
            got = _planned(plan, c, c)
            assert set(got) == set(truth), where
            if alibi:
                assert got == truth, where
            else:
                assert plan.pad_rows == 0 and not plan.flip, where


def test_plan_block_unequal_chunks_without_alibi():
    for ql, kl, qs, ks in itertools.product((1, 2, 5), (1, 3, 4), range(0, 10, 3), range(0, 10, 2)):
        for left, right in itertools.product((-1, 0, 2, 5), (-1, 0, 3)):
            plan = plan_block(qs, ql, ks, kl, left, right)
            truth = _visible(qs, ql, ks, kl, left, right)
            assert (plan is None and not truth) or set(_planned(plan, ql, kl)) == set(truth)


def test_plan_block_alibi_refuses_a_misaligned_straddling_block():
    with pytest.raises(ValueError, match="straddles the diagonal"):
        plan_block(2, 4, 0, 4, -1, -1, alibi=True)


BLOCK_CASES = {  # (causal, window, softcap, alibi)
    "plain": (False, (-1, -1), 0.0, False),
    "causal": (True, (-1, -1), 0.0, False),
    "causal_window": (True, (4, -1), 0.0, False),
    "window_two_sided_softcap": (False, (2, 5), 3.0, False),
    "alibi_causal": (True, (-1, -1), 0.0, True),
    "alibi_window_softcap": (False, (6, 3), 2.0, True),
}


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_blocks_reassemble_whole_attention(name):
    """A ring without processes: every (query chunk, key chunk) block run by its plan, forward results
    merged through the LSE and backward contributions summed, equals one flare call on the whole sequence;
    rows that see nothing in a block (lse -inf) merge without NaN."""
    from flare import ops
    from flare.distributed.blocks import AttnOptions, attend_block, attend_block_backward
    causal, (left, right), softcap, alibi = BLOCK_CASES[name]
    torch.manual_seed(0)
    chunks, c = 4, 3
    q, k, v, dout = (torch.randn(2, chunks * c, h, 8, dtype=torch.float64) for h in (4, 2, 2, 4))
    slopes = torch.rand(4) * 0.5 + 0.1 if alibi else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ops.fwd(q, k, v, None, None, None, 0, 0, slopes, 0.0, causal, left, right, softcap, False)
    out.backward(dout)
    opts = AttnOptions(softmax_scale=0.0, window_left=left, window_right=0 if causal else right, softcap=softcap,
                       deterministic=False, alibi=alibi)
    out_acc = torch.zeros(out.shape, dtype=torch.float64)
    lse_acc = torch.full(lse.shape, float("-inf"))
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    out_d = out.detach()
    for a, b in itertools.product(range(chunks), repeat=2):
        plan = plan_block(a * c, c, b * c, c, opts.window_left, opts.window_right, alibi)
        if plan is None:
            continue
        qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
        with torch.no_grad():
            row0, o, l = attend_block(q[:, qs], k[:, ks], v[:, ks], plan, opts, slopes)
            rows = slice(a * c + row0, a * c + row0 + o.shape[1])
            merge_partial(out_acc[:, rows], lse_acc[:, :, rows], o, l)
            row0, dq, key0, dk, dv = attend_block_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out_d[:, qs],
                                                           lse[:, :, qs], plan, opts, slopes)
        grads[0][:, a * c + row0:a * c + row0 + dq.shape[1]] += dq
        grads[1][:, b * c + key0:b * c + key0 + dk.shape[1]] += dk
        grads[2][:, b * c + key0:b * c + key0 + dv.shape[1]] += dv
    torch.testing.assert_close(out_acc, out_d, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_acc, lse, atol=1e-5, rtol=1e-6)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, atol=1e-6, rtol=1e-6)


def test_merge_partial_keeps_empty_rows_empty():
    acc, lse = torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("-inf"))
    merge_partial(acc, lse, torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(acc, torch.zeros_like(acc)) and torch.isneginf(lse).all()
