"""The documentation stays true to the code: every setting documented, every link inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway import problems, settings
from tests.doc_blocks import PAGES, ROOT, blocks

MODELS: list[type[BaseModel]] = [
    settings.Settings,
    settings.UpstreamSettings,
    settings.ProbeSettings,
    settings.NativeKeySettings,
    settings.StampSettings,
    settings.TenantSettings,
    settings.AdminSettings,
    settings.OperatorSettings,
    settings.AuditSettings,
    settings.WebhookSettings,
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_setting_is_in_the_configuration_reference(model: type[BaseModel]) -> None:
    """A setting users cannot find is a setting they cannot use: each one has its line in the reference."""
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in model.model_fields if f"`{name}`" not in reference]
    assert missing == []


def test_every_problem_type_is_in_the_contract() -> None:
    """Clients branch on problem types, so the contract lists every one."""
    contract = (ROOT / "docs" / "contract.md").read_text()
    missing = [name for name in problems.problem_types() if f"`{name}`" not in contract]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository_and_lead_somewhere(page: Path) -> None:
    """A user's clone has only the repository: every relative link names a file (and heading) in it."""
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an outside address, not a file
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.is_relative_to(ROOT), f"{target} leaves the repository"
        assert linked.exists(), f"{target} names no file"
        if anchor and linked.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.MULTILINE)}
            assert anchor in headings, f"{target}: no such heading"


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer makes of a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_client_examples_in_the_docs_are_the_example_files() -> None:
    """docs/clients.md shows every program in examples/clients/ as the file the tests run (a block
    labelled with its path, which tests/test_doc_blocks.py holds to the file's text and runs)."""
    shown = [b.labels for b in blocks(ROOT / "docs" / "clients.md") if b.language == "python"]
    files = sorted((ROOT / "examples" / "clients").glob("*.py"))
    assert files
    assert sorted(shown) == sorted((str(path.relative_to(ROOT)),) for path in files)
