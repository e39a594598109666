"""The small-shared-memory kernels (<= 99 KB per block: what sm_86 / sm_89 GPUs run, SmemClass in
src/cuda/common/params.hpp), run on a larger GPU by capping the shared memory flare may use with
FLARE_CUDA_SMEM_LIMIT: every head-dim tile, both dtypes, masks, softcap/ALiBi, GQA, varlen and the
deterministic backward, against the fp32 reference by the same rule as the main suite (cases.check_case).

On sm_90 the small backward kernels exist only in builds configured with -DFLARE_CUDA_ALL_CONFIGS=ON (the
GPU test builds); with another build these cases check the error that says so instead.
"""

import pytest
import torch

import flare
from cases import DEVICE, Case, check_case, heads_cycle, make_inputs, require_cuda_backend, run_flare

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA-only mechanism")

SMALL_SMEM = 99 * 1024
HEADDIMS = [32, 64, 96, 128, 160, 192, 224, 256, 40, 200]
SEQLENS = [(113, 203), (1023, 1024), (203, 17)]


@pytest.fixture(autouse=True)
def small_smem(monkeypatch):
    require_cuda_backend()
    monkeypatch.setenv("FLARE_CUDA_SMEM_LIMIT", str(SMALL_SMEM))
    monkeypatch.setenv("FLARE_CUDA_ARCH_PATH", "sm80")  # the small-memory kernels are sm80's


def _small_backward_available():
    """False when this build has no small backward kernels for this GPU (sm_90 without ALL_CONFIGS): then the
    backward must refuse with an error that names the build option."""
    major, _ = torch.cuda.get_device_capability()
    if major == 8:
        return True
    case = Case(batch=1, seqlen_q=16, seqlen_k=16, nheads=1, nheads_k=1, headdim=128)
    inputs = make_inputs(case)
    try:
        run_flare(case, inputs)
    except NotImplementedError as e:
        assert "FLARE_CUDA_ALL_CONFIGS" in str(e), f"the refusal should name the build option: {e}"
        return False
    return True


def _check(case):
    if _small_backward_available():
        check_case(case)
    else:
        pytest.skip("this build has no small backward kernels for sm_90 (configure with "
                    "-DFLARE_CUDA_ALL_CONFIGS=ON); the refusal was checked")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", HEADDIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_small_class_dense(dtype, seqlens, headdim, causal):
    sq, sk = seqlens
    nheads, nheads_k = heads_cycle(HEADDIMS.index(headdim) + SEQLENS.index(seqlens))
    _check(Case(dtype=dtype, batch=2, seqlen_q=sq, seqlen_k=sk, nheads=nheads, nheads_k=nheads_k,
                headdim=headdim, causal=causal))


FEATURES = {
    "window": dict(window=(64, 16)),
    "softcap-causal": dict(causal=True, softcap=30.0),
    "alibi-window": dict(window=(100, -1), alibi="batch"),
    "deterministic": dict(causal=True, deterministic=True),
    "headdim-v": dict(headdim_v=64),
}


@pytest.mark.parametrize("headdim", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("feature", list(FEATURES))
def test_small_class_features(feature, headdim):
    _check(Case(dtype=torch.bfloat16, batch=2, seqlen_q=300, seqlen_k=411, nheads=4, nheads_k=2,
                headdim=headdim, **FEATURES[feature]))


@pytest.mark.parametrize("headdim", [64, 128, 256], ids=lambda d: f"d{d}")
def test_small_class_varlen(headdim):
    _check(Case(dtype=torch.float16, seqlens_q=[3, 113, 0, 257, 64], seqlens_k=[17, 203, 5, 257, 1],
                nheads=6, nheads_k=2, headdim=headdim, causal=True))


def test_limit_below_every_kernel_is_a_clear_error(monkeypatch):
    """A GPU with less shared memory than even the small kernels need: UNSUPPORTED naming both sizes, and
    nothing written."""
    monkeypatch.setenv("FLARE_CUDA_SMEM_LIMIT", "20000")
    q = torch.randn(1, 64, 2, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"needs \d+ bytes of shared memory per block but this GPU "
                                                  r"allows 20000"):
        flare.flash_attn_func(q, q, q)


def test_malformed_limit_is_ignored(monkeypatch):
    """FLARE_CUDA_SMEM_LIMIT that is not a positive integer is ignored (the device's own limit applies)."""
    monkeypatch.setenv("FLARE_CUDA_SMEM_LIMIT", "lots")
    check_case(Case(batch=1, seqlen_q=77, seqlen_k=77, nheads=2, nheads_k=2, headdim=256, causal=True))
