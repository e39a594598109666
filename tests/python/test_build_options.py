"""FLARE_CUDA=ON|OFF|AUTO (cmake/FlareCuda.cmake): which backend a build gets, and the reason it records.

Each case is a CMake configure of this tree in a temporary directory (no compile); the decision is read
back from the header that becomes flare_build_config(). Where nvcc 13+ and the CUTLASS headers are present,
the CUDA case configures a real CUDA build (FLARE_ARCHS=native: this machine's GPUs, or the release list)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake here")
CUTLASS = REPO / "build/deps/cutlass/cutlass_library/source/include"


def _configure(tmp_path, *defines, env=None):
    args = ["cmake", "-S", str(REPO), "-B", str(tmp_path / "b"), "-DFLARE_BUILD_TESTS=OFF",
            "-DFLARE_BUILD_TOOLS=OFF", *(f"-D{d}" for d in defines)]
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    header = tmp_path / "b/src/generated/flare_build_config.h"
    config = {}
    if header.exists():
        text = re.search(r'#define FLARE_BUILD_CONFIG "(.*)"', header.read_text())[1]
        config = dict(line.split("=", 1) for line in text.split("\\n") if line)
    return run, config


def _fake_nvcc(tmp_path, release):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_off(tmp_path):
    run, config = _configure(tmp_path, "FLARE_CUDA=OFF")
    assert run.returncode == 0, run.stderr
    assert "flare: CUDA backend OFF, CPU backend only (FLARE_CUDA=OFF)" in run.stdout
    assert config["cuda"] == "0" and config["cuda_reason"] == "FLARE_CUDA=OFF"


def test_auto_without_nvcc_builds_the_cpu_backend(tmp_path):
    run, config = _configure(tmp_path, "FLARE_CUDA=auto", f"CMAKE_CUDA_COMPILER={tmp_path}/missing/nvcc")
    assert run.returncode == 0, run.stderr
    assert config["cuda"] == "0"
    assert config["cuda_reason"].startswith("FLARE_CUDA=AUTO and no nvcc found")
    assert "CUDA backend OFF" in run.stdout


def test_auto_with_an_old_nvcc_builds_the_cpu_backend(tmp_path):
    nvcc = _fake_nvcc(tmp_path, "12.4")
    run, config = _configure(tmp_path, "FLARE_CUDA=AUTO", f"CMAKE_CUDA_COMPILER={nvcc}")
    assert run.returncode == 0, run.stderr
    assert config["cuda"] == "0"
    assert config["cuda_reason"] == f"FLARE_CUDA=AUTO and nvcc 12.4 at {nvcc} is older than CUDA 13.0"


def test_on_without_nvcc_is_an_error(tmp_path):
    run, _ = _configure(tmp_path, "FLARE_CUDA=ON", f"CMAKE_CUDA_COMPILER={tmp_path}/missing/nvcc")
    assert run.returncode != 0
    assert "FLARE_CUDA=ON but no nvcc found" in run.stderr and "FLARE_CUDA=OFF" in run.stderr


def test_bad_value_is_an_error(tmp_path):
    run, _ = _configure(tmp_path, "FLARE_CUDA=maybe")
    assert run.returncode != 0 and "FLARE_CUDA is 'maybe': it must be ON, OFF or AUTO" in run.stderr


def test_enable_cuda_off_still_means_off(tmp_path):
    run, config = _configure(tmp_path, "FLARE_ENABLE_CUDA=OFF")
    assert run.returncode == 0, run.stderr
    assert config["cuda"] == "0" and config["cuda_reason"] == "FLARE_ENABLE_CUDA=OFF (FLARE_CUDA unset)"


def test_enable_cuda_on_without_nvcc_is_an_error(tmp_path):
    run, _ = _configure(tmp_path, "FLARE_ENABLE_CUDA=ON", f"CMAKE_CUDA_COMPILER={tmp_path}/missing/nvcc")
    assert run.returncode != 0 and "FLARE_ENABLE_CUDA=ON (FLARE_CUDA unset) but no nvcc found" in run.stderr


def _real_nvcc():
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        return None
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release (\d+)\.", text)
    return nvcc if release and int(release[1]) >= 13 else None


@pytest.mark.skipif(_real_nvcc() is None or not (CUTLASS / "cute/tensor.hpp").exists(),
                    reason="needs nvcc 13+ and the CUTLASS headers (scripts/ensure-cutlass.sh)")
def test_auto_with_nvcc_configures_cuda_for_native_archs(tmp_path):
    run, config = _configure(tmp_path, "FLARE_CUDA=AUTO", "FLARE_ARCHS=native", f"FLARE_CUTLASS_DIR={CUTLASS}",
                             f"CMAKE_CUDA_COMPILER={_real_nvcc()}")
    assert run.returncode == 0, run.stderr
    assert config["cuda"] == "1" and config["cuda_reason"].startswith("FLARE_CUDA=AUTO, nvcc 13.")
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0 if shutil.which("nvidia-smi") else False
    if not gpus:
        assert config["cuda_archs"] == "80,90" and config["cuda_sm90"] == "1"
        assert "no sm_80+ GPU here: the release list" in config["cuda_reason"]
    else:
        assert config["cuda_archs"] and "this machine's GPUs" in config["cuda_reason"]
