"""An agent's disk over many PRs: five different vLLM builds (the pinned wheel repacked five
ways) gated one after another by vLLM's pipeline on one agent whose manifest budgets the caches
for two builds. warm_cache's prune at each job's start keeps the disk under the budget, and a
build whose venv and compile cache were pruned builds ago is gated again and passes.

The disk use is measured independently of the harness (every file's size under the harness
cache's entry roots and the build venvs, walked after each build), so a venv that grows after
its install, or an entry the listing misses, shows up as an overrun."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import wheels
from pragent import PRAgent, with_fixtures

pytestmark = pytest.mark.soak    # about 12 min on 2 cores: nox -s ci_soak, outside the per-commit check

BUILDS = 5
GIB = 1 << 30


def apparent_size(root: Path) -> int:
    return sum(os.lstat(Path(top, name)).st_size for top, _, names in os.walk(root) for name in names)


def disk_use(cache: Path, envdir: Path) -> dict[str, int]:
    """Bytes per entry: the harness cache's fixtures, upstream trees and compile caches, and
    nox's build venvs (vllm-*), leases and stamps included."""
    found = {}
    for kind in ("fixtures", "upstream", "compile"):
        for entry in sorted((cache / kind).iterdir()) if (cache / kind).is_dir() else ():
            found[f"{kind}/{entry.name}"] = apparent_size(entry) if entry.is_dir() else entry.lstat().st_size
    for venv in sorted(envdir.glob("vllm-*")):
        found[f"venvs/{venv.name}"] = apparent_size(venv) if venv.is_dir() else venv.lstat().st_size
    return found


def set_budget(manifest: Path, gib: float) -> None:
    text = manifest.read_text()
    assert len(re.findall(r"^budget_gib = .*$", text, flags=re.M)) == 1, "test drifted from manifest.toml's [cache]"
    manifest.write_text(re.sub(r"^budget_gib = [0-9.]+", f"budget_gib = {gib:.3f}", text, flags=re.M))


def test_five_builds_one_after_another_stay_under_a_budget_for_two_and_a_pruned_build_still_passes(tmp_path):
    pinned = wheels.download(wheels.PINNED, tmp_path / "pinned")
    builds = [wheels.repack(pinned, tmp_path / "built" / str(n), note=f"PR {n}") for n in range(1, BUILDS + 1)]
    xdg = with_fixtures(tmp_path / "xdg")
    pr = PRAgent(tmp_path / "pr", xdg)
    cache, envdir = xdg / "specgate", pr.checkout / ".nox"

    first_venv = envdir / f"vllm-{pr.gate(builds[0])['cpu_e2e']['vllm']['id']}"
    first = disk_use(cache, envdir)
    per_build = sum(size for name, size in first.items() if name.startswith(("venvs/", "compile/")))
    shared = sum(first.values()) - per_build
    budget = shared + 2.5 * per_build      # two builds fit, a third does not
    set_budget(pr.checkout / "manifest.toml", budget / GIB)

    uses, removed = [sum(first.values())], []
    for wheel in [*builds[1:], builds[0]]:   # the sixth run: build 1 again, its venv pruned at the third
        assert wheel is not builds[0] or not first_venv.exists()
        removed.append(pr.gate(wheel)["warm_cache"]["pruned"]["removed"])
        uses.append(sum(disk_use(cache, envdir).values()))
    venvs = sorted(p.name for p in envdir.glob("vllm-*") if p.is_dir())
    report = (f"budget {budget / GIB:.2f} GiB (a build {per_build / GIB:.2f}, shared {shared / GIB:.2f}); "
              f"use after each build {[round(u / GIB, 2) for u in uses]} GiB; removed {removed}; venvs {venvs}")
    print(report)
    assert max(uses) <= budget, report
    assert len(venvs) <= 2 and first_venv.name in venvs, report
    assert all(any("/vllm-" in path for path in paths) for paths in removed[1:]), report   # from the third on
