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
