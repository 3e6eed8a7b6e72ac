"""The registry of cases kept out of `make test` (tests/_slow_cases.py) names real
cases, each beside a sibling that `make test` runs."""

import pathlib

from ._slow_cases import SLOW_CASES
from .conftest import COLLECTED


def test_every_slow_case_has_a_fast_sibling():
    # Only the files this run collected can be checked (a run of one file collects
    # that file's cases alone); `make test` collects them all.
    files = {node.split("::")[0] for node in COLLECTED}
    checked = 0
    for case, sibling in SLOW_CASES.items():
        if case.split("::")[0] not in files:
            continue
        assert pathlib.Path(case.split("::")[0]).name.startswith("test_"), case
        assert case in COLLECTED, f"tests/_slow_cases.py names {case!r}, which is no test case (renamed?)"
        # A sibling in a file this run did not collect cannot be checked here.
        if sibling.split("::")[0] not in files:
            continue
        assert sibling in COLLECTED, f"the sibling {sibling!r} of {case!r} is no test case"
        assert sibling not in SLOW_CASES, f"the sibling {sibling!r} of {case!r} is kept out of make test too"
        checked += 1
    assert checked or not files & {c.split("::")[0] for c in SLOW_CASES}


def test_every_kept_case_pattern_names_a_case():
    import fnmatch

    from ._slow_cases import KEEP_NONE, KEEP_ONLY

    files = {node.split("::")[0] for node in COLLECTED}
    for test in KEEP_NONE:
        if test.split("::")[0] in files:
            assert any(node.startswith(test + "[") for node in COLLECTED), (
                f"tests/_slow_cases.py keeps no case of {test!r}, which has none (renamed?)"
            )
    for test, patterns in KEEP_ONLY.items():
        if test.split("::")[0] not in files:
            continue
        cases = [node[len(test) + 1 : -1] for node in COLLECTED if node.startswith(test + "[")]
        assert cases, f"tests/_slow_cases.py keeps cases of {test!r}, which has none (renamed?)"
        for pattern in patterns:
            assert any(fnmatch.fnmatchcase(case, pattern) for case in cases), (
                f"the pattern {pattern!r} kept for {test!r} matches none of its cases {cases}"
            )


def test_every_newest_pattern_names_a_slow_case_that_make_test_newest_runs():
    import fnmatch
    import re

    from ._slow_cases import NEWEST

    # A pattern over a file `make test-newest` does not run would mark nothing there.
    makefile = (pathlib.Path(__file__).parent.parent / "Makefile").read_text()
    newest_files = set(
        re.search(r"NEWEST_TESTS :=(.*?)\n\S", makefile, re.S).group(1).replace("\\", " ").split()
    )
    files = {node.split("::")[0] for node in COLLECTED}
    for pattern in NEWEST:
        file = pattern.split("::")[0]
        assert file in newest_files, f"{pattern!r} is in no file of the Makefile's NEWEST_TESTS"
        if file in files:
            matched = [node for node in COLLECTED if fnmatch.fnmatchcase(node, pattern)]
            assert any(node in SLOW_CASES for node in matched), (
                f"tests/_slow_cases.py marks {pattern!r} newest, which names no slow case"
            )
