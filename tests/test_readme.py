"""Every ```python block of README.md runs as written, and the files a release
ships beside the code (the license, the typing marker) are there."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"

# The device set-up of tests/conftest.py, for the child processes: 8 simulated CPU
# devices, each running its collectives in program order.
XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first code line (1-based), heading and code."""

    language: str
    line: int
    heading: str
    code: str

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"L{self.line}-{slug}"


def readme_blocks(text: str) -> list[Block]:
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
            blocks.append(Block(language, first, heading, "\n".join(body) + "\n"))
            fence = None
        else:
            fence[2].append(line)
    assert fence is None, f"README.md: the code block opened at line {fence[1] - 1} is never closed"
    return blocks


PYTHON_BLOCKS = [b for b in readme_blocks(README.read_text()) if b.language == "python"]


def test_readme_blocks_are_found():
    # A fence the parser misreads would silently drop blocks from the test below.
    assert len(PYTHON_BLOCKS) >= 8
    assert PYTHON_BLOCKS[0].heading == "Quick start"
    assert all(b.language in ("python", "bash", "text", "") for b in readme_blocks(README.read_text()))


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.name)
def test_readme_python_block_runs(block, tmp_path):
    """Each block in a fresh interpreter (in an empty directory, so files it writes
    stay out of the repository), with nothing defined beforehand."""
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(
            f"README.md block at line {block.line} (under '{block.heading}') exited with status "
            f"{result.returncode}:\n{result.stderr[-3000:]}",
            pytrace=False,
        )
    if block.heading == "Quick start":
        assert "all-reduce" in result.stdout


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
