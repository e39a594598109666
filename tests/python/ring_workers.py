"""Worker side of test_ring_attention.py, run in processes started by torch.multiprocessing.spawn and
joined into one gloo process group. Every case runs twice: on the whole world (3 ranks) and on a subgroup
of 2 (global ranks 1 and 2, so group ranks differ from global ones; rank 0 waits meanwhile).

A case draws the full inputs (the same seed on every rank), computes single-process flare on the whole
sequence, runs the ring on this rank's shard, and compares this rank's part of out, lse, dq, dk, dv.
A failure is recorded, not raised, so the ranks stay in step and the other cases still run; each rank
writes its records to rank<r>.json for the test to report."""

import datetime
import json
import os
import re
import traceback
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from flare import ops
from flare.distributed import (gather_sequence, local_positions, local_positions_varlen, ring_attention,
                               ring_attention_varlen, shard_sequence, shard_varlen, unshard_varlen)

WORLD = 3                 # processes spawned
SUBGROUP = (1, 2)         # the second ring


@dataclass(frozen=True)
class Where:
    """The ring a check runs on: its group, size and this process's rank in it."""
    group: Optional[dist.ProcessGroup]
    world: int
    rank: int

    @property
    def split(self):
        return dict(world_size=self.world, rank=self.rank)


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype = torch.float32
    batch: int = 2
    chunk: int = 4                  # dense: tokens per chunk (global seqlen = chunk * chunks)
    lengths: Optional[Tuple[int, ...]] = None  # varlen: global lengths in chunks
    nheads: int = 4
    nheads_k: int = 4
    headdim: int = 16
    headdim_v: int = 16
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None     # None, "heads" (nheads), "batch" (batch, nheads)
    zigzag: bool = True
    scale: Optional[float] = None


f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
RAGGED = (3, 0, 5, 1, 2)  # sequence lengths in chunks: ragged, one empty

# Small chunks (3-6 tokens) with windows of a few tokens: windows end inside chunks, cross chunk borders
# and reach past neighbouring chunks, so every block geometry of blocks.py comes up.
CASES = [
    Case("noncausal_fp32"),
    Case("noncausal_scale_fp32", scale=0.3, chunk=5),
    Case("causal_fp32_gqa", causal=True, nheads_k=2, chunk=5),
    Case("causal_bf16_gqa", dtype=bf16, causal=True, nheads_k=2, chunk=6),
    Case("causal_fp64_mqa_headdim_v", dtype=f64, causal=True, nheads_k=1, headdim_v=24),
    Case("causal_window_fp64", dtype=f64, causal=True, window=(5, -1), chunk=3),
    Case("window_two_sided_fp64", dtype=f64, window=(3, 6), chunk=4),
    Case("window_left_only_fp64", dtype=f64, window=(9, -1), chunk=3),
    Case("window_right_only_fp64", dtype=f64, window=(-1, 2), chunk=3),
    Case("window_diagonal_only_fp64", dtype=f64, window=(0, 0), chunk=3),
    Case("softcap_causal_fp32", causal=True, softcap=3.0),
    Case("softcap_window_bf16", dtype=bf16, softcap=4.0, window=(6, 1)),
    Case("alibi_causal_fp64", dtype=f64, causal=True, alibi="heads"),
    Case("alibi_noncausal_batch_slopes_fp64", dtype=f64, alibi="batch", chunk=3),
    Case("alibi_window_fp64", dtype=f64, alibi="heads", window=(6, 3), chunk=3),
    Case("alibi_softcap_gqa_fp32", alibi="heads", softcap=5.0, causal=True, nheads_k=2),
    Case("contiguous_causal_fp32", causal=True, zigzag=False, chunk=6),
    Case("contiguous_window_alibi_fp64", dtype=f64, alibi="heads", window=(7, 2), zigzag=False, chunk=5),
    Case("varlen_causal_fp32_gqa", lengths=RAGGED, causal=True, nheads_k=2),
    Case("varlen_noncausal_bf16", dtype=bf16, lengths=RAGGED),
    Case("varlen_causal_window_fp64", dtype=f64, lengths=RAGGED, causal=True, window=(4, -1)),
    Case("varlen_window_softcap_fp32_mqa", lengths=RAGGED, window=(3, 5), softcap=4.0, nheads_k=1),
    Case("varlen_alibi_batch_slopes_fp64", dtype=f64, lengths=RAGGED, alibi="batch", causal=True),
    Case("varlen_contiguous_causal_fp32", lengths=RAGGED, causal=True, zigzag=False),
]
CASES_BY_NAME = {c.name: c for c in CASES}
CHECKS = ["sharding_round_trip", "input_errors"]
TRANSFORMERS_CHECKS = ["transformers_dense", "transformers_packed"]  # on the 2-rank ring only (import cost)


def plan():
    """(ring size, record name) of everything a run checks."""
    names = [c.name for c in CASES] + CHECKS
    return [(WORLD, n) for n in names] + [(len(SUBGROUP), n) for n in names + TRANSFORMERS_CHECKS]


# ---- comparisons --------------------------------------------------------------------------------------

TOL = {f64: 1e-6, f32: 2e-5}  # fp64: the merge weights come from flare's fp32 lse


def _compare(what, ring, single, exact, world):
    """ring and single-process flare agree: fp64/fp32 within a tight tolerance; bf16 no further from the
    fp64 result than twice single-process bf16 flare (FA3's rule) plus one bf16 rounding per ring step
    (flare returns each block's result in the input dtype)."""
    if ring.dtype in TOL:
        tol = TOL[ring.dtype]
        torch.testing.assert_close(ring, single, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
        return
    err_ring = (ring.double() - exact.double()).abs().max().item()
    err_single = (single.double() - exact.double()).abs().max().item()
    bound = 2 * err_single + world * 2 ** -8 * exact.double().abs().max().item()
    assert err_ring <= bound, f"{what}: max error {err_ring:.3g} vs fp64, single-process bf16 {err_single:.3g}"


# ---- one case -----------------------------------------------------------------------------------------


def _inputs(case, world, gen):
    parts = 2 * world if case.zigzag else world
    if case.lengths is None:
        lead, batch, cu = (case.batch, case.chunk * parts), case.batch, None
    else:
        lens = [m * parts for m in case.lengths]
        lead, batch = (sum(lens),), len(lens)
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = draw(*lead, case.nheads, case.headdim)
    k = draw(*lead, case.nheads_k, case.headdim)
    v = draw(*lead, case.nheads_k, case.headdim_v)
    dout = draw(*lead, case.nheads, case.headdim_v)
    slopes = None
    if case.alibi is not None:
        shape = (case.nheads,) if case.alibi == "heads" else (batch, case.nheads)
        slopes = (torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.5 + 0.05).float()
    return q, k, v, dout, slopes, cu


def _single(case, q, k, v, dout, slopes, cu):
    """Single-process flare on the whole sequence: (out, lse, dq, dk, dv)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    m = 0 if cu is None else int((cu[1:] - cu[:-1]).max())
    out, lse = ops.fwd(q, k, v, cu, cu, None, m, m, slopes, case.scale or 0.0, case.causal, case.window[0],
                       case.window[1], case.softcap, False)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _ring(case, q, k, v, dout, slopes, cu, where):
    """The ring on this rank's shard: (out, lse, dq, dk, dv), all local."""
    if cu is None:
        shard = lambda t: shard_sequence(t, **where.split, zigzag=case.zigzag)  # noqa: E731
    else:
        shard = lambda t: shard_varlen(t, cu, **where.split, zigzag=case.zigzag)[0]  # noqa: E731
    ql, kl, vl = (shard(t).detach().requires_grad_() for t in (q, k, v))
    options = dict(group=where.group, causal=case.causal, softmax_scale=case.scale, window_size=case.window,
                   softcap=case.softcap, alibi_slopes=slopes, return_lse=True, zigzag=case.zigzag)
    if cu is None:
        out, lse = ring_attention(ql, kl, vl, **options)
    else:
        _, cu_local, max_local = shard_varlen(q, cu, **where.split, zigzag=case.zigzag)
        out, lse = ring_attention_varlen(ql, kl, vl, cu_local, cu_local, max_local, max_local, **options)
    out.backward(shard(dout))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def run_case(case, where):
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # the same on every rank
    q, k, v, dout, slopes, cu = _inputs(case, where.world, gen)
    exact = _single(case, q, k, v, dout, slopes, cu)  # fp64
    cast = [t.to(case.dtype) for t in (q, k, v, dout)]
    single = _single(case, *cast, slopes, cu)
    ring = _ring(case, *cast, slopes, cu, where)
    compare_shards(case, where, cu, ring, single, exact)


def compare_shards(case, where, cu, ring, single, exact, compare_lse=None):
    """This rank's share of the whole-sequence results (single, exact: (out, lse, dq, dk, dv)) against the
    ring's, each by _compare (on the host); lse by compare_lse(got, want) instead where given."""
    if cu is None:
        shard_rows = lambda t: shard_sequence(t, **where.split, zigzag=case.zigzag)              # noqa: E731
        shard_lse = lambda t: shard_sequence(t, **where.split, zigzag=case.zigzag, seq_dim=2)    # noqa: E731
    else:
        index = shard_varlen(torch.arange(int(cu[-1])), cu, **where.split, zigzag=case.zigzag)[0]
        shard_rows = lambda t: t.index_select(0, index.to(t.device))                             # noqa: E731
        shard_lse = lambda t: t.index_select(1, index.to(t.device))                              # noqa: E731
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        shard = shard_lse if name == "lse" else shard_rows
        got, want = ring[i].cpu(), shard(single[i]).cpu()
        if name == "lse" and compare_lse is not None:
            compare_lse(got, want)
        else:
            _compare(name, got, want, shard(exact[i]).cpu(), where.world)


# ---- helpers and errors -------------------------------------------------------------------------------


def check_sharding_round_trip(where):
    """shard -> gather (all_gather) gives the original back; shards of positions are local_positions."""
    w, r, g = where.world, where.rank, where.group
    x = torch.arange(2 * 4 * w * 3, dtype=torch.float32).reshape(2, 4 * w, 3)
    for zigzag in (True, False):
        local = shard_sequence(x, group=g, zigzag=zigzag)  # world size and rank from the group
        assert torch.equal(gather_sequence(local, group=g, zigzag=zigzag), x)
        assert torch.equal(local_positions(4 * w, group=g, zigzag=zigzag),
                           shard_sequence(torch.arange(4 * w), w, r, zigzag=zigzag, seq_dim=0))
    c = 2  # zigzag: rank r holds chunks r and 2w-1-r of 2w
    expected = torch.cat([x[:, r * c:(r + 1) * c], x[:, (2 * w - 1 - r) * c:(2 * w - r) * c]], dim=1)
    assert torch.equal(shard_sequence(x, w, r), expected)
    lens = [2 * w * m for m in RAGGED]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    packed = torch.randn(int(cu[-1]), 2)
    positions = torch.cat([torch.arange(n) for n in lens])
    for zigzag in (True, False):
        shards = [shard_varlen(packed, cu, w, rank, zigzag=zigzag) for rank in range(w)]
        assert torch.equal(unshard_varlen([s[0] for s in shards], cu, zigzag=zigzag), packed)
        assert torch.equal(shards[r][1], (cu // w).int()) and shards[r][2] == max(lens) // w
        assert torch.equal(local_positions_varlen(cu, w, r, zigzag=zigzag),
                           shard_varlen(positions, cu, w, r, zigzag=zigzag)[0])


def _raises(exc, match, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert re.search(match, str(e)), f"{exc.__name__} without {match!r}: {e}"
        return
    raise AssertionError(f"no {exc.__name__} ({match!r})")


def check_input_errors(where):
    """Bad input raises a clear error on every rank before any communication (so no rank hangs)."""
    g, w = where.group, where.world
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    dense, varlen = ring_attention, ring_attention_varlen
    _raises(ValueError, "local seqlen 7 is odd", dense, q[:, :7], k[:, :7], k[:, :7], group=g)
    _raises(ValueError, "one dtype", dense, q, k.double(), k, group=g)
    _raises(ValueError, "multiple of it", dense, q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16), group=g)
    _raises(ValueError, "same batch and local seqlen", dense, q, k[:, :4], k[:, :4], group=g)
    _raises(ValueError, "window_size", dense, q, k, k, group=g, window_size=(-2, 0))
    _raises(ValueError, "alibi_slopes has shape", dense, q, k, k, group=g, alibi_slopes=torch.ones(3))
    _raises(ValueError, "4 dimensions", varlen, q, k, k, None, None, 0, 0, group=g)
    cu, other = torch.tensor([0, 2, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    _raises(ValueError, "cu_seqlens_k differs", varlen, q[0], k[0], k[0], cu, other, 6, 6, group=g)
    odd = torch.tensor([0, 3, 8], dtype=torch.int32)
    _raises(ValueError, "sequence 0 has local length 3", varlen, q[0], k[0], k[0], odd, odd, 5, 5, group=g)
    _raises(ValueError, "max_seqlen_q=2", varlen, q[0], k[0], k[0], cu, cu, 2, 6, group=g)
    short = torch.tensor([0, 2, 6], dtype=torch.int32)
    _raises(ValueError, "end at the token count 8", varlen, q[0], k[0], k[0], short, short, 4, 4, group=g)
    _raises(ValueError, f"pad it to a multiple of {2 * w}", shard_sequence, q[:, :2 * w + 1], **where.split)
    _raises(ValueError, "sequence 1 has length 5", shard_varlen, q[0, :7],
            torch.tensor([0, 2 * w, 2 * w + 5]), **where.split)


# ---- transformers -------------------------------------------------------------------------------------


def _tiny_llama(attn):
    import transformers
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _models(where):
    import flare.distributed.transformers as ring_hf
    ring_hf.register(where.group)
    ring_model, eager = _tiny_llama("flare_ring"), _tiny_llama("eager")
    eager.load_state_dict(ring_model.state_dict())
    return ring_model, eager


def _grads_match(ring_model, eager, where):
    """Summed over the ranks, the shards' parameter gradients are the whole sequence's."""
    for (name, p), (_, p_ref) in zip(ring_model.named_parameters(), eager.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=where.group)
        torch.testing.assert_close(g, p_ref.grad, atol=2e-5, rtol=1e-4, msg=lambda m: f"grad {name}: {m}")


def check_transformers_dense(where):
    """A tiny Llama (GQA) on zigzag shards: this rank's logits, the loss of its globally shifted labels and,
    summed over the ranks, the gradients equal eager attention on the whole batch."""
    import flare.distributed.transformers as ring_hf
    ring_model, eager = _models(where)
    gen = torch.Generator().manual_seed(1)
    n = 6 * where.world
    ids = torch.randint(0, 96, (2, n), generator=gen)
    weights = torch.randn(2, n, 96, generator=gen)
    batch = ring_hf.shard_inputs(ids, labels=ids, group=where.group)
    out, ref = ring_model(**batch), eager(ids)
    mine = lambda t: shard_sequence(t, **where.split)  # noqa: E731
    torch.testing.assert_close(out.logits, mine(ref.logits), atol=2e-5, rtol=1e-4)
    expected = torch.nn.functional.cross_entropy(mine(ref.logits).reshape(-1, 96), batch["shift_labels"].reshape(-1))
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)
    (out.logits * mine(weights)).sum().backward()
    (ref.logits * weights).sum().backward()
    _grads_match(ring_model, eager, where)


def check_transformers_packed(where):
    """Packed sequences (one row, cu_seqlens) through the ring: logits and gradients equal eager attention
    on each sequence alone."""
    import flare.distributed.transformers as ring_hf
    ring_model, eager = _models(where)
    gen = torch.Generator().manual_seed(2)
    lens = [2 * where.world * m for m in (2, 3, 1)]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ids = torch.randint(0, 96, (1, sum(lens)), generator=gen)
    weights = torch.randn(sum(lens), 96, generator=gen)
    logits = ring_model(**ring_hf.shard_packed_inputs(ids, cu, group=where.group)).logits[0]
    ref = torch.cat([eager(ids[:, a:b]).logits[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    mine = lambda t: shard_varlen(t, cu, **where.split)[0]  # noqa: E731
    torch.testing.assert_close(logits, mine(ref), atol=2e-5, rtol=1e-4)
    (logits * mine(weights)).sum().backward()
    (ref * weights).sum().backward()
    _grads_match(ring_model, eager, where)


# ---- the worker ---------------------------------------------------------------------------------------


def read_records(result_dir, nprocs):
    """The ranks' records (rank<r>.json in result_dir) merged: {"<ring size>/<check>": None where it passed
    on every rank that ran it, else a failing rank's traceback}."""
    records = {}
    for rank in range(nprocs):
        with open(os.path.join(result_dir, f"rank{rank}.json")) as f:
            for name, error in json.load(f).items():
                if error is not None:
                    records[name] = f"rank {rank}: {error}"
                else:
                    records.setdefault(name, None)
    return records



def _run_all(where, names, records):
    for name in names:
        try:
            if name in CASES_BY_NAME:
                run_case(CASES_BY_NAME[name], where)
            else:
                globals()["check_" + name](where)
            records[f"{where.world}/{name}"] = None
        except Exception:  # noqa: BLE001 - recorded for the test to report
            records[f"{where.world}/{name}"] = traceback.format_exc(limit=8)
        dist.barrier(group=where.group)


def run(rank, store, result_dir):
    """torch.multiprocessing.spawn entry: join the group, run every check on both rings, write records."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    records = {}
    try:
        subgroup = dist.new_group(list(SUBGROUP))  # every rank takes part in creating it
        per_ring = {}
        for size, name in plan():
            per_ring.setdefault(size, []).append(name)
        _run_all(Where(None, WORLD, rank), per_ring[WORLD], records)
        if rank in SUBGROUP:
            _run_all(Where(subgroup, len(SUBGROUP), SUBGROUP.index(rank)), per_ring[len(SUBGROUP)], records)
        dist.barrier()
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()
