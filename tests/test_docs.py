"""The documentation: every ```python block of README.md and of docs/ runs as
written, every public name has a reference entry, the site builds with
`mkdocs build --strict`, and the files a release ships beside the code (the
license, the typing marker) are there."""

import dataclasses
import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import types

import pytest

from . import _fresh_python as fresh_python
from ._compile_flags import DEVICES_8, IN_ORDER, suite_xla_flags

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

# The set-up of tests/conftest.py, for the child processes: 8 simulated CPU devices,
# each running its collectives in program order, compiled cheaply.
XLA_FLAGS = suite_xla_flags(DEVICES_8, IN_ORDER)

# Fences a page may use. Only `python` runs; what must not run (a shell command, a
# Slurm script, printed output) says so with its language.
LANGUAGES = ("python", "bash", "text", "yaml", "toml", "")

# The modules a user imports, each with its reference page.
PUBLIC_MODULES = (
    "eqxpar",
    "eqxpar.train",
    "eqxpar.optim",
    "eqxpar.nn",
    "eqxpar.collectives",
    "eqxpar.pipeline",
    "eqxpar.inspect",
    "eqxpar.models",
    "eqxpar.rules",
    "eqxpar.data",
    "eqxpar.distributed",
    "eqxpar.checkpoint",
    "eqxpar.launch",
    "eqxpar.runtime",
    "eqxpar.internal",
    "eqxpar.aot",
)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its page, language, first code line (1-based), heading and code."""

    page: str
    language: str
    line: int
    heading: str
    code: str

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{self.page}:L{self.line}-{slug}"


def markdown_blocks(text: str, page: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with the heading above it."""
    blocks, heading, fence = [], "top", None
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if fence is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence = (line[3:].strip(), number + 1, [])
            continue
        if line.startswith("```"):
            language, first, body = fence
            blocks.append(Block(page, language, first, heading, "\n".join(body) + "\n"))
            fence = None
        else:
            fence[2].append(line)
    assert fence is None, f"{page}: the code block opened at line {fence[1] - 1} is never closed"
    return blocks


def _page_name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


ALL_BLOCKS = [b for page in PAGES for b in markdown_blocks(page.read_text(), _page_name(page))]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python"]


def test_blocks_are_found():
    # A fence the parser misreads would silently drop blocks from the test below.
    readme = [b for b in PYTHON_BLOCKS if b.page == "README.md"]
    assert readme and readme[0].heading == "Quick start"
    assert len(PYTHON_BLOCKS) >= 12
    assert {b.language for b in ALL_BLOCKS} <= set(LANGUAGES)
    # The parser reads fences at the start of a line only: an indented one (in a
    # list or an admonition) would be neither run nor reported.
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            assert not (line.startswith(" ") and line.lstrip().startswith("```")), (
                f"{_page_name(page)}:{number}: indented code fence; start it at column 0"
            )


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_python_block_runs(block, tmp_path):
    """Each block in a fresh interpreter (in an empty directory, so files it writes
    stay out of the repository), with nothing defined beforehand (a fork of one
    that has imported JAX and eqxpar only: tests/_fresh_python.py)."""
    if "topology=" in block.code and importlib.util.find_spec("libtpu") is None:
        pytest.skip(
            'the block compiles for a TPU topology and libtpu is not installed (pip install "eqxpar[tpu]")'
        )
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = fresh_python.run(code=block.code, cwd=tmp_path, env=env, timeout=300)
    if result.returncode != 0:
        pytest.fail(
            f"{block.page} block at line {block.line} (under '{block.heading}') exited with status "
            f"{result.returncode}:\n{result.stderr[-3000:]}",
            pytrace=False,
        )
    if block.page == "README.md" and block.heading == "Quick start":
        assert "all-reduce" in result.stdout


def _public_names(module: types.ModuleType) -> list[str]:
    # Submodules have pages of their own (and `eqxpar.launch` imports `sys`).
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    )


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_has_a_reference_entry():
    """A name is documented by its own `::: module.name` entry, or, where a module
    re-exports another's object, by naming it on a page that also documents that
    object."""
    text = "\n".join(page.read_text() for page in sorted(REFERENCE.glob("*.md")))
    entries = re.findall(r"^::: (\S+)", text, flags=re.MULTILINE)
    documented = {id(_resolve(entry)) for entry in entries}
    missing = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in _public_names(module):
            path = f"{module_name}.{name}"
            if path in entries:
                continue
            if id(getattr(module, name)) in documented and f"`{path}`" in text:
                continue
            missing.append(path)
    assert not missing, f"public names without a reference entry in docs/reference/: {missing}"
    unknown = [e for e in entries if not e.startswith("eqxpar")]
    assert not unknown, unknown


PUBLIC_API = pathlib.Path(__file__).parent / "data" / "public_api.txt"


def public_api() -> list[str]:
    """Every public name of the public modules, `module.name`, sorted."""
    return sorted(
        f"{module_name}.{name}"
        for module_name in PUBLIC_MODULES
        for name in _public_names(importlib.import_module(module_name))
    )


def test_the_public_api_is_the_checked_in_list():
    """The public API is tests/data/public_api.txt, so that adding, moving or
    removing a public name is a deliberate change, seen in review. After such a
    change: `EQXPAR_WRITE_PUBLIC_API=1 make test` rewrites the list."""
    names = public_api()
    if os.environ.get("EQXPAR_WRITE_PUBLIC_API"):
        PUBLIC_API.write_text("\n".join(names) + "\n")
    listed = PUBLIC_API.read_text().split()
    added, removed = sorted(set(names) - set(listed)), sorted(set(listed) - set(names))
    assert not added and not removed, (
        f"the public API changed: added {added}, removed {removed}. If that is meant, rewrite "
        f"{PUBLIC_API.relative_to(ROOT)} with EQXPAR_WRITE_PUBLIC_API=1 and say so in CHANGELOG.md."
    )


def test_each_public_object_has_one_path():
    """No object is public under two names (`eqxpar.runtime` used to re-export the
    names of `eqxpar.data`, `eqxpar.distributed`, `eqxpar.launch` and
    `eqxpar.checkpoint`): a reader meets one path per thing."""
    paths = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in _public_names(module):
            value = getattr(module, name)
            if isinstance(value, (bool, int, float, str, tuple, frozenset, type(None))):
                continue  # constants: equal values need not be one object
            paths.setdefault(id(value), []).append(f"{module_name}.{name}")
    twice = sorted(p for p in paths.values() if len(p) > 1)
    assert not twice, f"public under more than one path: {twice}"


def test_pages_stay_inside_the_repository():
    # The site and GitHub both render these pages: a link or snippet that leaves
    # the repository works on neither.
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT.resolve()), f"{_page_name(page)} links outside: {target}"
            assert resolved.exists(), f"{_page_name(page)} links to a missing file: {target}"


def test_benchmark_pictures_are_current():
    # The site shows copies of the benchmarks' plots (mkdocs serves only docs/).
    copies = sorted((DOCS / "images" / "benchmarks").glob("*.png"))
    assert copies
    for copy in copies:
        original = ROOT / "benchmarks" / "results" / copy.name
        assert copy.read_bytes() == original.read_bytes(), (
            f"{_page_name(copy)} differs from {_page_name(original)}: cp {_page_name(original)} {_page_name(copy)}"
        )


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')"
)
def test_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "pipeline" / "index.html").is_file()


def test_license_and_typing_marker_ship():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == {"text": "Apache-2.0"}
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert "Copyright 2026 the eqxpar authors" in license_text
    # PEP 561: type checkers read eqxpar's annotations only if the package has it;
    # the wheel takes every file of the package directory, so it ships.
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["eqxpar"]
    assert (ROOT / "eqxpar" / "py.typed").is_file()


def test_readme_stays_short():
    # The README is the front page: long-form documentation lives in docs/.
    assert len(README.read_text().splitlines()) <= 200


def test_figures_quoted_from_other_scripts_match_the_record():
    # The entries benchmarks.long_runs, benchmarks/pretrained_load.py and benchmarks.decode write into
    # quick.json are quoted by BENCHMARKS.md and the long-runs guide: each figure
    # quoted must be the recorded one, rounded as printed.
    import json

    data = json.loads((ROOT / "benchmarks" / "results" / "quick.json").read_text())
    bench = (ROOT / "BENCHMARKS.md").read_text()
    guide = (DOCS / "guides" / "long-runs.md").read_text()
    runs = data["long_runs"]
    one, two = runs["read_1x8"][0], runs["read_2x4"]
    save = runs["async_save"]
    quoted = [
        f"{one['tokens_per_s'] / 1e6:.2f} M tokens/s read ({one['tokens_per_s_with_global_batch'] / 1e6:.2f} M",
        f"{two[0]['tokens_per_s'] / 1e6:.2f} M and {two[1]['tokens_per_s'] / 1e6:.2f} M tokens/s per process",
        f"peak RSS {one['peak_rss_mib']:.0f} MiB",
        f"is {save['step_ms_save_in_flight']:.1f} ms, against\n  {save['step_ms']:.1f} ms without: {save['ratio']:.2f}x",
    ]
    for i, p in enumerate(data["pretrained_load"]["processes"]):
        mb = {
            k: f"{p[k] / 1e6:,.0f} MB" for k in ("rss_before", "peak", "growth", "shards", "anonymous_after")
        }
        quoted.append(
            f"| {i} | {mb['rss_before']} | {mb['peak']} | {mb['growth']} | {mb['shards']} | "
            f"{p['growth_over_shards_plus_largest']:.2f} | {mb['anonymous_after']} |"
        )
    from benchmarks.lora import table

    quoted.append(table(data["lora"]))  # the LoRA table is the record's
    from benchmarks.muon import markdown as muon_table

    quoted.append(muon_table(data["muon"]))  # so is Muon's
    from benchmarks.logprobs_memory import table as logprobs_table

    quoted.append(logprobs_table(data["logprobs_memory"]))  # and the log-probs memory table
    for r in data["decode"]["runs"]:  # benchmarks/decode.py's record
        quoted.append(
            f"| {r['steps']:,} | {r['cached_tokens_per_s']:,.0f} | {r['uncached_tokens_per_s']:,.0f} | "
            f"{r['speedup']:.1f}x | {'yes' if r['same_tokens'] else 'no'} |"
        )
    for text in quoted:
        assert text in bench, text
    assert (
        f"gave\n  {save['ratio']:.2f}x ({save['step_ms_save_in_flight']:.1f} ms against {save['step_ms']:.1f} ms"
        in guide
    )
