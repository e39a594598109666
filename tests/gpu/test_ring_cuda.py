"""flare.distributed ring attention on CUDA tensors: 3 processes (and a 2-rank subgroup) on one GPU, every
feature, forward and backward against single-process flare on the GPU and the fp64 result; and one rank
over NCCL with the real transport; with 2-4 GPUs, every case with one rank per GPU over NCCL.
ring_cuda_workers.py says how the ranks share the GPU. With --device cpu the staged-ring cases run on the
CPU backend (a check of the harness); the NCCL ones need CUDA."""

import os
import tempfile

import pytest
import torch

import ring_cuda_workers as workers
from ring_workers import read_records

DEVICE = os.environ.get("FLARE_TEST_DEVICE", "cuda")
_RUN = {}


def _spawn(fn, nprocs):
    """Run fn in nprocs processes; {"<ring size>/<case>": None or traceback}, merged over the ranks."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(fn, args=(os.path.join(d, "store"), d, DEVICE), nprocs=nprocs)
        return read_records(d, nprocs)


def _records(key, fn, nprocs):
    if key not in _RUN:
        try:
            _RUN[key] = _spawn(fn, nprocs)
        except Exception as e:  # noqa: BLE001 - every test of the run reports it
            _RUN[key] = e
    return _RUN[key]


def _check(records, name):
    if isinstance(records, Exception):
        pytest.fail(f"the ring processes failed: {records!r}")
    assert name in records, f"no record for {name}: the run stopped before it"
    if records[name] is not None:
        pytest.fail(records[name], pytrace=False)


def _check_case(records, world, case):
    """_check for one case of `world` ranks. Every case is one the sm90 forward claims (fp16/bf16, head dims 64
    and 128, dense or varlen), so with the sm90 path forced each must run as on auto."""
    _check(records, f"{world}/{case}")


@pytest.mark.parametrize("world,case", workers.plan(), ids=[f"{w}ranks-{c}" for w, c in workers.plan()])
def test_ring_cuda(world, case):
    _check_case(_records("staged", workers.run, workers.WORLD), world, case)


@pytest.mark.skipif(DEVICE != "cuda", reason="NCCL moves CUDA tensors: the GPU run only")
@pytest.mark.parametrize("name", ["causal_bf16_gqa_hd128", "varlen_causal_bf16_gqa", "nccl_refuses_cpu"])
def test_ring_nccl_one_rank(name):
    if not torch.distributed.is_nccl_available():
        pytest.fail("this torch has no NCCL")
    _check_case(_records("nccl", workers.run_nccl_single, 1), 1, name)


_NCCL_WORLD = workers.nccl_world() if DEVICE == "cuda" else 0


@pytest.mark.skipif(_NCCL_WORLD < 2, reason="NCCL between GPUs needs 2 or more GPUs (run on the 2-GPU machine)")
@pytest.mark.parametrize("case", [c.name for c in workers.CASES])
def test_ring_nccl_gpus(case):
    """Every case with one rank per GPU over NCCL: the real transport on NCCL's stream."""
    _check_case(_records("nccl-gpus", workers.run_nccl, _NCCL_WORLD), _NCCL_WORLD, case)
