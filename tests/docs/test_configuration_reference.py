"""docs/configuration.md lists exactly the make targets of the Makefile, the primary configs
and the config groups of conf/ with all their options: nothing missing, nothing extra."""

from __future__ import annotations

import re

from tests.docs.commands import CONF, REPO, make_targets

PAGE = REPO / "docs" / "configuration.md"


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `heading`."""
    text = PAGE.read_text(encoding="utf-8").split(heading, 1)[1]
    rows = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif rows:
            break
    return rows[1:]  # without the header


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_make_targets_are_listed():
    listed = [names(row[0])[0].removeprefix("make ") for row in table("## Make targets")]
    documented = {t for t in make_targets() if not t.startswith("$")}
    assert sorted(listed) == sorted(documented)


def test_primary_configs_are_listed():
    listed = {names(row[0])[0] for row in table("## Primary configs")}
    assert listed == {p.stem for p in CONF.glob("*.yaml")}


def test_config_groups_and_options_are_listed():
    rows = table("## Config groups")
    listed = {names(row[0])[0]: row[1] for row in rows}
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert set(listed) == groups, "config groups listed vs folders in conf/"
    for group, cell in listed.items():
        options = set(names(cell.split(";")[0]))
        actual = {p.stem for p in (CONF / group).glob("*.yaml")}
        assert options == actual, f"{group}: listed {sorted(options)}, conf/ has {sorted(actual)}"
