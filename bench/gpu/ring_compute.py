#!/usr/bin/env python3
"""Ring attention's compute on one GPU: what each rank of a W-GPU ring computes, timed alone, against
flare on the whole sequence. The transport is left out, so this bounds a multi-GPU run from above; the
2-GPU run (NCCL, bench/results/ring-<date>-<sha>.json) is what measures the ring with its communication.

For a global sequence of N tokens (batch 1, bf16, head dim 128, 16 heads: model width 2048) and W ranks,
rank r's part is run by the real ring_attention code (zigzag split when causal, contiguous otherwise: the
default layouts), with a transport that hands each block back unchanged instead of sending it (NullRing):
every block call, mask geometry, fp32 merge and the dK/dV accumulation run as on rank r of a real ring,
one rank after another on this one GPU. Rows:
  gpus 1:  flare (flash_attn_func) on all N tokens;
  gpus W:  the slowest rank's time (a ring step waits for it), tokens_per_s = N / that time, and
           efficiency = T(1 GPU) / (W x T(slowest rank)): the scaling efficiency a ring whose transfers
           hide completely behind compute would reach. "rank_ms" lists every rank's time.
Passes: fwd, and fwd+bwd (one forward and its backward, as a training step runs them).
Timing: CUDA events around each call, median of `reps` after one warm-up call.

  python3 bench/gpu/ring_compute.py --out $OUT                   N 32K..256K, W 2/4/8
  python3 bench/gpu/ring_compute.py --totals 4096 --worlds 2 --device cpu --headdim 32 --heads 2
                                                                 no GPU: the code path on the CPU backend
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

from flops import attention_flops  # noqa: E402
import meta as run_meta  # noqa: E402


class _Handed:
    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors


class NullRing:
    """Rank `rank` of a ring of `world_size` whose transport returns what it is given: each block a rank
    would receive has the same shapes (and, for the mask geometry, the same source rank) as the real one."""

    def __init__(self, world_size, rank, backend="nccl"):
        self.world_size, self.rank, self.group, self.backend = world_size, rank, None, backend

    def source(self, step):
        return (self.rank - step) % self.world_size

    def pass_on(self, tensors, tag=0):
        return _Handed([t.contiguous() for t in tensors])


def add_shape_args(p):
    """The options ring_compute.py and ring_bench.py share: shapes, repetitions, device, budget, output."""
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causals", type=int, nargs="+", default=[1, 0], help="1: causal (zigzag), 0: full")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="stop starting new shapes after this many seconds (the rows so far are written)")
    p.add_argument("--out", type=Path, default=None, help="directory for the JSON (default bench/results)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--totals", type=int, nargs="+", default=[32768, 65536, 131072, 262144],
                   help="global sequence lengths N")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="ring sizes W")
    add_shape_args(p)
    return p.parse_args(argv)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, reps, device):
    """Median wall time of fn() in ms after one warm-up call (CUDA events on the GPU)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def passes(attend, q, k, v):
    """{"fwd": fn, "fwd+bwd": fn} for attend(q, k, v) -> out, with fresh leaf inputs and a fixed dout."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attend(*leaves)

    def fwd_bwd():
        out = attend(*leaves)
        out.backward(dout)
        for t in leaves:
            t.grad = None

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def main(argv=None):
    args = parse_args(argv)
    run_meta.prefer_cuda_build()
    import flare.distributed.ring as ring_module
    from flare.flash_attn_interface import flash_attn_func

    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "shapes": f"batch 1, {args.heads} heads, head dim {args.headdim}, bf16; global seqlen N split over "
                      "W ranks (causal: zigzag, chunks r and 2W-1-r of 2W; full: contiguous)",
            "what": "compute only: each rank's ring_attention run alone on this GPU with a transport that "
                    "hands blocks back unchanged (NullRing); efficiency = T(1 GPU) / (W x slowest rank), "
                    "the bound a ring whose transfers hide completely would reach",
            "timing": f"CUDA events, median of {args.reps} after one warm-up"}
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ring_compute: no CUDA device (use --device cpu to check the script)")
    dtype = torch.bfloat16
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows, started = [], time.monotonic()
    real_ring = ring_module.Ring
    for causal in (bool(c) for c in args.causals):
        for total in args.totals:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: N={total} causal={causal} and later not run")
                continue
            shape = (1, total, args.heads, args.headdim)
            q, k, v = (torch.randn(shape, device=args.device, dtype=dtype) for _ in range(3))
            single = {p: time_ms(fn, args.reps, args.device)
                      for p, fn in passes(lambda a, b, c: flash_attn_func(a, b, c, causal=causal), q, k, v).items()}
            flops = {p: attention_flops(p, 1, args.heads, total, total, args.headdim, causal) for p in ("fwd", "bwd")}
            flops["fwd+bwd"] = flops["fwd"] + flops.pop("bwd")
            for p, ms in single.items():
                rows.append({"pass": p, "impl": "flare", "gpus": 1, "dtype": "bf16", "batch": 1, "seqlen": total,
                             "nheads": args.heads, "headdim": args.headdim, "causal": causal, "ms": ms,
                             "tflops": flops[p] / ms / 1e9, "tokens_per_s": total / ms * 1e3})
            print(f"N={total} {'causal' if causal else 'full'}: 1 GPU fwd {single['fwd']:.2f} ms, "
                  f"fwd+bwd {single['fwd+bwd']:.2f} ms", flush=True)
            for world in args.worlds:
                if total % (2 * world):
                    continue
                rank_ms = {"fwd": [], "fwd+bwd": []}
                for rank in range(world):
                    ring_module.Ring = lambda group=None, _w=world, _r=rank: NullRing(_w, _r, backend)
                    try:
                        local = [t[:, : total // world] for t in (q, k, v)]
                        fns = passes(lambda a, b, c: ring_module.ring_attention(a, b, c, causal=causal, zigzag=causal),
                                     *local)
                        for p, fn in fns.items():
                            rank_ms[p].append(time_ms(fn, args.reps, args.device))
                    finally:
                        ring_module.Ring = real_ring
                for p, times in rank_ms.items():
                    slowest = max(times)
                    rows.append({"pass": p, "impl": "flare-ring-compute-only", "gpus": world, "dtype": "bf16",
                                 "batch": 1, "seqlen": total, "nheads": args.heads, "headdim": args.headdim,
                                 "causal": causal, "ms": slowest, "rank_ms": [round(t, 3) for t in times],
                                 "tokens_per_s": total / slowest * 1e3,
                                 "efficiency": single[p] / (world * slowest)})
                print(f"  W={world}: slowest rank fwd {max(rank_ms['fwd']):.2f} ms (efficiency "
                      f"{single['fwd'] / (world * max(rank_ms['fwd'])):.3f}), fwd+bwd {max(rank_ms['fwd+bwd']):.2f}"
                      f" ms ({single['fwd+bwd'] / (world * max(rank_ms['fwd+bwd'])):.3f})", flush=True)
            del q, k, v
            if args.device == "cuda":
                torch.cuda.empty_cache()
    out_dir = args.out or (REPO / "bench" / "results")
    topic = "ring-compute" + ("-cpu-check" if args.device == "cpu" else "")
    path = run_meta.write_result(run_meta.default_result_path(out_dir, topic), {"meta": meta, "rows": rows})
    print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
