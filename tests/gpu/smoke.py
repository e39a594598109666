"""Quick CUDA check of flare's kernels: forward and backward against an fp32 torch reference on a handful of
cases (the full suite is tests/gpu/test_cuda_attention.py), then a few timings against torch's FA2 and cuDNN.

    FLARE_LIBRARY=build/cuda/src/libflare.so python3 tests/gpu/smoke.py [--out DIR] [--headdims 64,128]
Prints one line per case and exits non-zero if any case fails.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import flare  # noqa: E402
from flare.flash_attn_interface import flash_attn_func, flash_attn_varlen_func  # noqa: E402


def reference(q, k, v, causal, window, softcap, alibi, scale):
    """fp32 attention with FlashAttention semantics; q (b, sq, h, d), k/v (b, sk, hk, d)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float() for t in (q, k, v))
    kf = kf.repeat_interleave(h // hk, dim=2)
    vf = vf.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", qf, kf) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    diag = i + sk - sq
    if alibi is not None:
        s = s - alibi.view(1, h, 1, 1) * (diag - j).abs().float()
    wl, wr = window
    if causal:
        wr = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if wl >= 0:
        visible &= j >= diag - wl
    if wr >= 0:
        visible &= j <= diag + wr
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vf)
    return out, lse


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def check_case(dtype, b, sq, sk, h, hk, d, causal=False, window=(-1, -1), softcap=0.0, use_alibi=False,
               deterministic=False):
    torch.manual_seed(hash((b, sq, sk, h, hk, d, causal, window, softcap, use_alibi)) % 2**31)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
    alibi = torch.rand(h, device=dev) * 0.3 if use_alibi else None
    scale = 1 / math.sqrt(d)
    do = torch.randn(b, sq, h, d, device=dev, dtype=dtype)

    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                  alibi_slopes=alibi, deterministic=deterministic, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)

    # fp32 reference (the truth) and the same math in the input dtype (the yardstick of the dtype's error).
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(qr, kr, vr, causal, window, softcap, alibi, scale)
    rdq, rdk, rdv = torch.autograd.grad(ref, (qr, kr, vr), do.float())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    low, _ = reference(ql, kl, vl, causal, window, softcap, alibi, scale)
    low = low.to(dtype)
    ldq, ldk, ldv = torch.autograd.grad(low, (ql, kl, vl), do)

    ok = True
    msgs = []
    for name, got, want, yard in (("out", out, ref, low), ("dq", dq, rdq, ldq), ("dk", dk, rdk, ldk),
                                  ("dv", dv, rdv, ldv)):
        e = max_err(got, want)
        y = max_err(yard.to(dtype), want)
        tol = 2 * y + 1e-3 * max(1.0, want.abs().max().item() * 0.01)
        good = e <= tol and torch.isfinite(got).all().item()
        ok &= good
        msgs.append(f"{name} {e:.2e}/{tol:.2e}{'' if good else ' FAIL'}")
    finite = torch.isfinite(ref_lse)
    lse_e = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    lse_ok = lse_e < 1e-2 and bool((lse[~finite] == float("-inf")).all())
    ok &= lse_ok
    msgs.append(f"lse {lse_e:.1e}{'' if lse_ok else ' FAIL'}")
    return ok, " ".join(msgs)


def timing(headdims, out_rows):
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for d in headdims:
        for causal in (False, True):
            for seqlen in (1024, 4096, 8192):
                b, h = 16384 // seqlen, 2048 // d
                q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
                row = {"headdim": d, "causal": causal, "seqlen": seqlen}
                do = torch.randn_like(q)

                def fl():
                    return flash_attn_func(q, k, v, causal=causal)
                row["flare_fwd"] = flops / do_bench(fl) * 1e-9
                o = fl()
                row["flare_bwd"] = 2.5 * flops / do_bench(lambda: torch.autograd.grad(o, (q, k, v), do,
                                                                                       retain_graph=True)) * 1e-9
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        with sdpa_kernel(backend):
                            def sd():
                                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                            row[f"{name}_fwd"] = flops / do_bench(sd) * 1e-9
                            o2 = sd()
                            dot = do.transpose(1, 2)
                            row[f"{name}_bwd"] = 2.5 * flops / do_bench(
                                lambda: torch.autograd.grad(o2, (qt, kt, vt), dot, retain_graph=True)) * 1e-9
                    except RuntimeError as e:  # a backend that refuses a shape
                        row[f"{name}_error"] = str(e)[:100]
                print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                out_rows.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--headdims", default="64,128")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    hds = [int(x) for x in args.headdims.split(",")]
    print("device:", torch.cuda.get_device_name(), "flare has cuda:", flare._capi.lib().has_cuda()
          if hasattr(flare._capi, "lib") else "?", flush=True)
    cases = []
    for d in hds:
        for dtype in (torch.bfloat16, torch.float16):
            cases += [
                (dtype, 2, 128, 128, 4, 4, d),
                (dtype, 1, 113, 203, 4, 2, d, True),
                (dtype, 1, 203, 113, 4, 1, d, True),
                (dtype, 2, 1, 17, 2, 2, d),
                (dtype, 1, 1023, 1024, 2, 2, d, True),
                (dtype, 1, 799, 3, 2, 1, d),
                (dtype, 1, 300, 500, 4, 2, d, False, (64, 32)),
                (dtype, 1, 257, 257, 2, 2, d, False, (-1, -1), 30.0),
                (dtype, 1, 257, 300, 2, 2, d, True, (-1, -1), 0.0, True),
                (dtype, 2, 2048, 2048, 2, 2, d, True, (-1, -1), 0.0, False, True),
            ]
    failed = 0
    results = []
    for c in cases:
        try:
            ok, msg = check_case(*c)
        except Exception as e:  # report and go on
            ok, msg = False, f"EXCEPTION {type(e).__name__}: {e}"
        failed += not ok
        line = f"{'ok  ' if ok else 'FAIL'} {c[0]} b={c[1]} sq={c[2]} sk={c[3]} h={c[4]} hk={c[5]} d={c[6]} " \
               f"{c[7:]} : {msg}"
        print(line, flush=True)
        results.append(line)
    rows = []
    if not args.no_timing:
        timing(hds, rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "smoke.json"), "w") as f:
            json.dump({"cases": results, "failed": failed, "timing": rows}, f, indent=1)
    print(f"{failed} of {len(cases)} cases failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
