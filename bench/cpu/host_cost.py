#!/usr/bin/env python3
"""Host time of one flare call from Python, on tensors so small that the attention itself costs little:
  tensor_view             a torch tensor -> flare_tensor (python/flare/_capi.py, one struct.pack), against
  tensor_view_by_field    the same view set field by field (how it was built before, kept here to compare)
  op_fwd / eager_fwd      flare::fwd through torch's custom-op dispatch / ops.fwd_eager, same arguments
  op_bwd / eager_bwd      likewise for the backward
  c_fwd                   the C entry point alone (lib.fwd on prepared params): the floor of the above
Each figure is the median over 5 batches of the mean time per call (us), time.perf_counter.

  python3 bench/cpu/host_cost.py            writes bench/results/host-cost-<date>-<sha>.json
"""

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import meta as run_meta  # noqa: E402
from flare import _capi, ops  # noqa: E402


def tensor_view_by_field(t):
    view = _capi.flare_tensor()
    view.data = t.data_ptr()
    view.dtype = _capi._DTYPES[str(t.dtype)]
    view.device = _capi.flare_device(_capi._DEVICES[t.device.type], t.device.index or 0)
    view.rank = t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        view.shape[i], view.strides[i] = size, stride
    return view


def per_call_us(fn, calls):
    fn()
    means = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(means)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    q = torch.randn(1, 8, 2, 16)
    out, lse = ops.fwd_eager(q, q, q, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    fwd_args = (q, q, q, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    bwd_args = (q, q, q, q, out, lse, None, None, None, 0, 0, None, 0.0, False, -1, -1, 0.0, False)
    assert bytes(_capi.tensor_view(q)) == bytes(tensor_view_by_field(q)), "the two views differ"
    lib = _capi.library()
    params = lib.fwd_params()
    tv = _capi.tensor_view
    params.q, params.k, params.v, params.out, params.softmax_lse = tv(q), tv(q), tv(q), tv(out), tv(lse)
    cases = {
        "tensor_view": lambda: _capi.tensor_view(q),
        "tensor_view_by_field": lambda: tensor_view_by_field(q),
        "op_fwd": lambda: ops.fwd(*fwd_args),
        "eager_fwd": lambda: ops.fwd_eager(*fwd_args),
        "op_bwd": lambda: ops.bwd(*bwd_args),
        "eager_bwd": lambda: ops.bwd_eager(*bwd_args),
        "c_fwd": lambda: lib.fwd(params),
    }
    rows = []
    for name, fn in cases.items():
        us = per_call_us(fn, args.calls)
        rows.append({"what": name, "us_per_call": us})
        print(f"{name:22s} {us:8.1f} us")
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), "cpu": run_meta.cpu_description(),
            "flare_cpu_isa": lib.cpu_isa(),
            "shapes": "q = k = v (1, 8, 2, 16) fp32 on the CPU, one thread",
            "pointer_bytes": ctypes.sizeof(ctypes.c_void_p)}
    path = run_meta.write_result(run_meta.default_result_path(args.out, "host-cost"), {"meta": meta, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
