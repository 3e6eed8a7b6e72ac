"""Long-run figures (BENCHMARKS.md, "Long runs"), each from the script that measures it
(`examples/token_file.py --measure`, `tests/_long_run_script.py --measure-async-save`).

    python -m benchmarks.long_runs --token-file /tmp/tokens.bin --json benchmarks/results/quick.json
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "eqxpar.launch", "-n", "2", "--devices-per-process", "4"]
READ = re.compile(
    r"rows (\d+):(\d+) of \d+: ([\d,]+) tokens/s read, ([\d,]+) tokens/s read \+ global_batch; "
    r"RssAnon (\d+) MiB \(\+(-?\d+) while reading\), RssFile (\d+) MiB \(\+(-?\d+); the token file's "
    r"pages ([\d.]+) MiB\), peak RSS (\d+) MiB"
)
FIELDS = ("tokens_per_s", "tokens_per_s_with_global_batch", "rss_anon_mib", "rss_anon_growth_mib")
FIELDS += ("rss_file_mib", "rss_file_growth_mib", "token_file_resident_mib", "peak_rss_mib")


def _run(command: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def read_token_file(path: pathlib.Path, *, steps: int, layout: str, hashes: pathlib.Path) -> list[dict]:
    """Each process's figures reading `steps` batches of 256 x 1024 tokens cold, `layout` "1x8" or "2x4"."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: nothing of the file cached
    os.close(fd)
    script = ["examples/token_file.py", "--data", str(path), "--measure", "--steps", str(steps)]
    script += ["--seq-len", "1024", "--batch-size", "256", "--hashes-out", str(hashes)]
    out = _run([*LAUNCH, *script] if layout == "2x4" else [sys.executable, *script])
    rows = []
    for m in READ.finditer(out):
        numbers = [float(x.replace(",", "")) for x in m.groups()]
        rows.append(
            {"rows": [int(numbers[0]), int(numbers[1])], **dict(zip(FIELDS, numbers[2:], strict=True))}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-file", type=pathlib.Path, required=True, help="made (random ids) if missing")
    parser.add_argument("--gb", type=float, default=2.0, help="the token file's size when it is made")
    parser.add_argument("--steps", type=int, default=400, help="global batches read per layout")
    parser.add_argument("--json", type=pathlib.Path, required=True, help="the JSON to record into")
    args = parser.parse_args()
    if not args.token_file.exists():
        make = ["examples/token_file.py", "--make-file", str(args.token_file), "--gb", str(args.gb)]
        _run([sys.executable, *make])
    record = {"command": "python -m " + " ".join(["benchmarks.long_runs", *sys.argv[1:]])}
    record["token_file_bytes"] = args.token_file.stat().st_size
    with tempfile.TemporaryDirectory() as tmp:
        hashes = {layout: pathlib.Path(tmp, layout) for layout in ("1x8", "2x4")}
        for k, path in hashes.items():
            record[f"read_{k}"] = read_token_file(args.token_file, steps=args.steps, layout=k, hashes=path)
        record["same_global_batches"] = hashes["1x8"].read_text() == hashes["2x4"].read_text()
    save = ["tests/_long_run_script.py", "--measure-async-save", "--width", "1024", "--repeats", "40"]
    out = _run([sys.executable, *save])
    found = re.search(r"median step ([\d.]+) ms .* ([\d.]+) ms without; ratio ([\d.]+)", out)
    busy, quiet, ratio = map(float, found.groups())
    record["async_save"] = {"step_ms_save_in_flight": busy, "step_ms": quiet, "ratio": ratio}
    print(json.dumps(record, indent=1))
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    args.json.write_text(json.dumps({**data, "long_runs": record}, indent=2) + "\n")


if __name__ == "__main__":
    main()
