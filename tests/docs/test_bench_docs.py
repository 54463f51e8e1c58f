"""bench/README.md says how each benchmark measures, one section per script; bench/results/ holds the results,
one file per day and machine, with a table either measured or predicted, never both."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "bench" / "README.md").read_text()
RESULTS = sorted((ROOT / "bench" / "results").glob("*.md"))
PREDICTED_LABEL = "Predicted, not measured"


def _tables(text: str) -> list[tuple[str, list[str]]]:
    """Each Markdown table of ``text`` with the last line of text before it."""
    tables, before, rows = [], "", []
    for line in text.split("\n") + [""]:
        if line.startswith("|"):
            rows.append(line)
            continue
        if rows:
            tables.append((before, rows))
            rows = []
        if line.strip() and not line.startswith("|"):
            before = line
    return tables


def mixed_tables(text: str) -> list[str]:
    """Tables that speak of predictions without the label, or are labelled predicted and hold a measured column."""
    bad = []
    for before, rows in _tables(text):
        body = "\n".join(rows)
        labelled = PREDICTED_LABEL in before
        if (re.search(r"predict", body, re.I) and not labelled) or (labelled and "(measured)" in body):
            bad.append(rows[0])
    return bad


def test_one_section_per_benchmark_script():
    """Every script in bench/ has its "how it measures" section; the helpers are named under "Helpers"."""
    sections = set(re.findall(r"^## (\S+\.py): how it measures$", README, flags=re.M))
    named_as_helpers = set(re.findall(r"`bench/(\w+\.py)`", README.split("\n## Helpers", 1)[1]))
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert sections <= scripts, f"sections for scripts that are not in bench/: {sections - scripts}"
    assert scripts - sections <= named_as_helpers, f"bench/ scripts with no section: {scripts - sections - named_as_helpers}"


def test_readme_lists_every_results_file():
    linked = set(re.findall(r"\]\(results/([^)]+)\)", README))
    assert linked == {p.name for p in RESULTS} and RESULTS


def test_each_results_file_says_when_where_and_how():
    for path in RESULTS:
        text = path.read_text()
        date = re.fullmatch(r"(\d{4}-\d\d-\d\d)-[a-z0-9-]+\.md", path.name)
        assert date, f"{path.name}: not <date>-<machine>.md"
        for field in ("Recorded", "Machine", "Commits", "Commands"):
            assert re.search(rf"^- \*\*{field}:\*\*", text, flags=re.M), f"{path.name} has no {field}"
        assert re.search(rf"^- \*\*Recorded:\*\* {date.group(1)}", text, flags=re.M), path.name


def test_no_table_mixes_measured_and_predicted():
    for path in RESULTS:
        assert not mixed_tables(path.read_text()), f"{path.name}: {mixed_tables(path.read_text())}"


def test_the_mixing_check_catches_a_mixed_table():
    mixed = "text\n\n| target | before (measured) | now (predicted) |\n| --- | --- | --- |\n| a | 1 | 2 |\n"
    labelled = f"**{PREDICTED_LABEL}**:\n\n| target | now (predicted) |\n| --- | --- |\n| a | 2 |\n"
    assert mixed_tables(mixed) and not mixed_tables(labelled)
