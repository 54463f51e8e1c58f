"""`pip install -e .` keeps the torch a machine has (issue 24): a GPU user's CUDA build stays."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO_ROOT


def _pip_report(tmp_path: Path, extras: str = "") -> dict:
    """pip's resolution of the checkout's setup.py, installing nothing and reaching no index.

    setup.py and pyproject.toml are copied alone, so pip writes no egg-info into the shared checkout;
    the requirements are the same. No config file (PIP_CONFIG_FILE=devnull): the machine's find-links
    and constraints must not decide the answer.
    """
    project = tmp_path / "project"
    project.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(REPO_ROOT / name, project / name)
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet",
         "--report", str(report), "-e", f"{project}{extras}"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    # --no-index: a requirement the installed packages don't satisfy fails here instead of downloading.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(report.read_text())


def test_pip_install_keeps_installed_torch(tmp_path):
    """The installed torch (CI: the 2.13.0 CPU wheel, standing in for a user's CUDA 2.11) satisfies the
    project: pip would install the project alone, no torch and nothing else."""
    report = _pip_report(tmp_path, "[test]")
    names = sorted(item["metadata"]["name"].lower() for item in report["install"])
    assert names == ["libai-lite"] or names == ["libai_lite"], names
    requires = report["install"][0]["metadata"]["requires_dist"]
    torch_req = next(Requirement(r) for r in requires if Requirement(r).name == "torch")
    assert torch_req.specifier.contains(Version(torch.__version__), prereleases=True)


def _torch_requirement() -> Requirement:
    """setup.py's torch requirement, as pip's resolution reads it."""
    text = (REPO_ROOT / "setup.py").read_text()
    lines = [line.strip().strip('",') for line in text.splitlines() if line.strip().startswith('"torch')]
    assert len(lines) == 1, lines
    return Requirement(lines[0])


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.11.0a0+gitabc123", "2.12.1+cu128",
                                     "2.13.0", "2.13.0+cpu", "2.13.0+cu130"])
def test_torch_range_admits_tested_releases(version):
    """Every torch the project was run on (2.11+cu130 on the H100, 2.13 in CI) and the releases between,
    NVIDIA containers' pre-release builds included, are kept."""
    assert _torch_requirement().specifier.contains(Version(version), prereleases=True)


@pytest.mark.parametrize("version", ["2.10.0", "2.13.1", "2.14.0", "2.14.1"])
def test_torch_range_stops_at_newest_tested(version):
    """Nothing newer than the tested 2.13.0: on a fresh CPU machine pip then takes the local
    2.13.0+cpu wheel, never a later CUDA release of several GB from PyPI."""
    assert not _torch_requirement().specifier.contains(Version(version), prereleases=True)


def test_fresh_cpu_machine_prefers_cpu_wheel():
    """Among the builds of 2.13.0 a fresh machine of ours sees (PyPI's CUDA 2.13.0, the local 2.13.0+cpu),
    the one pip ranks highest is the CPU wheel (PEP 440: a local label sorts above the bare release)."""
    spec = _torch_requirement().specifier
    candidates = [Version(v) for v in ("2.13.0", "2.13.0+cpu", "2.12.1", "2.14.1", "2.15.0")]
    assert max(v for v in candidates if spec.contains(v)) == Version("2.13.0+cpu")


@pytest.mark.parametrize("version,ok", [("2.13.0+cpu", True), ("2.11.0+cu130", True), ("2.11.0a0+gitabc", True),
                                        ("2.14.1", True), ("2.10.1", False), ("2.9.1+cu128", False), ("1.13.1", False)])
def test_import_refuses_a_torch_older_than_tested(version, ok):
    """A checkout on PYTHONPATH skips pip's check: the package says in one line which torch it needs."""
    import libai_lite

    if ok:
        libai_lite._check_torch(version)
    else:
        with pytest.raises(ImportError, match=r"^libai_lite needs torch 2.11 or newer .* this is torch " + re.escape(version)):
            libai_lite._check_torch(version)
