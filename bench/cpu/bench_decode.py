#!/usr/bin/env python3
"""CPU decode benchmark: flare's KV-cache pass (flare_fwd_kvcache, its decode path) against torch's CPU
scaled_dot_product_attention on the same dense cache, with the run's own memory-copy ceiling.

Shapes (BENCH.md's decode protocol on the CPU): one query token per sequence, 32 query heads over 8 KV heads,
head dim 128, batch 1 / 4 / 16, KV length 2K ... 128K, bf16 and fp32. The cache is dense (batch, kv_len,
nheads_k, headdim), full (cache_seqlens = kv_len); torch gets its (batch, nheads_k, kv_len, headdim) views
with enable_gqa, as a serving engine on torch would call it. A row whose caches would not fit in
--max-cache-gib is recorded as skipped.

tbps = KV bytes read per second = batch * kv_len * nheads_k * (headdim + headdim_v) * element size / time.
Ceilings, measured in the same run on the same threads before the rows: copy_tbps, a copy of a 1 GiB buffer
(bytes read + bytes written per second, as BENCH.md's GPU copy ceiling counts them), and read_tbps, a sum
over a 1 GiB buffer (bytes read per second: what a decode, which only reads, could reach). Each row carries
copy_ratio = tbps / copy_tbps, and row_copy_ratio (below).

Timing: time.perf_counter around each call, one warm-up, then 3..--max-runs rounds (as many as fit in about
--budget-s per implementation). In each round flare, a copy of the ceiling's buffers and torch in turn each
run back to back for at least WARM_S (at least once), then once more, timed: ms (and tbps, copy_ratio) is the
median of those calls, made in the state the copy ceiling is measured in (back-to-back copies) and a decode
step's (attention between the layers' weight reads keeps the memory busy). ms_after_peer is the median of each
round's first call (flare's right after torch's). On the 2-core Zen 4 machine memory read slowly for the first
~10 ms after idle or compute-bound work: after 0.3 s of sleep the first 1.8 ms decode call read 15.5 GB/s and
the ones after it 22-25, after 0.3 s of a torch matmul 22.7 then 25-26, after 0.3 s of streaming reads 23-25
from the first call on (docs/tuning-cpu.md). torch's SDPA calls, tens to thousands of ms long, are timed the
same way. Every call reads the next of several copies of the cache, together at least --rotate-mib, so that
the last-level cache does not flatter small caches. The copy timed in the rounds gives the row's own ceiling,
row_copy_tbps, and row_copy_ratio = tbps / row_copy_tbps: this VM's copy bandwidth moved between 28 and 47
GB/s from one minute to the next, so a ceiling measured once before the rows can be from another phase.
Before timing, flare's output is checked against torch SDPA on fp32 copies (within 2x torch's own error plus
a small tolerance) or the run stops.

  python3 bench/cpu/bench_decode.py            # full run: bench/results/cpu-decode-<date>-<sha>.json
  python3 bench/cpu/bench_decode.py --quick    # a few small rows: build/bench/cpu-decode-quick-<date>-<sha>.json
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "bench"))

import meta  # noqa: E402
from flare._capi import Flare, tensor_view  # noqa: E402
from table import Console, fmt  # noqa: E402

BATCHES = [1, 4, 16]
KV_LENS = [2048, 8192, 32768, 131072]
NHEADS, NHEADS_K, HEADDIM = 32, 8, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-4, "bf16": 1e-2}  # accuracy gate, as in bench_cpu.py
GIB = 1024.0 ** 3
CEILING_BYTES = 1 << 30
WARM_S = 0.02  # back-to-back calls before each timed one (module docstring)


def kv_bytes(batch, kv_len, dtype):
    return batch * kv_len * NHEADS_K * 2 * HEADDIM * torch.empty(0, dtype=dtype).element_size()


def median_s(fn, runs=5):
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_ceilings(src, dst):
    """copy_tbps (read + written) and read_tbps (read) over the buffers src and dst, on torch's threads."""
    nbytes = src.numel() * src.element_size()
    copy_s = median_s(lambda: dst.copy_(src))
    read_s = median_s(lambda: src.sum())
    return {"copy_tbps": round(2 * nbytes / copy_s * 1e-12, 5), "read_tbps": round(nbytes / read_s * 1e-12, 5),
            "ceiling_buffer_gib": round(nbytes / GIB, 3)}


class FlareDecode:
    """flare_fwd_kvcache on fixed tensors, one params struct per cache copy, built outside the timed calls."""

    def __init__(self, lib, q, caches, threads, num_splits):
        b = q.shape[0]
        self.lib = lib
        self.out = torch.empty_like(q)
        self.lse = torch.empty(b, NHEADS, 1, dtype=torch.float32)
        self.seqlens = torch.full((b,), caches[0][0].shape[1], dtype=torch.int32)
        self._keep = (q, caches)  # the params hold raw pointers to these
        self.params = []
        for k, v in caches:
            p = lib.kvcache_params()
            p.q, p.k_cache, p.v_cache = tensor_view(q), tensor_view(k), tensor_view(v)
            p.cache_seqlens = tensor_view(self.seqlens)
            p.out, p.softmax_lse = tensor_view(self.out), tensor_view(self.lse)
            p.num_splits = num_splits
            p.exec.num_threads = threads
            self.params.append(p)
        self.turn = 0

    def __call__(self):
        self.lib.fwd_kvcache(self.params[self.turn % len(self.params)])
        self.turn += 1


def torch_decode(q, k, v):
    """torch SDPA on the same cache: q (b, 1, h, d), k/v (b, kv, hk, d) -> (b, 1, h, d)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    return out.transpose(1, 2)


def time_warm_ms(fns, max_runs, budget_s, warm_s=WARM_S):
    """Per callable, the median ms of its timed calls after >= warm_s of its own back-to-back calls and the
    median ms of each round's first call (module docstring): {name: (warm_ms, first_ms)}, and the rounds."""
    once = 0.0
    for fn in fns.values():
        start = time.perf_counter()
        fn()
        once += time.perf_counter() - start
    per_round = sum(max(warm_s, 0.0) for _ in fns) + 2 * once
    rounds = int(min(max_runs, max(3, len(fns) * budget_s / max(per_round, 1e-9))))
    first = {name: [] for name in fns}
    warm = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            begin = start = time.perf_counter()
            fn()
            first[name].append(time.perf_counter() - start)
            while time.perf_counter() - begin < warm_s:
                fn()
            start = time.perf_counter()
            fn()
            warm[name].append(time.perf_counter() - start)
    return {name: (statistics.median(warm[name]) * 1e3, statistics.median(first[name]) * 1e3)
            for name in fns}, rounds


def run_row(lib, dtype_name, batch, kv_len, seed, args, table):
    dtype = DTYPES[dtype_name]
    shape = {"batch": batch, "seqlen_q": 1, "seqlen_k": kv_len, "nheads": NHEADS, "nheads_k": NHEADS_K,
             "headdim": HEADDIM, "causal": False}
    base = {"pass": "decode", "dtype": dtype_name, **shape}
    nbytes = kv_bytes(batch, kv_len, dtype)
    copies = max(1, math.ceil(args.rotate_mib * 2 ** 20 / nbytes))
    if nbytes * copies > args.max_cache_gib * GIB:
        copies = 1
    if nbytes > args.max_cache_gib * GIB:
        why = f"a cache needs {nbytes / GIB:.1f} GiB (> --max-cache-gib {args.max_cache_gib:g})"
        table.console.row(dtype_name, batch, kv_len, None, None, None, None, None, None, f"skipped: {why}")
        return [{**base, "impl": impl, "ms": None, "skipped": why} for impl in ("flare", "torch-cpu")]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, NHEADS, HEADDIM, generator=gen).to(dtype)
    caches = [tuple(torch.randn(batch, kv_len, NHEADS_K, HEADDIM, generator=gen).to(dtype) for _ in range(2))
              for _ in range(copies)]
    flare = FlareDecode(lib, q, caches, args.threads, args.num_splits)

    # Accuracy gate on the first copy.
    flare()
    flare.turn = 0
    ref = torch_decode(q.float(), caches[0][0].float(), caches[0][1].float())
    theirs = torch_decode(q, *caches[0])
    err_flare = (flare.out.float() - ref).abs().max().item()
    err_torch = (theirs.float() - ref).abs().max().item()
    bound = 2 * err_torch + TOL[dtype_name] * max(1.0, ref.abs().max().item())
    if not err_flare <= bound:
        raise AssertionError(f"{dtype_name} batch {batch} kv {kv_len}: flare differs from the fp32 reference by "
                             f"{err_flare:.3e}, torch by {err_torch:.3e}; allowed {bound:.3e}")
    del ref, theirs

    turn = [0]

    def torch_call():
        k, v = caches[turn[0] % copies]
        turn[0] += 1
        return torch_decode(q, k, v)

    src, dst = args.copy_buffers
    pairs, runs = time_warm_ms({"flare": flare, "copy": lambda: dst.copy_(src), "torch-cpu": torch_call},
                               args.max_runs, args.budget_s)
    row_copy_tbps = 2 * src.numel() * src.element_size() / (pairs.pop("copy")[0] * 1e-3) * 1e-12
    times = {impl: ms for impl, (ms, _) in pairs.items()}
    rows = []
    for impl, (ms, first_ms) in pairs.items():
        tbps = nbytes / (ms * 1e-3) * 1e-12
        rows.append({**base, "impl": impl, "ms": round(ms, 4), "tbps": round(tbps, 5),
                     "copy_ratio": round(tbps / args.copy_tbps, 4), "row_copy_tbps": round(row_copy_tbps, 5),
                     "row_copy_ratio": round(tbps / row_copy_tbps, 4), "ms_after_peer": round(first_ms, 4),
                     "copy_ratio_after_peer": round(nbytes / (first_ms * 1e-3) * 1e-12 / args.copy_tbps, 4),
                     "runs": runs, "cache_copies": copies,
                     "max_abs_err": float(f"{err_flare if impl == 'flare' else err_torch:.3e}")})
    table.console.row(dtype_name, batch, kv_len, fmt(times["flare"], 3), fmt(times["torch-cpu"], 3),
                      fmt(rows[0]["tbps"] * 1e3, 1), f"{rows[0]['copy_ratio']:.2f}", f"{rows[0]['row_copy_ratio']:.2f}",
                      f"{rows[0]['copy_ratio_after_peer']:.2f}", f"{times['torch-cpu'] / times['flare']:.2f}x")
    return rows


def default_out(quick):
    if quick:  # smoke runs stay out of bench/results
        return meta.default_result_path(REPO / "build" / "bench", "cpu-decode", quick=True)
    return meta.default_result_path(meta.RESULTS, "cpu-decode")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few small rows (smoke test; written under build/)")
    p.add_argument("--out", type=Path, help="result JSON (default bench/results/cpu-decode-<date>-<sha>.json)")
    p.add_argument("--lib", type=Path, default=Path(os.environ.get("FLARE_LIB",
                                                                   REPO / "build/release/src/libflare.so")))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for flare, torch and the ceilings")
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    p.add_argument("--kv-lens", type=int, nargs="+", default=KV_LENS)
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    p.add_argument("--num-splits", type=int, default=0, help="flare's num_splits (0: its heuristic)")
    p.add_argument("--max-runs", type=int, default=20, help="timed rounds per row, at most")
    p.add_argument("--budget-s", type=float, default=3.0, help="about this many seconds of timed runs per row "
                   "and implementation (at least 3 rounds)")
    p.add_argument("--rotate-mib", type=float, default=1024.0,
                   help="cache copies per row add up to at least this much (beyond the last-level cache)")
    p.add_argument("--max-cache-gib", type=float, default=12.0, help="skip rows whose caches exceed this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:  # smaller defaults; shapes given on the command line stay
        if args.batches == BATCHES:
            args.batches = [1, 4]
        if args.kv_lens == KV_LENS:
            args.kv_lens = [2048, 8192]
        args.max_runs, args.budget_s, args.rotate_mib, args.max_cache_gib = 3, 0.3, 64.0, 1.0
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.lib.is_file():
        sys.exit(f"bench_decode: {args.lib} not found: build it first (cmake --preset release && "
                 f"cmake --build build/release -j) or pass --lib")
    lib = Flare(args.lib)
    ceiling_bytes = CEILING_BYTES if not args.quick else CEILING_BYTES // 8
    args.copy_buffers = (torch.ones(ceiling_bytes // 4), torch.empty(ceiling_bytes // 4))
    ceilings = memory_ceilings(*args.copy_buffers)  # before the rows
    args.copy_tbps = ceilings["copy_tbps"]
    run = {
        **meta.provenance(__file__), "device": meta.cpu_description(), "ceilings": ceilings,
        "flare_version": lib.version(), "flare_cpu_isa": lib.cpu_isa(), "torch": torch.__version__,
        "threads": args.threads, "num_splits": args.num_splits,
        "shapes": f"decode: 1 query token, {NHEADS} q heads / {NHEADS_K} kv heads, headdim {HEADDIM}, dense full "
                  f"cache; tbps = KV bytes read per second",
        "timing": f"time.perf_counter, 3..{args.max_runs} rounds after one warm-up; in each round flare, then "
                  f"torch-cpu, runs back to back for >= {WARM_S * 1e3:g} ms, then once more timed (ms: median of "
                  f"those); a 1 GiB copy timed alike in each round: row_copy_tbps; ms_after_peer: median of each "
                  f"round's first call (flare's right after torch-cpu's); "
                  f"each call reads the next of the row's cache copies (>= {args.rotate_mib:g} MiB together)",
    }
    print(f"flare {run['flare_version']} ({run['flare_cpu_isa']}) vs torch {torch.__version__} on {run['device']}, "
          f"{args.threads} threads; ceilings {ceilings}")
    table = Table()
    rows = []
    seed = args.seed
    for dtype_name in args.dtypes:
        for batch in args.batches:
            for kv_len in args.kv_lens:
                rows += run_row(lib, dtype_name, batch, kv_len, seed, args, table)
                seed += 1
    out = meta.write_result(args.out or default_out(args.quick), {"meta": run, "rows": rows})
    print(f"\nwrote {out} ({len(rows)} rows)")
    return out


class Table:
    def __init__(self):
        self.console = Console([("dtype", -5), ("batch", 5), ("kv len", 7), "|", ("flare ms", 10),
                                ("torch ms", 10), ("flare GB/s", 10), ("/copy", 6),
                                ("/row copy", 9), ("/copy 1st", 9), ("torch/flare", 11)])


if __name__ == "__main__":
    main()
