"""The charts (specgate.ciside.charts) as a reader gets them: real matplotlib SVG, opened with xml.etree,
its series found by the ids the charts give them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from histories import (
    EAGLE3,
    NGRAM,
    build,
    clean_history,
    e2e_job,
    entry,
    job,
    passing,
    write_history,
)

from specgate.ciside import history
from specgate.sessions.gate import session as gate

REPO = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"
# The history's eagle3 entry ran on fixtures: the series names the draft's fixture first.
EAGLE3_SERIES = "eagle3: eagle3-successor (stand-in for nm-testing/Llama3_2_1B_speculator.eagle3)"


@pytest.fixture(scope="module")
def charts():
    """specgate.ciside.charts, imported by the worker that runs these tests: matplotlib takes
    ~1 s to load, which every xdist worker would pay again collecting this file."""
    from specgate.ciside import charts

    return charts


def parse(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return root


def ids(root: ET.Element, prefix: str) -> list[str]:
    return [g.get("id") for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith(prefix)]


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")]


def test_acceptance_chart_without_history_has_the_bars_only(tmp_path, charts):
    record = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    root = parse(charts.write(tmp_path / "acceptance.svg", charts.acceptance_figure, record, []))
    assert ids(root, "bar:") == [f"bar:{EAGLE3_SERIES}:position {p}" for p in (1, 2, 3)]
    assert ids(root, "line:") == [] and ids(root, "floor:") == []
    assert EAGLE3_SERIES in texts(root)                            # the legend names the series
    assert "draft position" in texts(root) and "accepted / drafts" in texts(root)
    assert float(root.get("width").removesuffix("pt")) * 4 / 3 <= 1000   # fits a 1000-px annotation


def test_acceptance_chart_with_history_draws_lengths_and_floors(tmp_path, charts):
    folder = write_history(tmp_path, [e2e_job(n) for n in range(1, 6)])
    runs = history.read(history.Source(folder=folder))["cpu_e2e"]
    record = e2e_job(6, acceptance_len=1.55, rates=(0.35, 0.15, 0.05))
    root = parse(charts.write(tmp_path / "acceptance.svg", charts.acceptance_figure, record, runs))
    assert ids(root, "line:") == [f"line:{EAGLE3_SERIES}"] and ids(root, "floor:") == [f"floor:{EAGLE3_SERIES}"]
    assert len(ids(root, "bar:")) == 3
    labels = texts(root)
    assert [f"build {n}" for n in range(1, 6)] + ["this run"] == [t for t in labels if t.startswith("build")
                                                                    or t == "this run"]
    assert "Acceptance length over the last 5 run(s) and this one (floors dashed)" in labels
    # Six points on the line: five runs and this one.
    line = next(g for g in root.iter(f"{SVG}g") if g.get("id") == f"line:{EAGLE3_SERIES}")
    assert len([u for u in line.iter(f"{SVG}use")]) == 6


def test_series_are_one_per_speculative_engine(tmp_path, charts):
    record = e2e_job(6)
    record["tests"].append({**record["tests"][0], "nodeid": EAGLE3.replace("v1_matches_baseline", "known_answer"),
                            "threshold": 3.8})
    [series] = charts.series(record).values()     # two tests, one engine: one series, the first floor kept
    assert series.label == EAGLE3_SERIES and series.floor == 1.5 and series.rates == [0.5, 0.25, 0.0938]


def test_a_series_names_a_fixture_first_and_a_hub_checkpoint_as_before(charts):
    """A fixture that stood in: "<fixture> (stand-in for <hub id>)", never the bare hub id (it reads as
    real-checkpoint data); a hub checkpoint: the last part of its id; a fixture used directly: its name."""
    ngram = {**entry("t.py::test_ngram[ngram]", "passed"), "method": "ngram", "model_source": "fixture",
             "target": "Qwen/Qwen3-0.6B", "draft": None, "acceptance_len": 1.0, "threshold": None,
             "engines": ["tiny-qwen3@690c46d068 none", "tiny-qwen3@690c46d068 ngram k=3"]}
    hub = {**ngram, "nodeid": "t.py::test_ngram[hub]", "model_source": "hub",
           "engines": ["Qwen/Qwen3-0.6B@c1899de289 ngram k=3"]}
    direct = {**ngram, "nodeid": "t.py::test_known_answer[ngram]", "target": "context-qwen3",
              "engines": ["context-qwen3@84941542d7 ngram k=3"]}
    engines = [{"key": k, "method": "ngram", "counters": {}} for t in (ngram, hub, direct) for k in t["engines"][-1:]]
    record = {"tests": [ngram, hub, direct], "engines": engines}
    assert [s.label for s in charts.series(record).values()] == [
        "ngram: tiny-qwen3 (stand-in for Qwen/Qwen3-0.6B)", "ngram: Qwen3-0.6B", "ngram: context-qwen3"]


def test_a_run_that_drafted_nothing_says_so(tmp_path, charts):
    record = job("cpu_e2e", 6, tests=passing("cpu_e2e"), engines=[])
    root = parse(charts.write(tmp_path / "acceptance.svg", charts.acceptance_figure, record, []))
    assert ids(root, "bar:") == [] and "no speculative engine drafted in this run" in texts(root)


def test_the_gate_draws_the_window_it_judged(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    for var in ("SPECGATE_HISTORY", "BUILDKITE_API_TOKEN", "BUILDKITE_BUILD_ID", "BUILDKITE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    rerun = passing("cpu_unit")
    rerun[0] = entry(rerun[0]["nodeid"], earlier=[{"attempt": 1, "outcome": "failed"}])
    # A test only build 4 ran: were it one the others passed, their runs would be flaky too.
    failing = [*passing("cpu_unit"), entry(f"{NGRAM}::test_new", "failed", "failure", "AssertionError")]
    summaries = [s for s in clean_history() if s["session"] == "cpu_unit" and s["run"]["build_number"] == "1"]
    summaries += [job("cpu_unit", 2, exit_code=75), job("cpu_unit", 3, tests=rerun),
                  job("cpu_unit", 4, exit_code=1, tests=failing), *build(5, steps=("cpu_unit",))]
    assert gate.main(["--history", str(write_history(tmp_path, summaries)), "--step", "cpu_unit"]) == 1
    chart = tmp_path / "artifacts" / "gate" / "window.svg"
    assert f"chart: {chart}" in capsys.readouterr().out
    root = parse(chart)
    assert ids(root, "mark:") == ["mark:cpu_unit:build 1:clean", "mark:cpu_unit:build 2:75",
                                  "mark:cpu_unit:build 3:flaky", "mark:cpu_unit:build 4:failure",
                                  "mark:cpu_unit:build 5:clean"]
    assert "cpu_unit: keep soft_fail" in texts(root)
    assert {"clean", "failure", "75", "flaky"} <= set(texts(root))   # the legend


def test_the_annotation_shows_the_chart_above_the_table_and_the_drift_below(tmp_path, charts):
    """scripts/annotate.py as the pipeline runs it, on a cpu_e2e summary with and without its chart."""
    root = tmp_path / "artifacts"
    folder = root / "cpu_e2e"
    folder.mkdir(parents=True)
    record = e2e_job(6)
    record["drift"] = {"checked": True, "source": "folder history", "regressions": [], "incomparable": [],
                       "warnings": ["engine [k]: start (compile included) took 25.0 s, 2.5x the median 10.0 s"]}
    (folder / "summary.json").write_text(json.dumps(record))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDKITE_")}

    def annotate() -> str:
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "annotate.py"), "--artifacts", str(root),
                               "cpu_e2e"], capture_output=True, text=True, timeout=60, env=env, check=True)
        return proc.stdout

    assert "<img" not in annotate()
    charts.write(folder / "acceptance.svg", charts.acceptance_figure, record, [])
    out = annotate()
    image = '<img src="artifact://artifacts/cpu_e2e/acceptance.svg"'
    assert out.index("#### cpu_e2e: ") < out.index(image) < out.index("| test | method |")
    assert out.index("| test | method |") < out.index("Drift against folder history: 0 regression(s)\n- warning: "
                                                      "engine [k]: start (compile included) took 25.0 s")
    record["drift"] = {"checked": False, "why": "no history: pass --history DIR"}
    (folder / "summary.json").write_text(json.dumps(record))
    assert "Drift not checked: no history: pass --history DIR" in annotate()


def test_twenty_run_labels_on_the_window_axis_do_not_overlap(charts):
    """A gate window of 20 runs (the default history reads 20 builds): every run label stays
    readable, none drawn over its neighbour, and 'not judged' has a mark of its own."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    marks = [(f"build {1200 + i}", ["clean", "failure", "75", "flaky", "not judged"][i % 5]) for i in range(20)]
    figure = charts.window_figure([("cpu_unit", "keep soft_fail", marks)])
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer, axis = canvas.get_renderer(), figure.axes[0]
    labels = axis.get_xticklabels()
    assert [label.get_text() for label in labels] == [label for label, _ in marks]
    # Rotated labels are parallel strips: apart when the distance between neighbours across the
    # strips (the tick spacing times the sine of the angle) is at least a line of text.
    step = axis.transData.transform((1, 0))[0] - axis.transData.transform((0, 0))[0]
    angle = math.radians(labels[0].get_rotation())
    across = step * math.sin(angle) if angle else step
    needed = (renderer.points_to_pixels(labels[0].get_fontsize()) if angle else
              max(label.get_window_extent(renderer).width for label in labels))
    assert across >= needed, f"{across:.1f} px between labels, {needed:.1f} px needed"
