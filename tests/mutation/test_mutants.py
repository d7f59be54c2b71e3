"""The mutation list stays applicable (``tests/mutation/mutants.py``; the run itself is
``scripts/mutation.py``, in ``make test-all``): each change's text occurs exactly once in its
module, changes something, and names tests that exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from .mutants import MUTANTS, TESTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("m", MUTANTS, ids=[f"{m.path}:{i}" for i, m in enumerate(MUTANTS)])
def test_each_change_applies_once_and_names_its_tests(m):
    text = (ROOT / "src" / "attnchecker" / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.path}: the list's text is gone or repeated: {m.old!r}"
    assert m.new != m.old and m.why
    compile(text.replace(m.old, m.new), m.path, "exec")  # the change is still Python
    paths = [a for a in (m.tests or TESTS[m.path]) if a.startswith("tests/")]
    assert paths and all((ROOT / p.split("::")[0]).exists() for p in paths), paths


def test_every_promised_module_is_mutated():
    """The modules issue 41 names, each with several changes."""
    for path in TESTS:
        assert sum(m.path == path for m in MUTANTS) >= 5, path
