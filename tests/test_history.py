"""Where the history lives (specgate.ciside.history, specgate.ciside.buildkite): a folder, or Buildkite's
REST API served by a real local server with the documented response shapes (tests/buildkiteserver.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from buildkiteserver import Build, BuildkiteServer, Job, pipeline_of
from histories import build, clean_history, job, write_history
from hubserver import closed_endpoint

from specgate.ciside import buildkite
from specgate.sessions.gate import session as gate

TOKEN = "bkua_0123456789abcdef0123456789abcdef01234567"
ORG, PIPELINE = "acme", "specgate"


@pytest.fixture(autouse=True)
def environment(tmp_path, monkeypatch) -> Path:
    """A clean Buildkite-less environment, the harness cache under tmp_path."""
    for var in ("BUILDKITE_BUILD_ID", "BUILDKITE_JOB_ID", "SPECGATE_RUN_ID", "SPECGATE_ATTEMPT",
                "SPECGATE_HISTORY", buildkite.TOKEN_VAR, buildkite.API_URL_VAR, buildkite.ORG_VAR,
                buildkite.PIPELINE_VAR, buildkite.BRANCH_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECGATE_ARTIFACTS", str(tmp_path / "artifacts"))
    return tmp_path


def use_api(monkeypatch, api: BuildkiteServer | str, token: str = TOKEN) -> None:
    monkeypatch.setenv(buildkite.API_URL_VAR, api if isinstance(api, str) else api.url)
    monkeypatch.setenv(buildkite.TOKEN_VAR, token)


def gate_record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "artifacts" / "gate" / "summary.json").read_text())


def verdicts(record: dict) -> list[tuple]:
    """What the gate concluded, without where the files were."""
    return [(s["step"], s["graduates"], s["blockers"], [(w["run"], w["clean"], w["mark"]) for w in s["window"]])
            for s in record["steps"]]


BK_ARGS = ["--org", ORG, "--pipeline", PIPELINE, "--branch", "main"]


@pytest.mark.parametrize("history", [
    pytest.param(clean_history(), id="graduates"),
    pytest.param(clean_history(builds=6)[:-2] + [job("cpu_e2e", 6, shards=2, shard=0, exit_code=75),
                                                  job("cpu_e2e", 6, shards=2, shard=1)], id="blocked-by-75"),
])
def test_the_gate_reaches_the_same_verdict_from_buildkite_as_from_a_folder(tmp_path, capsys, monkeypatch, history):
    folder = write_history(tmp_path / "folder", history)
    folder_code = gate.main(["--history", str(folder)])
    from_folder = verdicts(gate_record(tmp_path))
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(history), max_per_page=2) as api:
        use_api(monkeypatch, api)
        code = gate.main(BK_ARGS)
    out = capsys.readouterr().out
    assert code == folder_code and verdicts(gate_record(tmp_path)) == from_folder
    assert f"history: Buildkite {ORG}/{PIPELINE}, branch main, its last 20 finished builds" in out
    assert gate_record(tmp_path)["history"].startswith(f"Buildkite {ORG}/{PIPELINE}")
    # Paginated: builds two per page (Link rel="next"), artifacts three jobs x three files per build.
    assert len(api.seen(r"/builds$")) == -(-len(pipeline_of(history)) // 2)
    assert all(r.query["per_page"] == ["20"] and r.query["branch"] == ["main"] and r.query["state"] == ["finished"]
               for r in api.seen(r"/builds$"))
    assert len(api.seen(r"/storage/")) == len(history)   # only the summaries are downloaded


def test_only_the_latest_finished_builds_of_the_branch_are_read(tmp_path, capsys, monkeypatch):
    builds = pipeline_of(clean_history(builds=7))
    builds.append(Build(8, [Job("cpu_unit", {"artifacts/cpu_unit/summary.json": b"{}"})], state="running"))
    builds.append(Build(9, [Job("cpu_unit", {"artifacts/cpu_unit/summary.json": b"{}"})], branch="feature"))
    with BuildkiteServer(ORG, PIPELINE, TOKEN, builds, max_per_page=2) as api:
        use_api(monkeypatch, api)
        code = gate.main([*BK_ARGS, "--builds", "3", "--runs", "3"])
    assert code == 0, capsys.readouterr().out
    assert [w["run"] for w in gate_record(tmp_path)["steps"][0]["window"]] == ["build 7", "build 6", "build 5"]
    assert len(api.seen(r"/builds$")) == 2                      # 3 builds at 2 a page; no third page asked for
    assert {r.path.split("/")[-2] for r in api.seen(r"/artifacts$")} == {"7", "6", "5"}


def test_downloads_are_cached_by_build_and_job_and_never_carry_the_token(tmp_path, capsys, monkeypatch):
    history = clean_history()
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(history)) as api:
        use_api(monkeypatch, api)
        assert gate.main(BK_ARGS) == 0
        assert len(api.seen(r"/storage/")) == len(history)
        assert all(r.authorization is None for r in api.seen(r"/storage/"))   # S3 would refuse it
        assert all(r.authorization == f"Bearer {TOKEN}" for r in api.seen(r"^/v2/"))
        assert gate.main(BK_ARGS) == 0                          # the second read downloads nothing
        assert len(api.seen(r"/storage/")) == len(history)
    cached = sorted((tmp_path / "cache" / "buildkite").rglob("summary.json"))
    assert len(cached) == len(history)
    first = history[0]
    assert (tmp_path / "cache" / "buildkite" / first["run"]["build_id"] / first["run"]["job_id"] / "artifacts"
            / first["session"] / "summary.json") in cached
    assert TOKEN not in capsys.readouterr().out


@pytest.mark.parametrize("token,args,message", [
    ("wrong-token-value-0123456789", BK_ARGS,
     ("Buildkite API 401 on /v2/organizations/acme/pipelines/specgate/builds: the token was not accepted "
     "($BUILDKITE_API_TOKEN)")),
    ("forbidden", BK_ARGS,
     ("Buildkite API 403 on /v2/organizations/acme/pipelines/specgate/builds: the token may not read "
     "organisation acme's builds and artifacts (it needs the read_builds and read_artifacts scopes)")),
    (TOKEN, ["--org", ORG, "--pipeline", "no-such-pipeline", "--branch", "main"],
     ("Buildkite API 404 on /v2/organizations/acme/pipelines/no-such-pipeline/builds: not found: check the "
     "organisation and pipeline slugs (acme/no-such-pipeline) and that the token can see them")),
])
def test_refusals_are_one_line_and_exit_2_without_the_token(tmp_path, capfd, monkeypatch, token, args, message):
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(clean_history())) as api:
        use_api(monkeypatch, api, token)
        assert gate.main(args) == 2
    out = capfd.readouterr()
    assert [line for line in out.out.splitlines() if line.startswith("error: ")] == [f"error: {message}"]
    assert "Traceback" not in out.out + out.err
    written = (tmp_path / "artifacts" / "gate" / "summary.json").read_text()
    for shown in (out.out, out.err, written):
        assert token not in shown and TOKEN not in shown
    assert json.loads(written)["exit_code"] == 2


def test_an_unreachable_api_is_incomplete(tmp_path, capsys, monkeypatch):
    use_api(monkeypatch, closed_endpoint())
    assert gate.main(BK_ARGS) == 75
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: Buildkite API unreachable at http://127.0.0.1:")


def test_a_link_to_another_origin_never_gets_the_token(tmp_path, capsys, monkeypatch):
    """The API base is what $BUILDKITE_API_URL says; a next page elsewhere is refused."""
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(clean_history()), max_per_page=2) as api:
        use_api(monkeypatch, api.url.replace("127.0.0.1", "localhost"))
        assert gate.main(BK_ARGS) == 2
    assert "refusing to send the token to 127.0.0.1:" in capsys.readouterr().out
    assert api.requests and all(r.host.startswith("localhost:") for r in api.requests)


def test_the_environment_names_the_buildkite_history(tmp_path, capsys, monkeypatch):
    """On an agent: the slugs and branch come from Buildkite's job variables."""
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(clean_history())) as api:
        use_api(monkeypatch, api)
        for var, value in ((buildkite.ORG_VAR, ORG), (buildkite.PIPELINE_VAR, PIPELINE),
                           (buildkite.BRANCH_VAR, "main")):
            monkeypatch.setenv(var, value)
        assert gate.main([]) == 0, capsys.readouterr().out
    assert api.seen(r"/builds$")


@pytest.mark.parametrize("args,env,message", [
    (["--history", "{tmp}", *BK_ARGS], {buildkite.TOKEN_VAR: TOKEN},
     "--history and --org/--pipeline name two histories: pass one of them"),
    (BK_ARGS, {}, ("a Buildkite history needs $BUILDKITE_API_TOKEN and both the organisation (--org) and pipeline "
                  "(--pipeline) slugs")),
    (["--org", ORG, "--pipeline", PIPELINE], {buildkite.TOKEN_VAR: TOKEN},
     "a Buildkite history reads one branch: pass --branch or set $BUILDKITE_BRANCH"),
    ([], {"SPECGATE_HISTORY": "{tmp}/nowhere"}, "history folder {tmp}/nowhere does not exist"),
    (["--builds", "0"], {}, "argument --builds: must be at least 1"),
])
def test_history_options_that_cannot_work_are_bad_input(tmp_path, capsys, monkeypatch, args, env, message):
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    assert gate.main([a.format(tmp=tmp_path) for a in args]) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().out


def test_the_history_folder_can_come_from_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECGATE_HISTORY", str(write_history(tmp_path, clean_history())))
    assert gate.main([]) == 0, capsys.readouterr().out
    assert gate_record(tmp_path)["history"] == str(tmp_path / "history")


def test_summaries_are_picked_out_of_the_artifacts():
    assert buildkite.is_summary("artifacts/cpu_e2e/summary.json")
    assert buildkite.is_summary("artifacts/history/cpu_unit/summary.json")
    for other in ("artifacts/cpu_e2e/junit.xml", "summary.json", "logs/summary.json", "artifacts/../x/summary.json"):
        assert not buildkite.is_summary(other)


def test_a_retried_shard_job_from_buildkite_counts_once(tmp_path, capsys, monkeypatch):
    history = [s for s in clean_history() + build(6, steps=("cpu_unit",))
               if not (s["run"]["build_number"] == "6" and s["shard"]["shard_id"] == 0)]
    history += [job("cpu_unit", 6, shards=2, shard=0, exit_code=1, retry=0), job("cpu_unit", 6, shards=2, shard=0,
                                                                                retry=1)]
    with BuildkiteServer(ORG, PIPELINE, TOKEN, pipeline_of(history)) as api:
        use_api(monkeypatch, api)
        assert gate.main([*BK_ARGS, "--step", "cpu_unit"]) == 0, capsys.readouterr().out
    window = gate_record(tmp_path)["steps"][0]["window"]
    assert window[0]["run"] == "build 6" and len(window[0]["shards"]) == 2 and window[0]["clean"]
