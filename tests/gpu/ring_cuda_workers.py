"""Worker side of test_ring_cuda.py: ring attention on CUDA tensors, in processes that share one GPU.

NCCL refuses two ranks on one device, so on a one-GPU machine the ranks join a gloo group and the ring's
transport stages each block through host memory (StagedRing: device -> host, gloo send/recv, host ->
device). Everything else is the code a multi-GPU run executes: the public functions, the zigzag split, the
block geometry, flare's CUDA kernels for every block, the fp32 LSE merge and the autograd backward with
dK/dV travelling the ring. NCCL's own transport needs the 2-GPU machine; this checks everything around it.

Cases reuse the CPU suite's machinery (tests/python/ring_workers.py) at GPU sizes: chunks of 37-129 tokens,
head dims 64/128, bf16 and fp16, against single-process flare on the GPU and the fp64 CPU result, by the
CPU suite's bf16 rule. Every case runs on the whole world (3 ranks) and on a 2-rank subgroup; records are
written per rank as in the CPU suite. run_nccl_single checks the real Ring over NCCL with one rank; on a
machine with 2-4 GPUs, run_nccl runs every case with one rank per GPU over NCCL, transport included."""

import datetime
import json
import os
import sys
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from ring_workers import Case, Where, _inputs, _ring, _single, compare_shards  # noqa: E402

import flare.distributed.ring as ring_module  # noqa: E402
from flare.distributed.comm import Pending, Ring  # noqa: E402

WORLD = 3
SUBGROUP = (1, 2)
bf16, f16 = torch.bfloat16, torch.float16
RAGGED = (37, 0, 101, 5, 64)  # sequence lengths in chunks (x 2W tokens): ragged, one empty

CASES = [
    Case("noncausal_bf16_hd64", dtype=bf16, chunk=100, headdim=64, headdim_v=64),
    Case("noncausal_fp16_hd128_scale", dtype=f16, chunk=129, headdim=128, headdim_v=128, scale=0.05),
    Case("causal_bf16_gqa_hd128", dtype=bf16, causal=True, chunk=77, nheads=8, nheads_k=2, headdim=128,
         headdim_v=128),
    Case("causal_fp16_mqa_hd64", dtype=f16, causal=True, chunk=64, nheads_k=1, headdim=64, headdim_v=64),
    Case("causal_window_bf16", dtype=bf16, causal=True, window=(150, -1), chunk=61, headdim=64, headdim_v=64),
    Case("window_two_sided_fp16", dtype=f16, window=(40, 90), chunk=50, headdim=64, headdim_v=64),
    Case("softcap_causal_bf16", dtype=bf16, causal=True, softcap=2.0, chunk=45, headdim=64, headdim_v=64),
    Case("alibi_causal_bf16", dtype=bf16, causal=True, alibi="heads", chunk=53, headdim=64, headdim_v=64),
    Case("alibi_window_batch_slopes_fp16", dtype=f16, alibi="batch", window=(70, 20), chunk=40, headdim=64,
         headdim_v=64),
    Case("contiguous_causal_bf16", dtype=bf16, causal=True, zigzag=False, chunk=96, headdim=128, headdim_v=128),
    Case("varlen_causal_bf16_gqa", dtype=bf16, lengths=RAGGED, causal=True, nheads_k=2, headdim=64,
         headdim_v=64),
    Case("varlen_noncausal_fp16_hd128", dtype=f16, lengths=RAGGED, headdim=128, headdim_v=128),
    Case("varlen_window_softcap_bf16_mqa", dtype=bf16, lengths=RAGGED, window=(30, 50), softcap=3.0,
         nheads_k=1, headdim=64, headdim_v=64),
    Case("varlen_alibi_causal_fp16", dtype=f16, lengths=RAGGED, alibi="batch", causal=True, headdim=64,
         headdim_v=64),
]
CASES_BY_NAME = {c.name: c for c in CASES}


def plan():
    """(ring size, case name) of everything a run checks."""
    return [(WORLD, c.name) for c in CASES] + [(len(SUBGROUP), c.name) for c in CASES]


class StagedRing(Ring):
    """Ring whose transport stages CUDA tensors through host memory over gloo (one GPU, several ranks)."""

    def pass_on(self, tensors, tag=0):
        device = tensors[0].device
        host = [t.detach().contiguous().cpu() for t in tensors]  # waits for the producing kernels
        received = [torch.empty_like(t) for t in host]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag + i) for i, t in enumerate(host)]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, tag + i) for i, t in enumerate(received)]
        works = dist.batch_isend_irecv(ops)
        return _ToDevice(Pending(works, host, received), device)


class _ToDevice:
    def __init__(self, pending, device):
        self._pending, self._device = pending, device

    def wait(self):
        return [t.to(self._device) for t in self._pending.wait()]


def run_case(case, where, device="cuda"):
    """As ring_workers.run_case, on `device`: inputs drawn on the host (the same on every rank), the fp64
    result by flare's CPU backend, single-process and ring flare on the GPU."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    q, k, v, dout, slopes, cu = _inputs(case, where.world, gen)
    exact = _single(case, q, k, v, dout, slopes, cu)  # fp64, CPU
    cast = [t.to(device=device, dtype=case.dtype) for t in (q, k, v, dout)]
    slopes_dev = None if slopes is None else slopes.to(device)
    cu_dev = None if cu is None else cu.to(device)
    single = _single(case, *cast, slopes_dev, cu_dev)
    ring = _ring(case, *cast, slopes_dev, cu, where)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), ring):
        assert t.device == cast[0].device, f"{name} came back on {t.device}, the inputs are on {cast[0].device}"
        assert torch.isfinite(t).all(), f"ring {name} has non-finite values"
    compare_shards(case, where, cu, ring, single, exact, compare_lse=_lse_close)


def _lse_close(got, want):
    """fp32 on both sides; the ring merges the blocks' fp32 lse in fp32."""
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=lambda m: f"lse: {m}")


def _run_all(where, names, records, device):
    for name in names:
        try:
            run_case(CASES_BY_NAME[name], where, device)
            records[f"{where.world}/{name}"] = None
        except Exception:  # noqa: BLE001 - recorded for the test to report
            records[f"{where.world}/{name}"] = traceback.format_exc(limit=8)
        dist.barrier(group=where.group)


def run(rank, store, result_dir, device="cuda"):
    """torch.multiprocessing.spawn entry: WORLD ranks on one GPU, a gloo group, the staged transport
    (device "cpu": the same on the CPU backend, a check of the harness without a GPU)."""
    torch.set_num_threads(2)
    if device == "cuda":
        torch.cuda.set_device(0)
    ring_module.Ring = StagedRing  # ring_attention builds its Ring from this name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    records = {}
    try:
        subgroup = dist.new_group(list(SUBGROUP))
        per_ring = {}
        for size, name in plan():
            per_ring.setdefault(size, []).append(name)
        _run_all(Where(None, WORLD, rank), per_ring[WORLD], records, device)
        if rank in SUBGROUP:
            _run_all(Where(subgroup, len(SUBGROUP), SUBGROUP.index(rank)), per_ring[len(SUBGROUP)], records,
                     device)
        dist.barrier()
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()


def run_nccl_single(rank, store, result_dir, device="cuda"):
    """One rank over NCCL with the real Ring: the ring is one local block, equal to single-process flare."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    records = {}
    try:
        for case in (CASES_BY_NAME["causal_bf16_gqa_hd128"], CASES_BY_NAME["varlen_causal_bf16_gqa"]):
            try:
                run_case(case, Where(None, 1, 0))
                records[f"1/{case.name}"] = None
            except Exception:  # noqa: BLE001
                records[f"1/{case.name}"] = traceback.format_exc(limit=8)
        try:  # NCCL moves CUDA tensors only: CPU tensors are refused by name
            x = torch.randn(1, 8, 2, 16)
            ring_module.ring_attention(x, x, x)
            records["1/nccl_refuses_cpu"] = "no error for CPU tensors on an NCCL group"
        except ValueError as e:
            records["1/nccl_refuses_cpu"] = None if "NCCL" in str(e) else f"unexpected message: {e}"
    finally:
        with open(os.path.join(result_dir, "rank0.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()



def nccl_world():
    """Ranks of the multi-GPU NCCL run: one per GPU, at most 4 (0 or 1 GPU: none)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return min(n, 4) if n >= 2 else 0


def run_nccl(rank, store, result_dir, device="cuda"):
    """One rank per GPU over NCCL with the real Ring (its transport included): every case on the whole world."""
    world = nccl_world()
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    records = {}
    try:
        for case in CASES:
            try:
                run_case(case, Where(None, world, rank), f"cuda:{rank}")
                records[f"{world}/{case.name}"] = None
            except Exception:  # noqa: BLE001
                records[f"{world}/{case.name}"] = traceback.format_exc(limit=8)
            dist.barrier()
    finally:
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()
