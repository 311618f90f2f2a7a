"""The docs stay a reference a newcomer reads in minutes (issue #41): each package page lists every module of its
package in its module table, names no module that is gone, and stays short; dated measurements live in
docs/journal/. The directories are read when the tests run, so a module added without its doc line fails here."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

# package directory (from the repository root) -> its page; subpackages (sgjax/lang/backend) belong to the parent's
PACKAGES = {
    "sgjax/cache": "cache.md",
    "sgjax/engine": "engine.md",
    "sgjax/fsm": "fsm.md",
    "sgjax/lang": "lang.md",
    "sgjax/model": "model.md",
    "sgjax/router": "router.md",
    "sgjax/server": "server.md",
    "kernels": "kernels.md",
}
MODULE_SUFFIXES = (".py", ".cc", ".h")  # Python modules, and the native kernels' sources
PAGE_LINES = 160  # a package page: ~150 lines, read in minutes
ARCHITECTURE_LINES = 220  # the layout, one request's path, the cross-cutting decisions


def modules(package: str) -> set[str]:
    """Every module file of the package, as a path relative to it (`plan.py`, `backend/base.py`); not __init__.py."""
    top = os.path.join(ROOT, package)
    out = set()
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in files:
            if name.endswith(MODULE_SUFFIXES) and name != "__init__.py":
                out.add(os.path.relpath(os.path.join(folder, name), top).replace(os.sep, "/"))
    return out


def module_table(page: str) -> set[str]:
    """The names in the first column of the table under the page's `## Modules` heading (backticked, several per
    cell allowed: `cpu.py`, `cpu_attention.cc`)."""
    lines = open(os.path.join(DOCS, page)).read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("## Modules")), None)
    assert start is not None, f"docs/{page} has no '## Modules' section"
    names, in_table = set(), False
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            in_table = True
            first = line.split("|")[1]
            names.update(re.findall(r"`([^`]+)`", first))
        elif in_table:
            break
    assert names, f"docs/{page}'s '## Modules' section has no table"
    return names


def package_pages() -> list[str]:
    """Every page of docs/ but the architecture overview (journal files live in docs/journal/, not here)."""
    return sorted(name for name in os.listdir(DOCS) if name.endswith(".md") and name != "architecture.md")


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_module_of_a_package_has_a_line_in_its_pages_module_table(package):
    """A reader learns a package from its page's module table, so the table must be complete: a module added
    without a line there fails this test, naming the file and the page."""
    page = PACKAGES[package]
    missing = sorted(modules(package) - module_table(page))
    assert not missing, f"docs/{page}: the module table has no line for {missing} (in {package}/)"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_module_table_names_only_modules_that_exist(package):
    """A line for a module that was removed or renamed sends the reader to nothing, so every name in the table
    must be a file of the package."""
    page = PACKAGES[package]
    stale = sorted(
        name
        for name in module_table(page)
        if name.endswith(MODULE_SUFFIXES) and not os.path.isfile(os.path.join(ROOT, package, name))
    )
    assert not stale, f"docs/{page}: the module table names {stale}, which {package}/ does not have"


@pytest.mark.parametrize("page", package_pages())
def test_a_package_page_stays_short_enough_to_read_in_minutes(page):
    """Pages are references, not journals: dated measurements go to docs/journal/, so a page that grows past its
    budget is collecting history again."""
    count = len(open(os.path.join(DOCS, page)).read().splitlines())
    assert count <= PAGE_LINES, f"docs/{page} has {count} lines (at most {PAGE_LINES}; move history to docs/journal/)"


def test_the_architecture_page_stays_short_enough_to_read_in_minutes():
    """The overview is the layout, one request's path and the cross-cutting decisions; details belong on the
    package pages."""
    count = len(open(os.path.join(DOCS, "architecture.md")).read().splitlines())
    assert count <= ARCHITECTURE_LINES, f"docs/architecture.md has {count} lines (at most {ARCHITECTURE_LINES})"


def test_every_source_file_the_architecture_page_names_exists():
    """The request-path table is followed file by file; a name that no longer exists (`engine/plan.py`, written
    from sgjax/, or `sgjax/errors.py` from the root) would send the reader to nothing."""
    text = open(os.path.join(DOCS, "architecture.md")).read()
    named = set(re.findall(r"`?([A-Za-z0-9_./]+/[A-Za-z0-9_]+\.py)`?", text))
    missing = sorted(
        path for path in named if not any(os.path.isfile(os.path.join(ROOT, base, path)) for base in ("", "sgjax"))
    )
    assert named and not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_package_has_its_page_and_the_journal_has_its_index():
    """The tests above read these files; a page renamed or a journal without its index would leave a reader (and
    them) nowhere to look."""
    for page in PACKAGES.values():
        assert os.path.isfile(os.path.join(DOCS, page)), f"docs/{page} is missing"
    assert os.path.isfile(os.path.join(DOCS, "journal", "README.md")), "docs/journal/README.md is missing"
