#!/usr/bin/env python3
"""GPU benchmark of varlen (packed) forwards, and of dense forwards at head dims 192 / 128: flare on the path it
picks (auto), flare with the sm80 path forced, and FlashAttention 2's varlen forward as torch ships it
(torch.ops.aten._flash_attention_forward with cumulative sequence lengths), in one process.

Batches: sequences of random lengths (seeded) packed to about --tokens tokens, in four mixes: "tiny" (16 to 128
tokens each), "short" (64 to 512, as packed fine-tuning data gives), "mid" (256 to 1024) and "long" (512 to
4096); flare on auto and on each forced path (sm90, sm80); head dims 64 / 128 / 256, bf16,
causal and not; nheads = --width / head dim. FLOPs count the (query, key) pairs each sequence computes (causal:
bottom-right, the key count of every row), 4 · pairs · head dim per head. Timing: triton.testing.do_bench
(CUDA events, L2 flushed, median) of the Python call, which every implementation pays alike. Before timing,
each implementation's output is compared with flare-sm80's (max abs difference, recorded per row); a
difference above 2^-5 marks the row "check_failed" and makes the exit status 1.

Group "pair" (dense, not varlen): head dims 192 with V's 128 (DeepSeek-style prefill), --tokens tokens of one
sequence length each (2K and 8K), causal and not, flare auto and flare-sm80 against torch SDPA's cuDNN backend
where it takes the shape; FLOPs 2 · b · h · sq · sk · (d + dv), halved when causal.

  python3 bench/gpu/bench_varlen.py --out $OUT       -> $OUT/gpu-varlen-<date>-<sha>.json
"""

import argparse
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "python"))

import meta as run_meta  # noqa: E402

MIXES = {"tiny": (16, 128), "short": (64, 512), "mid": (256, 1024), "long": (512, 4096)}
IMPLS = ["flare", "flare-sm90", "flare-sm80", "fa2-varlen"]
CHECK_TOLERANCE = 2.0 ** -5
RATIO_KEYS = {"fa2-varlen": "vs_fa2", "torch-cudnn": "vs_cudnn"}  # flare's row: its ratio to each peer


def lengths_of(mix, tokens, seed):
    lo, hi = MIXES[mix]
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(lo, hi), tokens - sum(lengths)))
    return lengths


def pairs_of(lengths, causal):
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def make_fns(q, k, v, cu, max_len, causal):
    import flare

    def flare_fn(path):
        return lambda: flare.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal,
                                                    arch_path=path)

    def fa2():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False)[0]

    return {"flare": flare_fn("auto"), "flare-sm90": flare_fn("sm90"), "flare-sm80": flare_fn("sm80"),
            "fa2-varlen": fa2}


def time_shape(fns, peer, flops, base, args, rows):
    """Checks each implementation of fns against flare-sm80's output, times it, and appends its row (base's
    fields, then ms, tflops, max_diff_vs_sm80; a refusal as "skipped"); flare's row gets its ratios to `peer`
    and to flare-sm80. Returns ({impl: tflops}, whether a check failed)."""
    import triton.testing
    reference = fns["flare-sm80"]().float()
    tflops, failed, added = {}, False, []
    for impl, fn in fns.items():
        row = {"pass": "fwd", "impl": impl, **base}
        added.append(row)
        try:
            err = (fn().float() - reference).abs().max().item()
            ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a peer that refuses a shape is recorded, not fatal
            row["skipped"] = f"{type(e).__name__}: {e}"[:300]
            continue
        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 2), max_diff_vs_sm80=err)
        if err > CHECK_TOLERANCE:
            row["check_failed"] = True
            failed = True
        tflops[impl] = row["tflops"]
    flare_row = added[0]
    if "tflops" in flare_row:
        if peer in tflops:
            flare_row[RATIO_KEYS[peer]] = round(tflops["flare"] / tflops[peer], 3)
        flare_row["vs_sm80"] = round(tflops["flare"] / tflops["flare-sm80"], 3)
    rows.extend(added)
    return tflops, failed


def ratio(tflops, a, b):
    return f"{tflops[a] / tflops[b]:.3f}" if a in tflops and b in tflops else "-"


def print_row(label, tflops, impls, width, peer, peer_width):
    """One console row under a group's header: each implementation's TFLOP/s (width columns), then flare over
    peer (peer_width) and over flare-sm80."""
    print(f"{label} | " + " | ".join(f"{tflops.get(i, float('nan')):>{width}.1f}" for i in impls) +
          f" | {ratio(tflops, 'flare', peer):>{peer_width}} {ratio(tflops, 'flare', 'flare-sm80'):>10}", flush=True)


def run_varlen(args, causals, rows):
    """Packed forwards of each mix and head dim: flare auto, flare-sm90, flare-sm80, FA2 varlen."""
    failed = False
    print(f"{'mix':>5} {'hd':>4} {'causal':>6} {'seqs':>5} | " + " | ".join(f"{i:>10}" for i in IMPLS) +
          " | flare/fa2 flare/sm80 (TFLOP/s)", flush=True)
    for mix in args.mixes:
        lengths = lengths_of(mix, args.tokens, args.seed)
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                          device="cuda")
        max_len, total = max(lengths), sum(lengths)
        for d in args.headdims:
            h = args.width // d
            torch.manual_seed(args.seed)
            q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in causals:
                base = {"mix": mix, "headdim": d, "nheads": h, "causal": causal, "sequences": len(lengths),
                        "tokens": total, "max_seqlen": max_len, "dtype": "bf16"}
                tflops, bad = time_shape(make_fns(q, k, v, cu, max_len, causal), "fa2-varlen",
                                         4.0 * h * d * pairs_of(lengths, causal), base, args, rows)
                failed |= bad
                print_row(f"{mix:>5} {d:>4} {str(causal):>6} {len(lengths):>5}", tflops, IMPLS, 10, "fa2-varlen", 9)
    return failed


def run_pairs(args, causals, rows):
    """Dense forwards at head dims 192 / 128: flare auto (the sm90 path), flare-sm80, torch cuDNN."""
    import flare
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    d, dv, failed = 192, 128, False
    impls = ["flare", "flare-sm80", "torch-cudnn"]
    print(f"{'hd':>7} {'seqlen':>6} {'causal':>6} | " + " | ".join(f"{i:>11}" for i in impls) +
          " | flare/cudnn flare/sm80 (TFLOP/s)", flush=True)
    for seqlen in (2048, 8192):
        b, h = max(1, args.tokens // seqlen), args.width // d
        torch.manual_seed(args.seed)
        q, k = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(b, seqlen, h, dv, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        for causal in causals:
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

            fns = {"flare": lambda: flare.flash_attn_func(q, k, v, causal=causal),
                   "flare-sm80": lambda: flare.flash_attn_func(q, k, v, causal=causal, arch_path="sm80"),
                   "torch-cudnn": cudnn}
            base = {"group": "pair", "batch": b, "nheads": h, "seqlen_q": seqlen, "seqlen_k": seqlen, "headdim": d,
                    "headdim_v": dv, "causal": causal, "dtype": "bf16"}
            flops = 2.0 * b * h * seqlen * seqlen * (d + dv) * (0.5 if causal else 1.0)
            tflops, bad = time_shape(fns, "torch-cudnn", flops, base, args, rows)
            failed |= bad
            print_row(f"{d:>3}/{dv:<3} {seqlen:>6} {str(causal):>6}", tflops, impls, 11, "torch-cudnn", 11)
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--warmup-ms", type=float, default=40)
    ap.add_argument("--rep-ms", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--groups", nargs="+", default=["varlen", "pair"], choices=["varlen", "pair"])
    args = ap.parse_args(argv)

    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows, failed = [], False
    if "varlen" in args.groups:
        failed |= run_varlen(args, causals, rows)
    if "pair" in args.groups:
        failed |= run_pairs(args, causals, rows)
    report = {"meta": {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta(),
                       "tokens": args.tokens, "width": args.width, "seed": args.seed, "mixes": MIXES},
              "rows": rows}
    path = run_meta.write_result(run_meta.default_result_path(Path(args.out), "gpu-varlen"), report)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
