#!/usr/bin/env python3
"""GPU benchmark of forwards with few query rows (decode steps, speculative and chunked ones, short prompts
against a long context): the path AUTO picks against each kernel family on the same call, in one process.

  flare          flash_attn_func on auto: the KV-cache kernels where forward_on_decode_kernels
                 (src/cuda/heuristics.hpp) says they are the faster for the call's few rows, else sm90 / sm80
  flare-sm90     the sm90 forward kernel, forced (128-row query tiles, one head each)
  flare-sm80     the sm80 forward kernel, forced
  flare-decode   the KV-cache kernels on every shape (flash_attn_with_kvcache on the same k / v as a dense cache,
                 no append): rows packed 16 to a CTA, split-KV by decode_splits
  fa2            torch's FlashAttention 2 forward (torch.ops.aten._flash_attention_forward; causal is bottom-right
                 there, as in flare)

Shapes: bf16, 32 query heads over 8 kv heads (group 4) or 32 (group 1), head dim 128 (64 and 256 on a subset),
batch 1 and 8, seqlen_k 2K and 16K (512 on a subset), seqlen_q 1 to 256, causal (bottom-right) and not. Each row: time (us,
triton's do_bench: CUDA events, L2 flushed, median), TFLOP/s (4 · b · h · pairs · d, pairs the (query, key)
pairs computed) and kv_tbps (the K and V bytes of the call over its time: the bandwidth view, which is the
ceiling at few rows). Before timing, each output is compared with flare-sm80's; a max abs difference above
2^-5 marks the row "check_failed" and makes the exit status 1.

  python3 bench/gpu/bench_packed.py --out $OUT      -> $OUT/gpu-packed-<date>-<sha>.json
"""

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "bench"), str(REPO / "python")]

import meta as run_meta  # noqa: E402

IMPLS = ["flare", "flare-sm90", "flare-sm80", "flare-decode", "fa2"]
SEQLENS_Q = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CHECK_TOLERANCE = 2.0 ** -5


def configs(quick):
    """(batch, nheads, nheads_k, headdim, seqlen_k, causal) of each group of rows (every seqlen_q each)."""
    out = []
    for batch in (1, 8):
        for heads in ((32, 8), (32, 32)):
            for seqlen_k in (2048, 16384):
                for causal in (True, False):
                    out.append((batch, *heads, 128, seqlen_k, causal))
    for d in (64, 256):
        out.append((8, 32, 8, d, 16384, True))
    for heads in ((32, 8), (32, 32)):  # short keys: the whole call is a few tiles
        out.append((8, *heads, 128, 512, True))
    return out[:2] if quick else out


def pairs(seqlen_q, seqlen_k, causal):
    if not causal:
        return seqlen_q * seqlen_k
    # bottom-right: query i sees keys 0 .. seqlen_k - seqlen_q + i
    return sum(max(0, min(seqlen_k, seqlen_k - seqlen_q + i + 1)) for i in range(seqlen_q))


def make_fns(q, k, v, causal):
    import flare

    def forward(path):
        return lambda: flare.flash_attn_func(q, k, v, causal=causal, arch_path=path)

    def fa2():
        return torch.ops.aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                       False)[0]

    return {"flare": forward("auto"), "flare-sm90": forward("sm90"), "flare-sm80": forward("sm80"),
            "flare-decode": lambda: flare.flash_attn_with_kvcache(q, k, v, causal=causal), "fa2": fa2}


def time_shape(fns, base, flops, kv_bytes, args, rows):
    import triton.testing
    reference = fns["flare-sm80"]().float()
    us, failed = {}, False
    for impl, fn in fns.items():
        row = {"pass": "fwd", "impl": impl, **base}
        rows.append(row)
        try:
            err = (fn().float() - reference).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a path that refuses a shape is recorded, not fatal
            row["skipped"] = f"{type(e).__name__}: {e}"[:300]
            continue
        row.update(us=round(ms * 1e3, 2), tflops=round(flops / ms / 1e9, 2),
                   kv_tbps=round(kv_bytes / ms / 1e9, 3), max_diff_vs_sm80=err)
        if err > CHECK_TOLERANCE:
            row["check_failed"] = True
            failed = True
        us[impl] = row["us"]
    flare_row = rows[-len(fns)]
    if "us" in flare_row:
        for impl in IMPLS[1:]:
            if impl in us:
                flare_row[f"speedup_vs_{impl}"] = round(us[impl] / us["flare"], 3)
    return us, failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="two groups of rows (a check of the script)")
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", help="only the groups of these batch sizes")
    ap.add_argument("--seqlens-k", type=int, nargs="+", help="only the groups of these key counts")
    args = ap.parse_args(argv)

    rows, failed = [], False
    path = run_meta.default_result_path(Path(args.out), "gpu-packed", args.quick)
    meta = {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
            "seed": args.seed}
    print(f"{'b':>2} {'h/hk':>6} {'d':>4} {'sk':>6} {'causal':>6} {'sq':>4} | " +
          " | ".join(f"{i:>12}" for i in IMPLS) + "   (us; flare = auto)", flush=True)
    for batch, h, hk, d, seqlen_k, causal in configs(args.quick):
        if (args.batches and batch not in args.batches) or (args.seqlens_k and seqlen_k not in args.seqlens_k):
            continue
        torch.manual_seed(args.seed)
        k = torch.randn(batch, seqlen_k, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, seqlen_k, hk, d, device="cuda", dtype=torch.bfloat16)
        for seqlen_q in SEQLENS_Q:
            q = torch.randn(batch, seqlen_q, h, d, device="cuda", dtype=torch.bfloat16)
            base = {"batch": batch, "nheads": h, "nheads_k": hk, "headdim": d, "seqlen_q": seqlen_q,
                    "seqlen_k": seqlen_k, "causal": causal, "packed_rows": h // hk * seqlen_q, "dtype": "bf16"}
            flops = 4.0 * batch * h * d * pairs(seqlen_q, seqlen_k, causal)
            kv_bytes = 2.0 * batch * seqlen_k * hk * d * 2
            us, bad = time_shape(make_fns(q, k, v, causal), base, flops, kv_bytes, args, rows)
            failed |= bad
            print(f"{batch:>2} {h:>3}/{hk:<2} {d:>4} {seqlen_k:>6} {str(causal):>6} {seqlen_q:>4} | " +
                  " | ".join(f"{us.get(i, float('nan')):>12.1f}" for i in IMPLS), flush=True)
        run_meta.write_result(path, {"meta": meta, "rows": rows})  # after each group: a cut run keeps its rows
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
