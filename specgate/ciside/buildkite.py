"""Past summaries from Buildkite, through its REST API (https://buildkite.com/docs/apis/rest-api).

    GET /v2/organizations/{org}/pipelines/{pipeline}/builds?branch=..&state=finished&per_page=..
        the branch's finished builds, newest first, one page after another (Link: rel="next")
        until enough builds are read;
    GET /v2/organizations/{org}/pipelines/{pipeline}/builds/{number}/artifacts?per_page=100
        every job's artifacts of a build; those at artifacts/**/summary.json are kept;
    GET <the artifact's download_url>
        302 to the file (a URL valid for about a minute), followed without the token.

Unfinished builds are left out: their summaries are still arriving, and a half-uploaded run
would read as one with missing shards. Each downloaded summary is cached by build and job id
under the harness cache (specgate.core.paths.cache_root()/buildkite): an uploaded artifact never
changes, so a later read downloads only the new builds' summaries.

The token goes only in the Authorization header, only to the API's own origin (a link or
download URL pointing elsewhere is refused; the redirect to the file drops it), and never
into a message. 401, 403 and 404 are bad input (exit 2); an API that cannot be reached or
answers with another error leaves the history incomplete (exit 75).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from specgate.contract import artifacts, exitcodes
from specgate.core import paths

TOKEN_VAR = "BUILDKITE_API_TOKEN"
API_URL_VAR = "BUILDKITE_API_URL"          # another API base, e.g. a test server
ORG_VAR, PIPELINE_VAR, BRANCH_VAR = "BUILDKITE_ORGANIZATION_SLUG", "BUILDKITE_PIPELINE_SLUG", "BUILDKITE_BRANCH"
DEFAULT_API_URL = "https://api.buildkite.com"
MAX_PER_PAGE = 100                         # the API's maximum
TIMEOUT_S = 30
NEXT_LINK = re.compile(r'<([^>]+)>\s*;\s*rel="next"')
ID = re.compile(r"[\w.-]+")


class APIError(Exception):
    """Buildkite could not give the history: one line, and the exit code that earns."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Pipeline:
    org: str
    slug: str
    branch: str
    token: str = field(repr=False)

    def describe(self) -> str:
        return f"{self.org}/{self.slug}, branch {self.branch}"


def is_summary(path: str) -> bool:
    """An artifact at artifacts/**/summary.json (and nowhere outside the cache folder)."""
    parts = PurePosixPath(path).parts
    return len(parts) >= 2 and parts[0] == "artifacts" and parts[-1] == "summary.json" and ".." not in parts


def _folder_name(value: Any) -> str:
    """A build or job id as one folder of the cache."""
    text = str(value)
    if not ID.fullmatch(text) or text in (".", ".."):
        raise APIError(f"Buildkite API: {text!r} is not an id", exitcodes.INCOMPLETE)
    return text


def _origin(url: str) -> tuple[str, str]:
    split = urlsplit(url)
    return split.scheme, split.netloc


class Client:
    def __init__(self, pipeline: Pipeline, base_url: str) -> None:
        self.pipeline = pipeline
        self.base = base_url.rstrip("/")
        self.origin = _origin(self.base)

    def get(self, url: str) -> tuple[bytes, Mapping[str, str]]:
        what = urlsplit(url).path   # never the query: a link may carry a key in it
        if _origin(url) != self.origin:
            raise APIError(f"Buildkite API: refusing to send the token to {_origin(url)[1]} (from {what}); "
                           f"the API is {self.base} (${API_URL_VAR})", exitcodes.BAD_INPUT)
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        # Unredirected: the 302 of an artifact download leads to storage that must not see the token.
        request.add_unredirected_header("Authorization", f"Bearer {self.pipeline.token}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return response.read(), response.headers
        except urllib.error.HTTPError as exc:
            raise self._refused(exc.code, what) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise APIError(f"Buildkite API unreachable at {self.base} ({what}): {reason}",
                           exitcodes.INCOMPLETE) from None

    def _refused(self, status: int, what: str) -> APIError:
        p = self.pipeline
        why = {401: f"the token was not accepted (${TOKEN_VAR})",
               403: f"the token may not read organisation {p.org}'s builds and artifacts "
                    "(it needs the read_builds and read_artifacts scopes)",
               404: f"not found: check the organisation and pipeline slugs ({p.org}/{p.slug}) "
                    "and that the token can see them"}.get(status)
        if why:
            return APIError(f"Buildkite API {status} on {what}: {why}", exitcodes.BAD_INPUT)
        return APIError(f"Buildkite API {status} on {what}: the history is incomplete", exitcodes.INCOMPLETE)

    def pages(self, url: str) -> Iterator[dict[str, Any]]:
        """The items of a paginated list, fetching each page only when it is reached."""
        while url:
            body, headers = self.get(url)
            try:
                items = json.loads(body)
            except ValueError:
                items = None
            if not isinstance(items, list):
                raise APIError(f"Buildkite API: {urlsplit(url).path} did not answer with a JSON list",
                               exitcodes.INCOMPLETE)
            yield from items
            found = NEXT_LINK.search(headers.get("Link") or "")
            url = found.group(1) if found else ""

    def download(self, artifact: dict[str, Any], dest: Path) -> Path:
        """The artifact's file, downloaded once into dest."""
        if dest.is_file():
            return dest
        body, _ = self.get(artifact["download_url"])
        try:
            text = body.decode("utf-8")
            json.loads(text)
        except ValueError:
            raise APIError(f"Buildkite API: artifact {artifact['path']} of job {artifact['job_id']} is not JSON",
                           exitcodes.INCOMPLETE) from None
        artifacts.write_atomic(dest, text)
        return dest


def summaries(pipeline: Pipeline, builds: int, environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The cached summary.json files of the branch's `builds` most recent finished builds."""
    client = Client(pipeline, environ.get(API_URL_VAR) or DEFAULT_API_URL)
    base = f"{client.base}/v2/organizations/{quote(pipeline.org)}/pipelines/{quote(pipeline.slug)}/builds"
    query = urlencode({"branch": pipeline.branch, "state": "finished", "per_page": min(builds, MAX_PER_PAGE)})
    cache = paths.cache_root() / "buildkite"
    found = []
    for build in itertools.islice(client.pages(f"{base}?{query}"), builds):
        for artifact in client.pages(f"{base}/{build['number']}/artifacts?per_page={MAX_PER_PAGE}"):
            if artifact.get("state") == "finished" and is_summary(artifact["path"]):
                folder = cache / _folder_name(build["id"]) / _folder_name(artifact["job_id"])
                found.append(client.download(artifact, folder / artifact["path"]))
    return found
