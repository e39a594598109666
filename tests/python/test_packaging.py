"""What a user sees of the package before any attention runs: licence and package metadata."""

import re

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def _pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_license_is_bsd_3_clause():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    for clause in ("Redistributions of source code", "Redistributions in binary form", "Neither the name"):
        assert clause in text


def test_package_metadata_names_the_license():
    project = _pyproject()["project"]
    assert project["license"] == {"text": "BSD-3-Clause"}
    assert "License :: OSI Approved :: BSD License" in project["classifiers"]


def test_third_party_licences_are_documented():
    text = (REPO / "docs" / "licenses.md").read_text()
    for component in ("CUTLASS", "cudart_static", "libgomp", "GoogleTest", "scikit-build-core"):
        assert component in text, f"docs/licenses.md does not name {component}"
    # The CUTLASS version the docs name is the one the build fetches.
    fetched = re.search(r"nvidia-cutlass==([\d.]+)", (REPO / "scripts" / "ensure-cutlass.sh").read_text()).group(1)
    assert f"nvidia-cutlass=={fetched}" in text
    cmake = re.search(r"set\(FLARE_CUTLASS_VERSION ([\d.]+)\)", (REPO / "cmake" / "FlareCuda.cmake").read_text())
    assert cmake and cmake.group(1) == fetched, "cmake/FlareCuda.cmake fetches another CUTLASS than ensure-cutlass.sh"


def _python_blocks(markdown, heading):
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_quick_start_runs():
    readme = (REPO / "README.md").read_text()
    assert "pip install flare` is an unrelated package" in readme and "`flare-attention`" in readme
    assert readme.index("## Quick start (Python)") < readme.index("## A small C example")
    first, hf = _python_blocks(readme, "## Quick start (Python)")
    scope = {}
    exec(compile(first, "README.md quick start", "exec"), scope)
    assert tuple(scope["out"].shape) == (2, 1000, 8, 64) and scope["out"].isfinite().all()
    compile(hf, "README.md transformers", "exec")  # loads a model from the hub: checked for syntax only
    assert 'attn_implementation="flare"' in hf


def test_readme_gpu_table_and_api_doc_are_current():
    readme = (REPO / "README.md").read_text()
    for capability in ("| 8.0 |", "| 8.6, 8.9 |", "| 9.0 |", "| below 8.0 |"):
        assert capability in readme
    assert "0 in this release" not in (REPO / "docs" / "api.md").read_text()
