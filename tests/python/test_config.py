"""flare.__version__, flare.config() / show_config() / self_check() and `python -m flare`."""

import io
import os
import re
import subprocess
import sys

import flare
import flare.flash_attn_interface
from conftest import REPO


def test_versions_agree():
    cmake = re.search(r"project\(flare VERSION ([\d.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
    assert flare.__version__ == cmake == flare.version()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'input = "python/flare/__init__.py"' in pyproject


def test_build_config_of_the_library():
    built = flare.library().build_config()
    assert built["version"] == flare.version()
    assert built["cuda"] == ("1" if flare.has_cuda() else "0")
    assert flare.cpu_isa() in built["cpu_isas"].split(",")
    if built["cuda"] == "1":
        assert built["cuda_archs"] and built["cuda_headdims"] and built["cuda_passes"]
    else:
        assert built["cuda_archs"] == built["cuda_headdims"] == built["cuda_passes"] == ""


def test_config_and_show_config():
    info = flare.config()
    assert info["library_path"] == flare.library().path
    assert info["cpu_isa"] in info["cpu_isas_built"]
    assert info["cuda"] == flare.has_cuda()
    text = io.StringIO()
    flare.show_config(text)
    report = text.getvalue()
    assert info["library_path"] in report
    assert f"{info['cpu_isa']} kernels on this CPU" in report
    assert ("not built" in report) != info["cuda"]


def test_self_check_passes():
    text = io.StringIO()
    assert flare.self_check(text)
    assert "self-check cpu float32: ok, forward and backward" in text.getvalue()


def test_self_check_catches_a_wrong_result(monkeypatch):
    real = flare.flash_attn_interface.flash_attn_func
    monkeypatch.setattr(flare.flash_attn_interface, "flash_attn_func", lambda *a, **kw: real(*a, **kw) * 1.01)
    text = io.StringIO()
    assert not flare.self_check(text)
    assert "self-check cpu float32: FAILED: AssertionError: cpu torch.float32: max error" in text.getvalue()


def _run_module(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    return subprocess.run([sys.executable, "-m", "flare", *args], capture_output=True, text=True, env=env,
                          cwd=REPO / "tests", timeout=120)


def test_python_m_flare():
    run = _run_module()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "library" in run.stdout and "self-check cpu float32: ok" in run.stdout
    assert _run_module("--config").stdout.count("self-check") == 0
    bad = _run_module("--bogus")
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr
