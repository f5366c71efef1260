"""The /debug/requests page, server side: content negotiation, its headers, /debug/ui and its
files, and that the page loads nothing from elsewhere. The page itself runs in Chromium in
tests/test_debug_page.py."""

from __future__ import annotations

import time
import tomllib
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path, PurePosixPath

import aiohttp
import pytest

from sidecar.observability.debug import SERVER_TIME_HEADER
from sidecar.observability.debug_page import ASSETS, DOCUMENT, PAGE_HEADERS, prefers_html
from tests.conftest import StartSidecar, completion

BROWSER = (
    "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,image/apng,"
    "*/*;q=0.8,application/signed-exchange;v=b3;q=0.7"
)  # what Chromium sends for a page
STATIC = resources.files("sidecar").joinpath("static")


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("application/json", False),
        ("application/*", False),
        ("application/json, text/html", False),  # a tie keeps the JSON
        ("text/html;q=0.5, application/json", False),
        ("text/html;q=0.9, */*", False),
        ("text/html;q=nonsense", False),
        ("text/plain", False),
        (BROWSER, True),
        ("text/html", True),
        ("TEXT/HTML", True),
        ("text/*", True),
        ("text/html;level=1", True),
        ("text/html, application/json;q=0.9", True),
        ("application/json;q=0, */*", True),
        ("*/*;q=0.1, text/html", True),
    ],
)
def test_prefers_html(accept: str | None, html: bool) -> None:
    assert prefers_html(accept) is html


async def _get(http, url: str, accept: str | None) -> aiohttp.ClientResponse:
    # aiohttp adds "Accept: */*" unless told not to: None sends no Accept header at all.
    if accept is None:
        return await http.get(url, skip_auto_headers=["Accept"])
    return await http.get(url, headers={"Accept": accept})


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
async def test_scripts_and_curl_keep_the_json(http, sidecar, accept: str | None) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers={"x-request-id": "j1"}
    ) as response:
        await response.read()
    before = time.time()
    async with await _get(http, sidecar.url + "/debug/requests?limit=5", accept) as response:
        assert response.status == 200
        assert response.content_type == "application/json"
        body = await response.json()
        assert response.headers["Vary"] == "Accept"
        assert before - 1 <= float(response.headers[SERVER_TIME_HEADER]) <= time.time() + 1
    assert set(body) == {"inflight", "recent", "held", "limit", "max_limit"}
    assert [record["id"] for record in body["recent"]] == ["j1"]


async def test_the_json_counts_what_it_holds(http, start_sidecar_with: StartSidecar) -> None:
    """``held`` is what the sidecar holds, beyond the limit and the state filter (bounded by the
    history); ``limit`` is the one applied, ``max_limit`` the history size it is clamped to."""
    sidecar = await start_sidecar_with(debug_history=4)
    for index in range(6):
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(),
            headers={"x-request-id": f"c{index}"},
        ) as response:
            await response.read()
    async with http.post(sidecar.url + "/v1/completions", data=b"{") as response:
        assert response.status == 400
    url = sidecar.url + "/debug/requests"
    async with http.get(url, params={"limit": "2"}) as response:
        body = await response.json()
    assert [record["id"] for record in body["recent"]] == [body["recent"][0]["id"], "c5"]
    assert (body["held"], body["limit"], body["max_limit"]) == ({"inflight": 0, "recent": 4}, 2, 4)
    async with http.get(url, params={"state": "failed", "limit": "999999999"}) as response:
        body = await response.json()
    assert [record["state"] for record in body["recent"]] == ["failed"]
    assert (body["held"], body["limit"], body["max_limit"]) == ({"inflight": 0, "recent": 4}, 4, 4)
    async with http.get(url) as response:
        assert (await response.json())["limit"] == 4  # the default, 100, clamped too


async def test_a_browser_gets_the_page(http, sidecar) -> None:
    async with await _get(http, sidecar.url + "/debug/requests", BROWSER) as response:
        assert response.status == 200
        assert response.content_type == "text/html"
        assert response.charset == "utf-8"
        assert response.headers["Vary"] == "Accept"
        assert SERVER_TIME_HEADER not in response.headers
        _assert_page_headers(response)
        assert await response.read() == STATIC.joinpath(DOCUMENT).read_bytes()


async def test_the_page_reads_the_same_query(http, sidecar) -> None:
    """``state`` and ``limit`` are the page's first filter and fetch size; a typo is still a
    400, on /debug/ui too, so a link never silently shows more than it says."""
    for path in ("/debug/requests", "/debug/ui"):
        async with await _get(http, sidecar.url + path + "?state=failed&limit=5", BROWSER) as ok:
            assert (ok.status, ok.content_type) == (200, "text/html"), path
        for query in ("limt=5", "state=done", "limit=0", "limit=1&limit=2"):
            async with await _get(http, f"{sidecar.url}{path}?{query}", BROWSER) as response:
                assert response.status == 400, (path, query)
                assert (await response.json())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("accept", [None, "*/*", "application/json", BROWSER])
async def test_debug_ui_is_always_the_page(http, sidecar, accept: str | None) -> None:
    async with await _get(http, sidecar.url + "/debug/ui", accept) as response:
        assert (response.status, response.content_type) == (200, "text/html")
        _assert_page_headers(response)


@pytest.mark.parametrize(("name", "media_type"), sorted(ASSETS.items()))
async def test_the_page_files(http, sidecar, name: str, media_type: str) -> None:
    async with http.get(sidecar.url + "/debug/ui/" + name) as response:
        assert response.status == 200
        assert response.content_type == media_type
        _assert_page_headers(response)
        assert await response.read() == STATIC.joinpath(name).read_bytes()


@pytest.mark.parametrize(
    ("name", "status", "error"),
    [
        ("debug.html", 404, "NotFoundError"),
        ("nothing.js", 404, "NotFoundError"),
        # An encoded slash is refused before routing (sidecar/paths.py).
        ("..%2Fdebug.py", 400, "BadRequestError"),
        ("%2e%2e", 404, "NotFoundError"),
    ],
)
async def test_no_other_file_is_served(http, sidecar, name: str, status: int, error: str) -> None:
    async with http.get(sidecar.url + "/debug/ui/" + name) as response:
        assert response.status == status
        assert (await response.json())["error"]["type"] == error


async def test_a_record_stays_json_for_a_browser(http, sidecar) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers={"x-request-id": "b1"}
    ) as response:
        await response.read()
    async with await _get(http, sidecar.url + "/debug/requests/b1", BROWSER) as response:
        assert (response.status, response.content_type) == (200, "application/json")
        assert (await response.json())["id"] == "b1"


async def test_the_page_on_the_admin_port(http, start_sidecar_with: StartSidecar) -> None:
    sidecar = await start_sidecar_with(admin_port=0)
    for path in ("/debug/ui", "/debug/ui/debug.js", "/debug/requests"):
        async with await _get(http, sidecar.url + path, BROWSER) as response:
            assert response.status == 404, path
        async with await _get(http, sidecar.admin_url + path, BROWSER) as response:
            assert response.status == 200, path


def _assert_page_headers(response: aiohttp.ClientResponse) -> None:
    for name, value in PAGE_HEADERS.items():
        assert response.headers[name] == value, name
    policy = PAGE_HEADERS["Content-Security-Policy"]
    assert "default-src 'none'" in policy
    assert "script-src 'self'" in policy
    assert "unsafe" not in policy  # no inline script or style, no eval
    assert "require-trusted-types-for 'script'" in policy


class _Document(HTMLParser):
    """Every URL an HTML document loads, and anything inline that the policy would refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for name, value in attrs:
            if name.startswith("on") or name == "style":
                self.inline.append(f"<{tag} {name}>")
            if name in ("src", "srcset", "poster", "data") and value:
                self.loads.append(value)
        if tag == "link" and named.get("href"):
            self.loads.append(named["href"] or "")
        if tag == "style":
            self.inline.append("<style>")
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append("<script> with a body")


def test_the_page_is_self_contained() -> None:
    """Air-gapped clusters: the document loads exactly its two files, by relative URL (so the
    admin port and a path prefix work), and nothing inline; they load nothing further."""
    document = _Document()
    document.feed(STATIC.joinpath(DOCUMENT).read_text())
    assert document.inline == []
    assert sorted(document.loads) == sorted(f"ui/{name}" for name in ASSETS)
    script = STATIC.joinpath("debug.js").read_text()
    style = STATIC.joinpath("debug.css").read_text()
    for text in (script, style):
        assert "://" not in text
    assert "@import" not in style
    assert "url(" not in style
    # Records are written as text; Trusted Types in the policy back this up in the browser.
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in code, sink


def test_every_page_file_is_package_data() -> None:
    """The wheel carries what ``sidecar/static`` holds (the image is built from the wheel)."""
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["sidecar"]
    files = sorted(path.name for path in (root / "sidecar" / "static").iterdir())
    assert files == sorted([DOCUMENT, *ASSETS])
    for name in files:
        assert any(PurePosixPath("static", name).match(pattern) for pattern in patterns), name


@pytest.mark.parametrize("limit", ["²", "①", "٣", "1" * 5000, "0" * 10 + "1", "-1", "+1", " 1"])
async def test_a_limit_is_a_few_ascii_digits(http, sidecar, limit: str) -> None:
    """``str.isdigit`` holds for "²", "①" and Arabic-Indic digits, which ``int`` then refuses
    (or, for thousands of digits, refuses after a while): each was a 500 with a traceback."""
    async with http.get(sidecar.url + "/debug/requests", params={"limit": limit}) as response:
        assert response.status == 400, await response.text()
        error = (await response.json())["error"]
        assert (error["type"], error["code"]) == ("BadRequestError", 400)
        assert "limit" in error["message"]
    async with http.get(sidecar.url + "/debug/requests", params={"limit": "999999999"}) as ok:
        assert ok.status == 200  # nine digits: clamped to the history


@pytest.mark.parametrize("query", ["", "?state=failed&limit=5"])
async def test_debug_leads_to_the_page(http, start_sidecar_with: StartSidecar, query: str) -> None:
    """``/debug`` itself (not a 404): a redirect to the page, its query kept; on the API port
    of a sidecar with an admin port, the pointer there, as for every ``/debug/...``."""
    sidecar = await start_sidecar_with(admin_port=0)
    async with http.get(sidecar.admin_url + "/debug" + query, allow_redirects=False) as response:
        assert response.status == 302
        assert response.headers["Location"] == "debug/ui" + query  # relative: under any prefix
    async with http.get(sidecar.admin_url + "/debug" + query) as response:
        assert (response.status, response.content_type) == (200, "text/html")
    async with http.get(sidecar.url + "/debug") as response:
        assert response.status == 404
        assert "admin port" in (await response.json())["error"]["message"]
