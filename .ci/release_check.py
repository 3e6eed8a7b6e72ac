"""Build the release and try it as a user would: `python .ci/release_check.py`.

1. `python -m build` makes an sdist and a wheel in `dist/`.
2. The wheel must carry the package and its `py.typed` marker, the version of
   `eqxpar/_version.py`, and nothing from tests, benchmarks or examples.
3. The wheel, installed (not editable) into a fresh venv, runs README's quick start
   from a directory outside the checkout, so only the installed copy can be imported.

Exits non-zero, saying which step failed, on any failure.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"


def run(*command, **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(map(str, command)), flush=True)
    return subprocess.run([str(c) for c in command], check=True, **kwargs)


def version() -> str:
    text = (ROOT / "eqxpar" / "_version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def quick_start() -> str:
    """README's first ```python block (under "Quick start")."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Quick start\n.*?```python\n(.*?)```", text, re.S)
    if match is None:
        sys.exit("release check: README.md has no ```python block under '## Quick start'")
    return match.group(1)


def check_wheel(wheel: pathlib.Path, want_version: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    stray = sorted(t for t in top if t != "eqxpar" and not t.startswith("eqxpar-"))
    problems = []
    if stray:
        problems.append(f"files outside the package: {stray}")
    if "eqxpar/py.typed" not in names:
        problems.append("no eqxpar/py.typed (type checkers would ignore the annotations)")
    if not wheel.name.startswith(f"eqxpar-{want_version}-"):
        problems.append(f"wheel {wheel.name} is not version {want_version} (eqxpar/_version.py)")
    if problems:
        sys.exit("release check: " + "; ".join(problems))
    print(f"wheel {wheel.name}: {len(names)} files, py.typed present, nothing outside eqxpar/")


def main() -> None:
    start = time.perf_counter()
    for old in DIST.glob("eqxpar-*"):
        old.unlink()
    run(sys.executable, "-m", "pip", "install", "--quiet", "build")
    run(sys.executable, "-m", "build", "--outdir", DIST, ROOT)
    wheels, sdists = sorted(DIST.glob("eqxpar-*.whl")), sorted(DIST.glob("eqxpar-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        sys.exit(f"release check: expected one wheel and one sdist in dist/, found {wheels + sdists}")
    check_wheel(wheels[0], version())
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp) / "venv"
        run(sys.executable, "-m", "venv", venv)
        python = venv / "bin" / "python"
        run(python, "-m", "pip", "install", "--quiet", wheels[0])
        script = pathlib.Path(tmp) / "quick_start.py"
        script.write_text(quick_start())
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        env["JAX_PLATFORMS"] = "cpu"
        where = "import eqxpar; assert 'site-packages' in eqxpar.__file__, eqxpar.__file__; "
        where += "print('installed eqxpar', eqxpar.__version__, 'at', eqxpar.__file__)"
        run(python, "-c", where, cwd=tmp, env=env)
        run(python, script, cwd=tmp, env=env)
    print(f"release check passed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
