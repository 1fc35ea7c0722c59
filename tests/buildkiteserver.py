"""A real HTTP server on 127.0.0.1 that answers like Buildkite's REST API v2 for what
specgate.ciside.buildkite reads (https://buildkite.com/docs/apis/rest-api):

- GET /v2/organizations/{org}/pipelines/{pipeline}/builds?branch=&state=&per_page=&page=
      builds newest first, each with its jobs; state=finished means passed, failed,
      blocked or canceled; paginated by the Link header (rel="next", rel="last");
- GET .../builds/{number}/artifacts?per_page=&page=   every job's artifacts, paginated;
- GET .../builds/{number}/jobs/{job}/artifacts/{id}/download
      302 to /storage/{id}, the URL also in the JSON body;
- GET /storage/{id}   the file; like S3 with a signed URL, it refuses a request that
      carries an Authorization header (400).

Without `Authorization: Bearer <token>` the API answers 401; with the `forbidden` token,
403; an unknown organisation, pipeline or build, 404. per_page is capped at `max_per_page`
(the real API's is 100), so small tests still page. `requests` records every request.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlencode, urlsplit

from localserver import LocalServer

FINISHED = ("passed", "failed", "blocked", "canceled")
BUILDS = re.compile(r"^/v2/organizations/([^/]+)/pipelines/([^/]+)/builds(?:/(\d+)(/.*)?)?$")
DOWNLOAD = re.compile(r"^/jobs/([^/]+)/artifacts/([^/]+)/download$")


@dataclass
class Job:
    step_key: str
    files: dict[str, bytes]                      # artifact path -> content
    id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class Build:
    number: int
    jobs: list[Job]
    branch: str = "main"
    state: str = "passed"
    id: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None
    host: str | None


class BuildkiteServer(LocalServer):
    """Start with `with BuildkiteServer("acme", "specgate", token, builds) as api:`."""

    def __init__(self, org: str, pipeline: str, token: str, builds: list[Build], max_per_page: int = 100) -> None:
        self.org, self.pipeline, self.token = org, pipeline, token
        self.builds = sorted(builds, key=lambda b: b.number, reverse=True)   # newest first, as the API lists
        self.max_per_page = max_per_page
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.artifacts: dict[str, tuple[Job, str]] = {}                        # artifact id -> (job, path)
        for build in builds:
            for job in build.jobs:
                for path in job.files:
                    self.artifacts[str(uuid.uuid4())] = (job, path)
        super().__init__(_handler(self))

    @property
    def url(self) -> str:
        return self.origin

    def seen(self, pattern: str) -> list[Request]:
        """The requests so far whose path matches the regular expression."""
        with self.lock:
            return [r for r in self.requests if re.search(pattern, r.path)]

    # ------------------------------------------------------------------ the documented shapes

    def build_json(self, build: Build) -> dict:
        base = f"{self.url}/v2/organizations/{self.org}/pipelines/{self.pipeline}/builds/{build.number}"
        return {
            "id": build.id, "graphql_id": f"QnVpbGQtLS0{build.number}", "url": base,
            "web_url": f"https://buildkite.com/{self.org}/{self.pipeline}/builds/{build.number}",
            "number": build.number, "state": build.state, "blocked": False, "message": f"build {build.number}",
            "commit": "0" * 40, "branch": build.branch, "env": {}, "source": "webhook",
            "creator": {"id": "3d3c3bf0-7d58-4afe-8fe7-b3017d5504de", "name": "CI"},
            "jobs": [{"id": job.id, "type": "script", "name": job.step_key, "step_key": job.step_key,
                      "state": "passed", "web_url": f"https://buildkite.com/{self.org}/{self.pipeline}/builds/"
                                                    f"{build.number}#{job.id}",
                      "artifact_url": f"{base}/jobs/{job.id}/artifacts", "exit_status": 0,
                      "retried": False, "parallel_group_index": None} for job in build.jobs],
            "created_at": "2026-11-01T06:00:00.000Z", "scheduled_at": "2026-11-01T06:00:00.000Z",
            "started_at": "2026-11-01T06:00:01.000Z", "finished_at": "2026-11-01T07:00:00.000Z",
            "meta_data": {}, "pull_request": None, "pipeline": {"slug": self.pipeline},
        }

    def artifact_json(self, build: Build, artifact_id: str) -> dict:
        job, path = self.artifacts[artifact_id]
        url = (f"{self.url}/v2/organizations/{self.org}/pipelines/{self.pipeline}/builds/{build.number}"
               f"/jobs/{job.id}/artifacts/{artifact_id}")
        dirname, _, filename = path.rpartition("/")
        return {"id": artifact_id, "job_id": job.id, "url": url, "download_url": f"{url}/download",
                "state": "finished", "path": path, "dirname": dirname, "filename": filename,
                "mime_type": "application/json", "file_size": len(job.files[path]), "glob_path": None,
                "original_path": None, "sha1sum": "0" * 40}


def _handler(api: BuildkiteServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            split = urlsplit(self.path)
            query = parse_qs(split.query)
            with api.lock:
                api.requests.append(Request("GET", split.path, query, self.headers.get("Authorization"),
                                            self.headers.get("Host")))
            if split.path.startswith("/storage/"):
                return self._storage(split.path.rsplit("/", 1)[-1])
            auth = self.headers.get("Authorization")
            if auth not in (f"Bearer {api.token}", "Bearer forbidden"):
                return self._json(401, {"message": "Authentication required. Please supply a valid API Access "
                                                   "Token: https://buildkite.com/docs/apis/rest-api#authentication"})
            if auth == "Bearer forbidden":
                return self._json(403, {"message": "Your access token doesn't have the read_builds scope"})
            found = BUILDS.match(split.path)
            if not found or found.group(1) != api.org or found.group(2) != api.pipeline:
                return self._json(404, {"message": "No pipeline found"})
            number, rest = found.group(3), found.group(4) or ""
            if number is None:
                return self._builds(query, split.path)
            build = next((b for b in api.builds if b.number == int(number)), None)
            if build is None:
                return self._json(404, {"message": "No build found"})
            if rest == "/artifacts":
                ids = [i for i, (job, _) in api.artifacts.items() if job in build.jobs]
                return self._page(query, split.path, [api.artifact_json(build, i) for i in ids])
            download = DOWNLOAD.match(rest)
            if download and download.group(2) in api.artifacts:
                location = f"{api.url}/storage/{download.group(2)}?X-Amz-Signature=abc"
                return self._json(302, {"url": location}, {"Location": location})
            return self._json(404, {"message": "Not Found"})

        def _builds(self, query: dict[str, list[str]], path: str) -> None:
            branch, state = query.get("branch", [None])[0], query.get("state", [None])[0]
            states = FINISHED if state == "finished" else (state,) if state else None
            chosen = [b for b in api.builds if (branch is None or b.branch == branch)
                      and (states is None or b.state in states)]
            self._page(query, path, [api.build_json(b) for b in chosen])

        def _page(self, query: dict[str, list[str]], path: str, items: list[dict]) -> None:
            per_page = min(int(query.get("per_page", ["30"])[0]), api.max_per_page)
            page = int(query.get("page", ["1"])[0])
            last = max(1, -(-len(items) // per_page))
            links = []
            keep = {k: v[0] for k, v in query.items() if k not in ("page",)}
            if page < last:
                links.append(f'<{api.url}{path}?{urlencode({**keep, "page": page + 1})}>; rel="next"')
            links.append(f'<{api.url}{path}?{urlencode({**keep, "page": last})}>; rel="last"')
            self._json(200, items[(page - 1) * per_page:page * per_page], {"Link": ", ".join(links)})

        def _storage(self, artifact_id: str) -> None:
            if self.headers.get("Authorization"):
                return self._send(400, b"<Error><Code>InvalidArgument</Code><Message>Only one auth mechanism "
                                       b"allowed</Message></Error>", "application/xml")
            if artifact_id not in api.artifacts:
                return self._send(404, b"", "application/xml")
            job, path = api.artifacts[artifact_id]
            self._send(200, job.files[path], "application/octet-stream")

        def _json(self, status: int, body, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(body).encode(), "application/json; charset=utf-8", headers)

        def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in {"Content-Type": kind, **(headers or {})}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def pipeline_of(summaries: list[dict], other_files: bool = True) -> list[Build]:
    """Builds holding the summaries as each job uploads them (artifacts/<session>/summary.json),
    one job per summary, grouped by the summary's build number; beside each summary the job's
    other artifacts, so the client has to pick the summaries out."""
    builds: dict[int, Build] = {}
    for data in summaries:
        number = int(data["run"]["build_number"])
        build = builds.setdefault(number, Build(number, [], id=data["run"]["build_id"]))
        files = {f"artifacts/{data['session']}/summary.json": json.dumps(data).encode()}
        if other_files:
            files[f"artifacts/{data['session']}/junit.xml"] = b"<testsuites/>"
            files[f"artifacts/{data['session']}/pytest.log"] = b"log"
        build.jobs.append(Job(data["session"], files, id=data["run"]["job_id"]))
    return list(builds.values())
