#!/usr/bin/env python3
"""One attention call for a profiler to look at: flare's kernels or torch SDPA's FLASH_ATTENTION (FA2) on the
same shape, forward or backward, bf16, in the BENCH.md layout (16384 tokens, width 2048).

tests/gpu/run.sh's profile stage runs it under Nsight Compute once per implementation, so that the two
kernels' counters (issue slots, stall reasons, shared-memory wavefronts, atomics) can be read side by side:

  ncu -k regex:'backward_kernel|flash_bwd' -c 1 python3 bench/gpu/profile_target.py --impl flare --pass bwd

Each call runs twice (a warm-up and the profiled launch; pass `ncu --launch-skip 1` to skip the first).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

TOTAL_TOKENS = 16384
MODEL_WIDTH = 2048


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["flare", "torch-flash"], required=True)
    ap.add_argument("--pass", dest="pass_", choices=["fwd", "bwd"], default="bwd")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    if TOTAL_TOKENS % args.seqlen or MODEL_WIDTH % args.headdim:
        ap.error(f"seqlen must divide {TOTAL_TOKENS} and headdim {MODEL_WIDTH}")

    batch, heads = TOTAL_TOKENS // args.seqlen, MODEL_WIDTH // args.headdim
    torch.manual_seed(0)
    shape = (batch, args.seqlen, heads, args.headdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if args.impl == "flare":
        import flare

        def attention():
            return flare.flash_attn_func(q, k, v, causal=args.causal)
    else:
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

        def attention():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)

    for _ in range(2):
        if args.pass_ == "fwd":
            with torch.no_grad():
                attention()
        else:
            out = attention()
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print(f"{args.impl} {args.pass_} hd {args.headdim} seqlen {args.seqlen} "
          f"{'causal' if args.causal else 'full'}: done")


if __name__ == "__main__":
    main()
