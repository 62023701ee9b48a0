"""Hostfile parsing and --include/--exclude selection: every error case, and agreement with DeepSpeed."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from deepseek_ds.launcher.hostfile import HostfileError, parse_hostfile, read_hostfile, select_slots

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

FOUR = parse_hostfile("node-0 slots=4\nnode-1 slots=4\nnode-2 slots=2\n", source="four")


def deepspeed_runner():
    # Imported lazily: importing deepspeed costs seconds and only the cross-checks need it.
    from deepspeed.launcher import runner
    return runner


# ---------------------------------------------------------------- parsing


def test_parses_comments_blank_lines_and_extra_fields():
    hf = parse_hostfile("# cluster A\n\nnode-0 slots=8   # big box\n  node-1 slots=4 max_slots=8\n", "x")
    assert [(e.name, e.slots, e.line) for e in hf.entries] == [("node-0", 8, 3), ("node-1", 4, 4)]
    assert hf.hosts == ["node-0", "node-1"]
    assert hf.slots_of("node-1") == 4


@pytest.mark.parametrize("name", ["4node", "2node", "localhost"])
def test_example_hostfiles_parse_like_deepspeed(name):
    path = REPO / "hostfiles" / name
    ours = read_hostfile(path)
    theirs = deepspeed_runner()._parse_hostfile(path.read_text().splitlines())
    assert collections.OrderedDict((e.name, e.slots) for e in ours.entries) == theirs


@pytest.mark.parametrize("text, expected", [
    ("node-0\n", ["hosts:1:", "'node-0'", "HOST slots=N"]),               # no slots at all
    ("node-0 slots = 8\n", ["hosts:1:", "no spaces around '='"]),          # DeepSpeed rejects this too
    ("node-0 slots=0\n", ["node-0", "slots=0", ">= 1"]),                   # DeepSpeed accepts and starts nothing
    ("node-0 slots=-2\n", ["node-0", "slots=-2", "whole number"]),
    ("node-0 slots=8x\n", ["node-0", "slots=8x", "whole number"]),         # DeepSpeed silently reads 8
    ("node-0 slots=\n", ["node-0", "whole number"]),
    ("a slots=1\nb slots=1\na slots=2\n", ["hosts:3:", "'a'", "first on line 1"]),
    ("", ["lists no hosts"]),
    ("# only a comment\n\n", ["lists no hosts"]),
    ("node@0 slots=1\n", ["node@0", "'@'", "separator"]),
    ("node:0 slots=1\n", ["node:0", "':'"]),
    ("node-0 slots=4 gpus\n", ["unexpected 'gpus'", "key=value"]),
])
def test_hostfile_errors_name_line_host_and_fix(text, expected):
    with pytest.raises(HostfileError) as err:
        parse_hostfile(text, source="hosts")
    for part in expected:
        assert part in str(err.value)


def test_missing_and_unreadable_hostfile(tmp_path):
    with pytest.raises(HostfileError, match="does not exist.*HOST slots=N"):
        read_hostfile(tmp_path / "nope")
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(tmp_path)


def test_errors_are_value_errors():
    # Callers that only know DeepSpeed's ValueError still catch ours.
    assert issubclass(HostfileError, ValueError)


# ---------------------------------------------------------------- include / exclude

SELECTIONS = [
    ("", "", {"node-0": [0, 1, 2, 3], "node-1": [0, 1, 2, 3], "node-2": [0, 1]}),
    ("node-1", "", {"node-1": [0, 1, 2, 3]}),
    ("node-2@node-0:1,3", "", {"node-0": [1, 3], "node-2": [0, 1]}),  # hostfile order, not filter order
    ("node-0:2@node-0:0,2", "", {"node-0": [0, 2]}),                 # repeated host: slots merged
    ("", "node-1", {"node-0": [0, 1, 2, 3], "node-2": [0, 1]}),
    ("", "node-0:0,3@node-2:1", {"node-0": [1, 2], "node-1": [0, 1, 2, 3], "node-2": [0]}),
    ("", "node-2:0,1", {"node-0": [0, 1, 2, 3], "node-1": [0, 1, 2, 3]}),  # all slots gone: host gone
]


@pytest.mark.parametrize("include, exclude, expected", SELECTIONS)
def test_selection_matches_deepspeed(include, exclude, expected):
    assert select_slots(FOUR, include, exclude) == expected
    pool = collections.OrderedDict((e.name, e.slots) for e in FOUR.entries)
    theirs = deepspeed_runner().parse_inclusion_exclusion(pool, include, exclude)
    assert dict(theirs) == expected
    assert list(theirs) == list(expected)


@pytest.mark.parametrize("include, exclude, expected", [
    ("node-0", "node-1", "mutually exclusive"),
    ("node-9", "", "host 'node-9' is not in four (hosts: node-0, node-1, node-2)"),
    ("", "node-9:0", "host 'node-9' is not in four"),
    ("node-2:2", "", "host 'node-2' has slots 0-1 in four, not slot 2"),
    ("node-0:x", "", "slot 'x' of host 'node-0' is not a slot number"),
    ("node-0:", "", "slot '' of host 'node-0'"),
    ("node-0:1:2", "", "slot '1:2'"),
    ("node-0:-1", "", "slot '-1'"),
    ("node-0@@node-1", "", "empty host between '@'"),
])
def test_selection_errors_are_clear_and_deepspeed_rejects_them_too(include, exclude, expected):
    with pytest.raises(HostfileError) as err:
        select_slots(FOUR, include, exclude)
    assert expected in str(err.value)
    flag = "--include" if include and not exclude else "--exclude" if exclude and not include else ""
    assert flag in str(err.value)
    pool = collections.OrderedDict((e.name, e.slots) for e in FOUR.entries)
    with pytest.raises((ValueError, KeyError)):
        deepspeed_runner().parse_inclusion_exclusion(pool, include, exclude)


def test_excluding_everything_is_an_error_not_an_empty_launch():
    # DeepSpeed returns {} here and then fails with an IndexError while picking the first host.
    with pytest.raises(HostfileError, match="leaves no slots"):
        select_slots(FOUR, "", "node-0@node-1@node-2")
