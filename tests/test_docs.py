"""The docs stay true: every relative link in README.md and docs/ resolves, every setting is documented
and docs/configuration.md is what `python -m configs.docgen` prints, and docs/api.md names exactly the
app's routes. Fast: no model is loaded (the app is built, not started)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote

import pytest
from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from configs import docgen
from configs.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])

FENCED_BLOCK = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
# [text](target "title") and ![alt](target); the text may hold one level of brackets
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HTML_LINK = re.compile(r"<(?:a|img)\s[^>]*?(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")
IGNORED_METHODS = {"HEAD", "OPTIONS"}


def prose(text: str) -> str:
    """The page without code blocks, code spans and comments: a link in code is an example, not a link."""
    return INLINE_CODE.sub("", FENCED_BLOCK.sub("", HTML_COMMENT.sub("", text)))


def links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    return [m.group(1) for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK) for m in pattern.finditer(text)]


def github_anchors(page: Path) -> set[str]:
    """The ids a repository page gives its headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2..."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(FENCED_BLOCK.sub("", page.read_text(encoding="utf-8"))):
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
        text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(page):
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # an absolute URL (https:, mailto:): not checked offline
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(root)}: ({target})"
        if not resolved.is_relative_to(root):
            problems.append(f"{where}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where}: no such file {resolved.relative_to(root)}")
        elif anchor and resolved.suffix == ".md" and unquote(anchor).lower() not in github_anchors(resolved):
            problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.relative_to(root)}")
    return problems


def test_pages_exist():
    for name in ("README.md", "docs/README.md", "docs/getting-started.md", "docs/api.md", "docs/configuration.md",
                 "docs/ingestion.md", "docs/chat-page.md", "docs/deployment.md", "docs/testing.md",
                 "docs/design/engine.md", "docs/design/kv-store.md", "docs/design/server.md",
                 "docs/benchmarks/README.md", "docs/decisions/README.md"):
        assert (ROOT / name).is_file(), name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(page):
    assert broken_links(page) == []


def test_link_checker_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A title\n\n## Second `part`, here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-title) [ok](there.md#second-part-here) [web](https://example.com)\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n"
        "[gone](missing.md) ![gone](img/missing.png) [bad anchor](there.md#nope)\n[ref]: also-missing.md\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert all(any(name in p for p in problems) for name in ("missing.md", "missing.png", "#nope", "also-missing"))


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_readme_figures_come_from_the_benchmark_page():
    """The README's table quotes a benchmark page: every figure in it is on that page."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (DOCS / "benchmarks" / "attention-scale.md").read_text(encoding="utf-8")
    table = readme[readme.index("| prefill | TTFT |"):].split("\n\n", 1)[0]
    figures = {f for row in table.splitlines()[2:] for f in re.findall(r"\d+(?: \d{3})*(?:\.\d+)?x?", row)}
    assert figures and sorted(f for f in figures if f not in page) == []


def _sections(config: type) -> list[type]:
    found = [config]
    for field in docgen.fields_of(config).values():
        if docgen.is_section(field):
            found += _sections(field.annotation)
    return found


def test_every_setting_has_a_description():
    undocumented = [
        f"{config.__name__}.{name}"
        for config in _sections(Settings)
        for name, field in docgen.fields_of(config).items()
        if not docgen.is_section(field) and not (field.description or "").strip()
    ]
    assert undocumented == [], f"settings without description= (docs/configuration.md is generated from them): {undocumented}"


def test_configuration_page_is_generated_from_the_settings():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert page == docgen.render(), f"docs/configuration.md is stale: run `{docgen.REGENERATE}`"


def test_configuration_page_lists_every_setting():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for dotted, env, _, _ in docgen.rows(Settings, ""):
        assert f"`{dotted}`" in page
    for name, field in Settings.model_fields.items():
        if docgen.is_section(field):
            for dotted, env, _, _ in docgen.rows(field.annotation, name + "."):
                assert f"| `{dotted}` |" in page and f"`{env}`" in page, dotted


@pydantic_dataclass(frozen=True)
class _Section:
    documented: Annotated[int, Field(description="Has one.")] = 1
    forgotten: int = 2


def test_generator_refuses_an_undocumented_setting():
    with pytest.raises(docgen.UndocumentedSettingError, match="forgotten"):
        list(docgen.rows(_Section, "section."))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from app.main import create_app

    return create_app(load_settings(data_dir=tmp_path_factory.mktemp("docs-app")))


def _documented_routes() -> set[tuple[str, str]]:
    return set(ROUTE.findall((DOCS / "api.md").read_text(encoding="utf-8")))


def test_api_page_documents_every_route_of_the_schema(app):
    schema_routes = {
        (method.upper(), path)
        for path, operations in app.openapi()["paths"].items()
        for method in operations
        if method.upper() not in IGNORED_METHODS
    }
    missing = sorted(schema_routes - _documented_routes())
    assert missing == [], f"routes of the OpenAPI schema missing from docs/api.md (as `METHOD /path`): {missing}"


def _is_served(app, method: str, path: str) -> bool:
    """Whether a request to `path` (its {parameters} filled in) would reach a route of the app with
    this method: asked of the router itself, so included routers and mounts count as they serve."""
    from starlette.routing import Match

    scope = {"type": "http", "path": re.sub(r"\{[^}]+\}", "x", path), "method": method, "root_path": "", "app": app}
    return any(route.matches(scope)[0] == Match.FULL for route in app.routes)


def test_api_page_names_no_route_the_app_lacks(app):
    unknown = sorted(route for route in _documented_routes() if not _is_served(app, *route))
    assert unknown == [], f"docs/api.md names routes the app does not serve: {unknown}"


def test_route_check_tells_served_from_unserved(app):
    assert _is_served(app, "POST", "/v1/query") and _is_served(app, "GET", "/static/app.js")
    assert not _is_served(app, "GET", "/v1/query") and not _is_served(app, "GET", "/redoc")
