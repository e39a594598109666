"""pytest setup of the GPU suite (tests/gpu): the device the tests run on, the library they load, seeds.

  --device cuda|cpu    (or --flare-device, or FLARE_TEST_DEVICE; default cuda). cpu runs the same tests against
                       the CPU backend at small sizes: a check of the harness itself on a machine without a GPU.
  --size full|small    (or --flare-size, or FLARE_TEST_SIZE; default full on cuda, small on cpu)
Library: FLARE_LIBRARY when set, else build/cuda/src/libflare.so when it exists (cuda), else the search of
python/flare/_capi.py. Seeds: fresh each session unless FLARE_TEST_SEED=<n> is set; the session seed is in the
report header and each test's seed (session seed + test id) in its output, so a failure can be replayed with
FLARE_TEST_SEED=<session seed>. With CUDA every test ends with a device synchronisation, so an asynchronous
fault is reported by the test that caused it rather than by the next one.
"""

import os
import random
import sys
import zlib
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "python"))  # the flare package of this tree, not an installed one
sys.path.insert(0, str(HERE))

SESSION_SEED = int(os.environ.get("FLARE_TEST_SEED") or random.SystemRandom().randrange(2 ** 31))


def _add(parser, names, **kwargs):
    try:
        parser.addoption(*names, **kwargs)
    except ValueError:  # another plugin owns the short name: keep the --flare-* one
        parser.addoption(names[-1], **kwargs)


def pytest_addoption(parser):
    _add(parser, ("--device", "--flare-device"), dest="flare_device", choices=["cuda", "cpu"], default=None,
         help="device the GPU suite runs on (default cuda; cpu checks the harness at small sizes)")
    _add(parser, ("--size", "--flare-size"), dest="flare_size", choices=["full", "small"], default=None,
         help="case lists: full (default on cuda) or small (default on cpu)")
    _add(parser, ("--arch-path", "--flare-arch-path"), dest="flare_arch_path", choices=["auto", "sm80", "sm90"],
         default=None, help="CUDA forward path the suite forces (FLARE_CUDA_ARCH_PATH; default auto): each case "
         "the sm90 path does not claim then checks that a forced sm90 call is refused")


def pytest_configure(config):
    device = getattr(config.option, "flare_device", None) or os.environ.get("FLARE_TEST_DEVICE") or "cuda"
    size = (getattr(config.option, "flare_size", None) or os.environ.get("FLARE_TEST_SIZE")
            or ("full" if device == "cuda" else "small"))
    os.environ["FLARE_TEST_DEVICE"] = device  # read by cases.py when the test modules are imported
    os.environ["FLARE_TEST_SIZE"] = size
    arch_path = getattr(config.option, "flare_arch_path", None) or os.environ.get("FLARE_CUDA_ARCH_PATH") or "auto"
    os.environ["FLARE_CUDA_ARCH_PATH"] = arch_path  # read by the library at every forward call, and by cases.py
    cuda_build = REPO / "build" / "cuda" / "src" / "libflare.so"
    if device == "cuda" and "FLARE_LIBRARY" not in os.environ and cuda_build.is_file():
        os.environ["FLARE_LIBRARY"] = str(cuda_build)
    # The fp32 reference must be fp32: no TF32 in its matmuls.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_report_header(config):
    device = os.environ.get("FLARE_TEST_DEVICE")
    lines = [f"flare GPU suite: device {device}, sizes {os.environ.get('FLARE_TEST_SIZE')}, "
             f"forward path {os.environ.get('FLARE_CUDA_ARCH_PATH')}, "
             f"session seed {SESSION_SEED} (FLARE_TEST_SEED={SESSION_SEED} replays it)",
             f"torch {torch.__version__}, library {os.environ.get('FLARE_LIBRARY', '(python/flare/_capi.py search)')}"]
    if device == "cuda" and torch.cuda.is_available():
        lines.append(f"CUDA device: {torch.cuda.get_device_name()} (capability "
                     f"{'.'.join(map(str, torch.cuda.get_device_capability()))}), CUDA {torch.version.cuda}")
    return lines


@pytest.fixture(autouse=True)
def _seed_and_sync(request, record_property):
    seed = (SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % (2 ** 31)
    torch.manual_seed(seed)
    record_property("seed", seed)
    print(f"seed {seed} (session seed {SESSION_SEED})")
    yield
    if os.environ.get("FLARE_TEST_DEVICE") == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()
