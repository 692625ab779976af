"""docs/deploy.md cannot drift from the files it explains."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
# Plumbing, not security: the doc need not explain these.
NOT_SECURITY = {
    "Type", "ExecStart", "Environment", "RestartSec", "TimeoutStopSec", "Group",
    "StateDirectoryMode", "SystemCallArchitectures",
}  # fmt: skip


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_repository_path_in_the_doc_exists(doc: str) -> None:
    paths = set(re.findall(r"(?<![\w/.-])((?:deploy|grafana|docs|tests)/[\w./-]*\w)", doc))
    assert paths
    missing = sorted(p for p in paths if not (ROOT / p).exists() and "*" not in p)
    assert not missing, missing


@pytest.mark.parametrize("unit", UNITS, ids=[u.stem for u in UNITS])
def test_every_hardening_directive_of_the_units_is_explained(doc: str, unit: Path) -> None:
    service = unit.read_text(encoding="utf-8").split("[Service]", 1)[1].split("\n[", 1)[0]
    keys = set(re.findall(r"^([A-Z]\w+)=", service, flags=re.MULTILINE))
    assert "ProtectSystem" in keys
    unexplained = sorted(k for k in keys - NOT_SECURITY if k not in doc)
    assert not unexplained, f"{unit.name}: not in docs/deploy.md: {unexplained}"


def test_every_alert_is_in_the_doc(doc: str, all_rules: list[dict[str, Any]]) -> None:
    missing = [r["alert"] for r in all_rules if "alert" in r and f"`{r['alert']}`" not in doc]
    assert not missing, missing


def test_every_file_in_deploy_systemd_is_named_in_the_doc(doc: str) -> None:
    """An operator installs what the doc names: a file it never mentions (a drop-in that
    grants a capability, say) is either shipped for nothing or installed blind."""
    files = sorted(p.name for p in (ROOT / "deploy" / "systemd").iterdir() if p.is_file())
    assert files
    unnamed = [name for name in files if name not in doc]
    assert not unnamed, f"docs/deploy.md never names {unnamed}"


def _fenced(doc: str, language: str) -> list[str]:
    """The doc's ```language blocks, dedented (list items indent theirs)."""
    blocks = re.findall(
        rf"^([ \t]*)```{language}\n(.*?)^\1```", doc, flags=re.MULTILINE | re.DOTALL
    )
    return [
        "\n".join(line.removeprefix(indent) for line in body.splitlines()) + "\n"
        for indent, body in blocks
    ]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_the_doc_s_drop_ins_load_on_top_of_the_units(doc: str, tmp_path: Path) -> None:
    """Each ```ini drop-in the doc offers (its first line names where it goes) loads with
    its unit without a warning, as `systemctl daemon-reload` would take it."""
    drop_ins = [b for b in _fenced(doc, "ini") if b.startswith("# /etc/systemd/system/")]
    assert len(drop_ins) >= 2, drop_ins
    stub = tmp_path / "gpuwatch"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    for block in drop_ins:
        target = Path(block.splitlines()[0].removeprefix("# "))
        unit_name = target.parent.name.removesuffix(".d")
        unit = ROOT / "deploy" / "systemd" / unit_name
        assert unit.is_file(), f"drop-in for a unit that is not shipped: {target}"
        root = tmp_path / target.stem
        (root / target.parent.name).mkdir(parents=True)
        copy = root / unit_name
        copy.write_text(
            unit.read_text(encoding="utf-8").replace("/usr/local/bin/gpuwatch", str(stub))
        )
        (root / target.parent.name / target.name).write_text(block)
        result = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", "--generators=no", str(copy)],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
        )  # fmt: skip
        output = result.stdout + result.stderr
        assert result.returncode == 0 and output == "", f"{target}:\n{output}"


def test_the_doc_s_scrape_job_passes_promtool(doc: str, tmp_path: Path) -> None:
    """The plain-Prometheus scrape job for Kubernetes, as an operator would paste it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing (Debian package prometheus)")
    jobs = [b for b in _fenced(doc, "yaml") if b.lstrip().startswith("- job_name:")]
    assert jobs, "no scrape job in docs/deploy.md"
    for job in jobs:
        (parsed,) = yaml.safe_load(job)
        assert parsed["job_name"] in {"gpuwatch-agent", "gpuwatch-server"}, parsed["job_name"]
        result = _promtool_check(promtool, tmp_path, parsed)
        if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
            # Debian builds Prometheus without Kubernetes discovery: check the rest of the
            # job (its relabelling) with static targets in its place.
            del parsed["kubernetes_sd_configs"]
            parsed["static_configs"] = [{"targets": ["gpu-node-01:9402"]}]
            result = _promtool_check(promtool, tmp_path, parsed)
        assert result.returncode == 0, result.stdout + result.stderr


def _promtool_check(
    promtool: str, tmp_path: Path, job: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [job]}))
    return subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )


def test_no_deployment_file_renames_a_per_process_job_label(doc: str) -> None:
    """The agent exports the Slurm job as `slurm_job` (test_prometheus.py checks the code):
    relabelling `exported_job` is dead configuration, and the doc's reason for it is false."""
    files = [
        DOC,
        ROOT / "deploy" / "prometheus" / "prometheus.yml",
        *(ROOT / "deploy" / "kubernetes").glob("*.yaml"),
    ]
    for path in files:
        assert "exported_job" not in path.read_text(encoding="utf-8"), path.name


def test_culprit_annotations_name_pid_user_and_command(all_rules: list[dict[str, Any]]) -> None:
    """docs/deploy.md, "Naming the culprit": the processes an alert's annotation lists
    come each with pid, user and command."""
    listing = 0
    for rule in (r for r in all_rules if "alert" in r):
        for key, text in rule.get("annotations", {}).items():
            for var in re.findall(r"range\s+\$\w+\s*,\s*\$(\w+)\s*:=", text):
                listing += 1
                shown = set(re.findall(rf"\${var}\.Labels\.(\w+)", text))
                assert {"pid", "user", "name"} <= shown, f"{rule['alert']} {key}: only {shown}"
                assert f"`{rule['alert']}`" in DOC.read_text(encoding="utf-8")
    assert listing >= 3
