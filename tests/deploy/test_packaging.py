"""Packaging as a release and the container image would do it.

The sdist and wheel are built (PEP 517, `python -m build`) from a copy of exactly what
the image's build context allows (deploy/docker/Dockerfile.dockerignore), so a file the
image needs but the context leaves out fails here, not in a registry. The wheel is then
installed into a fresh virtualenv, and the command and its package data are used from
there, away from this checkout.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IGNORE = ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
DISTRIBUTION = "gpuwatch_oom"
# Package data the running product reads: migrations, bundled scenarios, the fake's
# injection shim, the dashboard's assets.
NEEDED = (
    "gpuwatch/server/migrations/env.py",
    "gpuwatch/server/migrations/script.py.mako",
    "gpuwatch/nvml/fake/scenarios/workstation.toml",
    "gpuwatch/nvml/fake/inject/sitecustomize.py",
    "gpuwatch/py.typed",
)


def _docker_context(into: Path) -> Path:
    """Copy the files the image's allow-list lets into the build context."""
    rules = [
        line.strip()
        for line in IGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def allowed(relative: str) -> bool:
        keep = True
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            hit = fnmatch.fnmatch(relative, pattern) or relative.startswith(pattern + "/")
            if pattern.startswith("**/"):
                hit = hit or fnmatch.fnmatch(Path(relative).name, pattern[3:])
            if hit:
                keep = negate
        return keep

    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for relative in tracked:
        if allowed(relative) and (ROOT / relative).is_file():
            target = into / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, target)
    return into


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    context = _docker_context(tmp_path_factory.mktemp("context"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_sdist_and_wheel_carry_the_package_data(dist: Path) -> None:
    (wheel,) = dist.glob(f"{DISTRIBUTION}-*.whl")
    (sdist,) = dist.glob(f"{DISTRIBUTION}-*.tar.gz")
    wheel_names = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as archive:
        sdist_names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in NEEDED:
        assert needed in wheel_names, needed
        assert needed in sdist_names, needed
    migrations = [n for n in wheel_names if n.startswith("gpuwatch/server/migrations/versions/")]
    assert len(migrations) >= 5
    assert not any(name.startswith("tests/") for name in wheel_names)


def test_the_wheel_installs_into_a_fresh_venv_and_runs(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob(f"{DISTRIBUTION}-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = venv / "bin" / "pip"
    subprocess.run(
        [str(pip), "install", "-q", "--disable-pip-version-check", str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    version = subprocess.run(
        [str(venv / "bin" / "gpuwatch"), "--version"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not this checkout: the installed package must stand alone
        timeout=60,
    )
    assert version.stdout.startswith("gpuwatch ")
    # Package data is found from the installed copy: a bundled scenario loads, and the
    # migrations reach head on a fresh SQLite file.
    probe = (
        "from gpuwatch.nvml.fake import load_scenario\n"
        "load_scenario('workstation')\n"
        "from gpuwatch.server.database import create_database\n"
        "from gpuwatch.server.database.migrate import upgrade, current_revision, head_revision\n"
        "db = create_database('sqlite:///probe.db')\n"
        "upgrade(db)\n"
        "assert current_revision(db) == head_revision()\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
