#!/usr/bin/env python3
"""A few representative forward + backward calls of flare on CUDA, small enough to run under
compute-sanitizer (10-100x slower than a plain run), each checked against the fp32 reference:

  compute-sanitizer --tool memcheck  --error-exitcode 97 python3 tests/gpu/sanitize.py
  compute-sanitizer --tool racecheck --error-exitcode 97 python3 tests/gpu/sanitize.py

Shapes: causal, GQA/MQA, windows + softcap + ALiBi, varlen with an empty sequence and seqused_k, head dims
64/128/256 (and 40, not a tile size), wide heads 320 / 512 / 576, fp16 and bf16, the deterministic backward, and the small-shared-memory
kernels of sm_86 / sm_89 (forced with FLARE_CUDA_SMEM_LIMIT; on sm_90 they need a FLARE_CUDA_ALL_CONFIGS build). Lengths are odd so that
every partial tile is touched. The KV-cache pass ("kv-" cases, test_cuda_kvcache.py's check): paged caches of
odd page sizes with appends across pages, rotary, splits, leftpad, empty and full sequences; few-row forwards
and paged varlen forwards, which run on the KV-cache kernels. torch's caching allocator is switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1,
set here before torch starts) so that each tensor is its own allocation and memcheck sees an overrun past
it rather than into a neighbour in the same pooled block.

  --device cpu     runs the same calls against the CPU backend (a check of this script without a GPU)
  --list           prints the cases and exits
Exit status: 0 when every case ran and matched, 1 otherwise.
"""

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

HERE = Path(__file__).resolve().parent
SMALL_SMEM = 99 * 1024  # the shared memory per block of sm_86 / sm_89: "small-" cases run as there
REPO = HERE.parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--list", action="store_true")
    p.add_argument("--only", help="run only the cases whose name contains this")
    return p.parse_args()


def main():
    args = parse_args()
    os.environ["FLARE_TEST_DEVICE"] = args.device
    os.environ["FLARE_TEST_SIZE"] = "small"
    cuda_build = REPO / "build" / "cuda" / "src" / "libflare.so"
    if args.device == "cuda" and "FLARE_LIBRARY" not in os.environ and cuda_build.is_file():
        os.environ["FLARE_LIBRARY"] = str(cuda_build)
    sys.path.insert(0, str(REPO / "python"))
    sys.path.insert(0, str(HERE))

    import torch
    from cases import Case, check_case, require_cuda_backend

    torch.backends.cuda.matmul.allow_tf32 = False
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = {
        "causal-hd128-bf16": Case(dtype=bf16, batch=2, seqlen_q=257, seqlen_k=257, nheads=4, nheads_k=4,
                                  headdim=128, causal=True),
        "gqa-hd64-fp16-cross": Case(dtype=fp16, batch=2, seqlen_q=113, seqlen_k=203, nheads=8, nheads_k=2,
                                    headdim=64),
        "mqa-hd256-bf16-sq>sk-causal": Case(dtype=bf16, batch=1, seqlen_q=190, seqlen_k=77, nheads=4, nheads_k=1,
                                            headdim=256, causal=True),
        "window-softcap-alibi-hd128-bf16": Case(dtype=bf16, batch=2, seqlen_q=150, seqlen_k=150, nheads=4,
                                                nheads_k=2, headdim=128, window=(32, 16), softcap=20.0,
                                                alibi="batch"),
        "hd40-fp16-causal": Case(dtype=fp16, batch=1, seqlen_q=99, seqlen_k=130, nheads=2, nheads_k=2, headdim=40,
                                 causal=True),
        "hd192-v128-bf16": Case(dtype=bf16, batch=1, seqlen_q=70, seqlen_k=140, nheads=2, nheads_k=1, headdim=192,
                                headdim_v=128),
        "varlen-seqused-hd128-bf16": Case(dtype=bf16, seqlens_q=[0, 37, 129, 1], seqlens_k=[5, 60, 129, 300],
                                          seqused_k=[5, 44, 129, 0], nheads=4, nheads_k=2, headdim=128,
                                          causal=True),
        "varlen-hd256-fp16": Case(dtype=fp16, seqlens_q=[65, 3, 200], seqlens_k=[65, 0, 111], nheads=2, nheads_k=2,
                                  headdim=256),
        "deterministic-hd64-bf16": Case(dtype=bf16, batch=2, seqlen_q=300, seqlen_k=300, nheads=4, nheads_k=1,
                                        headdim=64, causal=True, deterministic=True),
        # Past backward_short's seqlen_q (512) head dim 64's backward computes dQ in column slices (configs.cuh).
        "hd64-fp16-long-sliced-dq": Case(dtype=fp16, batch=1, seqlen_q=1100, seqlen_k=1037, nheads=2, nheads_k=1,
                                         headdim=64, causal=True),
        # Few query rows: on auto the KV-cache kernels run them (packed GQA rows, split keys); a paged varlen
        # forward always runs there (forward only), every unwritten page slot NaN.
        "few-rows-gqa-hd128-bf16-causal-sinks": Case(dtype=bf16, batch=3, seqlen_q=3, seqlen_k=517, nheads=8,
                                                     nheads_k=2, headdim=128, causal=True, sinks=True),
        "paged3-varlen-seqused-hd64-fp16": Case(dtype=fp16, seqlens_q=[1, 5, 0, 9], seqlens_k=[40, 300, 7, 64],
                                                seqused_k=[10, 300, 7, 0], nheads=8, nheads_k=2, headdim=64,
                                                causal=True, page=3),
        "paged16-varlen-hd256-bf16-alibi": Case(dtype=bf16, seqlens_q=[17, 1, 64], seqlens_k=[40, 900, 64],
                                                nheads=4, nheads_k=1, headdim=256, alibi="batch", page=16),
        # Split-KV in the sm80 forward, forced (FLARE_CUDA_ARCH_PATH=sm80, FLARE_CUDA_FWD_SPLITS=3), with the
        # combine kernel merging into out and lse.
        "split3-varlen-causal-gqa-hd128-bf16": Case(dtype=bf16, seqlens_q=[1, 64, 0, 129],
                                                    seqlens_k=[300, 64, 5, 700], nheads=4, nheads_k=2, headdim=128,
                                                    causal=True, sinks=True),
        # Wide heads: outputs and gradients in column slices, one CTA each; a split one with the combine.
        "wide-576-v512-mqa-causal-bf16": Case(dtype=bf16, batch=2, seqlen_q=130, seqlen_k=203, nheads=4, nheads_k=1,
                                              headdim=576, headdim_v=512, causal=True),
        "wide-320-fp16-window-softcap": Case(dtype=fp16, batch=1, seqlen_q=99, seqlen_k=150, nheads=2, nheads_k=2,
                                             headdim=320, window=(40, 8), softcap=20.0),
        "split3-wide-hd512-varlen-bf16": Case(dtype=bf16, seqlens_q=[1, 64, 0, 129], seqlens_k=[300, 64, 5, 700],
                                              nheads=2, nheads_k=1, headdim=512, causal=True),
        # The small-shared-memory kernels (sm_86 / sm_89), forced by FLARE_CUDA_SMEM_LIMIT (see SMALL_SMEM).
        "small-causal-hd128-bf16": Case(dtype=bf16, batch=2, seqlen_q=257, seqlen_k=190, nheads=4, nheads_k=2,
                                        headdim=128, causal=True),
        "small-hd256-fp16-softcap": Case(dtype=fp16, batch=1, seqlen_q=99, seqlen_k=130, nheads=2, nheads_k=1,
                                         headdim=256, softcap=20.0),
        "small-window-hd64-bf16": Case(dtype=bf16, batch=2, seqlen_q=150, seqlen_k=203, nheads=2, nheads_k=2,
                                       headdim=64, window=(32, 16)),
    }
    from test_cuda_kvcache import KvCase, check_kv_case
    cases.update({
        "kv-paged3-append-rotary-splits-bf16": KvCase(batch=3, seqlen_q=2, nheads=8, nheads_k=2, headdim=128,
                                                      capacity=77, page=3, seqlen_new=5, rotary="halves",
                                                      rotary_dim=64, causal=True, num_splits=3),
        "kv-dense-leftpad-gqa-fp16": KvCase(dtype=fp16, batch=4, seqlen_q=1, nheads=32, nheads_k=8, headdim=128,
                                            capacity=300, seqlen_new=1, leftpad=True, causal=True),
        "kv-paged16-mqa-hd256-window-sinks": KvCase(batch=2, seqlen_q=7, nheads=4, nheads_k=1, headdim=256,
                                                    capacity=150, page=16, seqlen_new=2, window=(40, 0),
                                                    sinks=True, num_splits=2),
        "kv-page1-hd64-softcap-alibi-spec": KvCase(batch=3, seqlen_q=7, nheads=8, nheads_k=2, headdim=64,
                                                   capacity=60, page=1, seqlen_new=3, softcap=10.0, alibi=True,
                                                   causal=True, rotary="interleaved"),
        "kv-hd40-v72-batch-idx": KvCase(batch=3, seqlen_q=3, nheads=6, nheads_k=3, headdim=40, headdim_v=72,
                                        capacity=90, batch_idx=True, seqlen_new=2, causal=True, num_splits=7),
    })
    if args.only:
        cases = {n: c for n, c in cases.items() if args.only in n}
    if args.list:
        for name, case in cases.items():
            print(f"{name:36s} {case.describe()}")
        return 0

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("sanitize.py: no CUDA device", file=sys.stderr)
            return 1
        print(f"device {torch.cuda.get_device_name()}, caching allocator "
              f"{'off' if os.environ.get('PYTORCH_NO_CUDA_MEMORY_CACHING') == '1' else 'on'}", flush=True)
    require_cuda_backend()
    torch.manual_seed(int(os.environ.get("FLARE_TEST_SEED", "1234")))
    failed, not_built = [], []
    outer_env = {var: os.environ.get(var) for var in ("FLARE_CUDA_ARCH_PATH", "FLARE_CUDA_FWD_SPLITS")}
    for name, case in cases.items():
        start = time.perf_counter()
        if name.startswith("small-"):
            os.environ["FLARE_CUDA_SMEM_LIMIT"] = str(SMALL_SMEM)
        else:
            os.environ.pop("FLARE_CUDA_SMEM_LIMIT", None)
        for var, value in (("FLARE_CUDA_ARCH_PATH", "sm80"), ("FLARE_CUDA_FWD_SPLITS", "3")):
            if name.startswith("split3-"):
                os.environ[var] = value
            elif outer_env[var] is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = outer_env[var]
        try:
            if isinstance(case, KvCase):
                check_kv_case(case)
            else:
                check_case(case, backward=case.page is None)  # a paged varlen forward has no backward
            if args.device == "cuda":
                torch.cuda.synchronize()
            status = "ok"
        except NotImplementedError as e:
            # The small-shared-memory backward kernels are built for sm_8x only unless FLARE_CUDA_ALL_CONFIGS=ON:
            # on a larger GPU the library refuses them with a message naming that option, which is the answer.
            if not (name.startswith("small-") and "FLARE_CUDA_ALL_CONFIGS" in str(e)):
                failed.append(name)
                status = "FAILED\n" + traceback.format_exc()
            else:
                not_built.append(name)
                status = "not built for this GPU (FLARE_CUDA_ALL_CONFIGS=OFF); refused as documented"
        except Exception:  # report and go on: one run of the sanitizer should show every case
            failed.append(name)
            status = "FAILED\n" + traceback.format_exc()
        print(f"{name:36s} {time.perf_counter() - start:7.2f} s  {status}", flush=True)
    ran = len(cases) - len(not_built)
    print(f"\n{ran - len(failed)} of {ran} cases ok"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; not built for this GPU: {', '.join(not_built)}" if not_built else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
