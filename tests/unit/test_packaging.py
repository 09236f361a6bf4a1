"""``pip install -e .`` builds without a deprecation warning (the README's first command).

The package is installed (editable, no dependencies) into a throwaway virtual environment, from
a copy of the project's files, with pip's ``-v`` so that the build backend's own warnings are
shown (pip hides them otherwise). Negative control: the same project with the license written
as a TOML table (what ``pyproject.toml`` had) makes setuptools warn, and the check sees it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What setuptools and pip print for deprecated usage (SetuptoolsDeprecationWarning, "DEPRECATION:").
DEPRECATED = re.compile(r"deprecat", re.IGNORECASE)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pkg-venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300)
    return root / "bin" / "python"


def _project_copy(dest: Path, license_line: str = None) -> Path:
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "sglang_prr", dest / "sglang_prr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if license_line is not None:
        p = dest / "pyproject.toml"
        text, n = re.subn(r"(?m)^license = .*$", license_line, p.read_text())
        assert n == 1, "pyproject.toml has no license line"
        p.write_text(text)
    return dest


def _install(python: Path, project: Path) -> str:
    p = subprocess.run([str(python), "-m", "pip", "install", "-v", "--no-deps",
                        "--disable-pip-version-check", "-e", str(project)],
                       capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    if p.returncode != 0 and "setuptools" in out and "satisfies the requirement" in out:
        pytest.skip("the package index is unreachable: the build backend cannot be fetched")
    assert p.returncode == 0, out[-3000:]
    return out


def _deprecations(out: str):
    return [line.strip() for line in out.splitlines() if DEPRECATED.search(line)]


def test_editable_install_prints_no_deprecation(venv, tmp_path):
    out = _install(venv, _project_copy(tmp_path / "project"))
    assert "Successfully installed sglang-prr" in out, out[-3000:]
    assert not _deprecations(out), _deprecations(out)


def test_a_deprecated_license_table_is_caught(venv, tmp_path):
    """Negative control: the check above does see setuptools' deprecation warnings."""
    out = _install(venv, _project_copy(tmp_path / "old",
                                       license_line='license = { text = "Apache-2.0" }'))
    found = _deprecations(out)
    assert any("project.license" in line for line in found), out[-3000:]
