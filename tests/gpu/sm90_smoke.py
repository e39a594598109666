"""A quick check of the sm90 forward on a Hopper GPU, in one call: the forced sm90 path on many cases against
the fp32 reference (the suite's rule; every mask and score feature, GQA/MQA, odd lengths), poisoned outputs
fully written, then a forward timing table flare-sm90 / flare-sm80 / torch FLASH (FA2) / cuDNN with the
run's matmul and copy ceilings. Writes bench/meta's JSON (topic gpu-sm90) under --out.

  FLARE_COMMIT=<sha> FLARE_LIBRARY=... python3 tests/gpu/sm90_smoke.py --out $OUT [--headdims 64,128,256]
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "bench" / "gpu"), str(REPO / "bench"), str(REPO / "python")]

from cases import Case, check_case  # noqa: E402


def set_path(path):
    if path is None:
        os.environ.pop("FLARE_CUDA_ARCH_PATH", None)
    else:
        os.environ["FLARE_CUDA_ARCH_PATH"] = path


def correctness(headdims):
    seqlens = [(1, 1), (17, 17), (64, 64), (113, 203), (203, 113), (799, 3), (3, 799), (128, 128), (129, 257),
               (1023, 1024), (2048, 2048)]
    features = {"plain": {}, "causal": dict(causal=True), "window-left": dict(window=(37, -1)),
                "window-right": dict(window=(-1, 29)), "window-both": dict(window=(64, 16)),
                "window-diagonal": dict(window=(0, 0)), "causal-window": dict(causal=True, window=(100, -1)),
                "softcap": dict(softcap=2.0, softmax_scale=0.5), "softcap-causal": dict(causal=True, softcap=30.0),
                "alibi-head": dict(alibi="head"), "alibi-batch-causal": dict(causal=True, alibi="batch"),
                "scale": dict(softmax_scale=0.37),
                "everything": dict(causal=True, window=(50, -1), softcap=20.0, alibi="batch", softmax_scale=0.2)}
    heads = [(4, 4), (6, 2), (4, 1)]
    results = []
    i = 0
    for d in headdims:
        for dtype in (torch.bfloat16, torch.float16):
            for (sq, sk) in seqlens:
                for fname, f in features.items():
                    if fname not in ("plain", "causal") and (sq, sk) not in ((113, 203), (203, 113), (799, 3),
                                                                            (1023, 1024)):
                        continue
                    nh, nhk = heads[i % 3]
                    i += 1
                    case = Case(dtype=dtype, batch=1 if max(sq, sk) >= 2048 else 2, seqlen_q=sq, seqlen_k=sk,
                                nheads=nh, nheads_k=nhk, headdim=d, **f)
                    name = f"d{d}-{'bf16' if dtype == torch.bfloat16 else 'fp16'}-{sq}x{sk}-{fname}-h{nh}/{nhk}"
                    try:
                        check_case(case, backward=False)
                        torch.cuda.synchronize()
                        results.append({"case": name, "ok": True})
                    except Exception as e:  # noqa: BLE001 - record and go on
                        msg = "".join(traceback.format_exception_only(type(e), e)).strip()[:800]
                        results.append({"case": name, "ok": False, "error": msg})
                        print("FAIL", name, msg, flush=True)
                        if "CUDA error" in msg or "illegal" in msg:
                            return results  # the context is gone
    return results


def poison(headdims):
    """Outputs prefilled with NaN must come back fully written (out: no NaN; lse: no NaN)."""
    from bench_gpu import FlareAbi
    out = []
    for d in headdims:
        for (b, s, sk, causal) in [(2, 333, 333, False), (1, 1000, 77, True), (3, 129, 1024, True)]:
            q = torch.randn(b, s, 4, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, sk, 2, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, sk, 2, d, device="cuda", dtype=torch.bfloat16)
            f = FlareAbi(q, k, v, torch.zeros_like(q), causal)
            f.out.fill_(float("nan"))
            f.lse.fill_(float("nan"))
            f.fwd()
            torch.cuda.synchronize()
            ok = not bool(torch.isnan(f.out).any()) and not bool(torch.isnan(f.lse).any())
            out.append({"case": f"d{d}-b{b}-{s}x{sk}-causal{causal}", "ok": ok})
            if not ok:
                print("POISON FAIL", out[-1], flush=True)
    return out


def timing(headdims, rep_ms):
    import triton.testing
    from bench_gpu import FlareAbi, measure_ceilings, sdpa, sdpa_backends, torch_inputs
    from flops import attention_flops
    time_ms = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")  # noqa: E731
    rows = [{"ceilings": measure_ceilings(time_ms)}]
    backends = sdpa_backends()
    for d in headdims:
        for causal in (False, True):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                flops = attention_flops("fwd", b, h, s, s, d, causal)
                row = {"headdim": d, "seqlen": s, "batch": b, "nheads": h, "causal": causal}
                for impl, path in (("flare-sm90", "sm90"), ("flare-sm80", "sm80")):
                    set_path(path)
                    f = FlareAbi(q, k, v, dout, causal)
                    ms = time_ms(f.fwd)
                    row[impl] = round(flops / ms / 1e9, 1)
                set_path(None)
                for impl in ("torch-flash", "torch-cudnn"):
                    tq, tk, tv, _ = torch_inputs(impl, q, k, v, dout)
                    attend = sdpa(backends[impl], causal)
                    try:
                        ms = time_ms(lambda: attend(tq, tk, tv))
                        row[impl] = round(flops / ms / 1e9, 1)
                    except RuntimeError as e:
                        row[impl] = None
                        row[impl + "-error"] = str(e)[:200]
                if row.get("torch-cudnn"):
                    row["sm90_vs_cudnn"] = round(row["flare-sm90"] / row["torch-cudnn"], 3)
                row["sm90_vs_sm80"] = round(row["flare-sm90"] / row["flare-sm80"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
                del q, k, v, dout
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=100)
    args = ap.parse_args()
    headdims = [int(x) for x in args.headdims.split(",")]
    import meta as run_meta
    report = {"meta": {**run_meta.provenance(__file__), **run_meta.device_meta(torch), **run_meta.flare_meta()}}
    set_path("sm90")
    t0 = time.time()
    report["correctness"] = correctness(headdims)
    report["correctness_failed"] = sum(not r["ok"] for r in report["correctness"])
    print(f"correctness: {len(report['correctness'])} cases, {report['correctness_failed']} failed "
          f"({time.time() - t0:.0f} s)", flush=True)
    if not any("illegal" in r.get("error", "") or "CUDA error" in r.get("error", "")
               for r in report["correctness"]):
        report["poison"] = poison(headdims)
        print("poison:", report["poison"], flush=True)
        if not args.no_timing:
            rows = timing(headdims, args.rep_ms)
            report["meta"]["ceilings"] = rows[0]["ceilings"]
            report["rows"] = rows[1:]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_meta.write_result(run_meta.default_result_path(Path(args.out), "gpu-sm90"), report)


if __name__ == "__main__":
    main()
