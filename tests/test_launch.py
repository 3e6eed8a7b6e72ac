"""eqxpar.launch, and whole multi-process runs through it.

The launcher's own behaviour is checked with tiny scripts that do not import JAX
(fast). Two-process JAX runs then check that a rank failing after
eqxpar.distributed.initialize() (exception, sys.exit, SIGKILL, SIGTERM) stops the
run at once, grandchildren included. One test runs examples/multihost.py as 1
process x 8 devices and as 2 processes x 4 devices, kills one process of a third
run with SIGKILL and resumes it from its checkpoint.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import eqxpar.launch
from eqxpar.distributed import DistributedError

from ._compile_flags import suite_xla_flags
from ._helpers import StreamedRun, assert_params_close, assert_processes_gone, assert_trees_close

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "_multihost_script.py"


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_run_passes_rank_environment_and_prefixes_output(tmp_path, capsys):
    script = _script(
        tmp_path,
        "env.py",
        """
        import os, sys
        keys = ["EQXPAR_PROCESS_ID", "EQXPAR_NUM_PROCESSES", "EQXPAR_COORDINATOR", "XLA_FLAGS", "JAX_PLATFORMS"]
        print(" ".join(f"{k}={os.environ[k]}" for k in keys))
        print("to stderr", file=sys.stderr)
        print("args", sys.argv[1:])
        """,
    )
    code = eqxpar.launch.run(script, ["--a", "1"], processes=3, devices_per_process=2)
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    coordinators = set()
    for rank in range(3):
        (line,) = [ln for ln in lines if ln.startswith(f"[rank {rank}] EQXPAR_PROCESS_ID")]
        assert f"EQXPAR_PROCESS_ID={rank} EQXPAR_NUM_PROCESSES=3" in line
        assert "--xla_force_host_platform_device_count=2" in line
        assert line.count("xla_force_host_platform_device_count") == 1  # replaces pytest's own flag
        assert line.endswith("JAX_PLATFORMS=cpu")
        coordinators.add(line.split("EQXPAR_COORDINATOR=")[1].split()[0])
        assert f"[rank {rank}] args ['--a', '1']" in lines
        assert f"[rank {rank}] to stderr" in err.splitlines()
    (coordinator,) = coordinators
    assert coordinator.startswith("127.0.0.1:") and int(coordinator.split(":")[1]) > 0


def _assert_gone(tmp_path, ranks):
    """The processes and grandchildren listed in tmp_path/pids<rank> are all dead."""
    for rank in ranks:
        pids = [int(p) for p in (tmp_path / f"pids{rank}").read_text().split()]
        assert_processes_gone(pids, f"rank {rank} or its child")


# Every rank starts a grandchild, records both pids, and waits for the others' records.
_SPAWN = """
import os, subprocess, sys, time
rank = int(os.environ["EQXPAR_PROCESS_ID"])
count = int(os.environ["EQXPAR_NUM_PROCESSES"])
here = os.path.dirname(__file__)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(here, f"pids{rank}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(here, f"pids{rank}.tmp"), os.path.join(here, f"pids{rank}"))
while not all(os.path.exists(os.path.join(here, f"pids{r}")) for r in range(count)):
    time.sleep(0.02)
"""


def test_a_failing_rank_stops_the_others_and_is_named(tmp_path, capsys):
    script = _script(
        tmp_path,
        "fail.py",
        _SPAWN
        + """
if rank == 1:
    print("about to fail", flush=True)
    raise SystemExit("rank one broke: disk on fire")
time.sleep(600)
""",
    )
    start = time.monotonic()
    code = eqxpar.launch.run(script, [], processes=3, timeout=120)
    elapsed = time.monotonic() - start
    _, err = capsys.readouterr()
    assert code == 1
    assert elapsed < 30
    assert "eqxpar.launch: rank 1 (pid" in err and "exited with status 1" in err
    assert "stopped the other 2 process(es)" in err
    assert "    rank one broke: disk on fire" in err  # the tail of its output
    # The failed rank's own grandchild too.
    _assert_gone(tmp_path, (0, 1, 2))


def test_a_clean_run_leaves_no_process_behind(tmp_path, capsys):
    script = _script(tmp_path, "ok.py", _SPAWN + "print('done', flush=True)\n")
    start = time.monotonic()
    assert eqxpar.launch.run(script, [], processes=2, timeout=60) == 0
    # Not held up by the grandchildren, which keep the output pipes open.
    assert time.monotonic() - start < 20
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 0] done", "[rank 1] done"]
    _assert_gone(tmp_path, (0, 1))


@pytest.mark.parametrize(
    "kind,rank,status",
    [
        ("raise", 0, "exited with status 1"),
        ("exit7", 1, "exited with status 7"),
        ("SIGKILL", 1, "was killed by signal SIGKILL"),
        ("SIGTERM", 1, "was killed by signal SIGTERM"),
    ],
)
def test_a_rank_failing_after_initialize_stops_the_run(tmp_path, kind, rank, status):
    # Two JAX processes joined by eqxpar.distributed.initialize(). A failing one
    # used to hang in JAX's exit barrier (exception, sys.exit) or ignore SIGTERM
    # (JAX's preemption notifier), unseen by the launcher, until the timeout.
    # The launcher adds each process's device count to the suite's compile flags.
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags()}
    command = [sys.executable, "-m", "eqxpar.launch", "-n", "2", "--devices-per-process", "2"]
    command += ["--timeout", "90", str(SCRIPT), "fault", kind, str(rank), str(tmp_path)]
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    report = [line for line in result.stderr.splitlines() if line.startswith("eqxpar.launch:")]
    assert report and report[0].startswith(f"eqxpar.launch: rank {rank} (pid"), result.stderr[-3000:]
    assert status in report[0]
    want = {"raise": 1, "exit7": 7, "SIGKILL": 128 + 9, "SIGTERM": 128 + 15}[kind]
    assert result.returncode == want
    assert f"[rank {rank}] failing by {kind}" in result.stdout
    if kind == "raise":
        assert "RuntimeError: rank broke: disk on fire" in result.stderr  # its traceback
    # Stopped by the failure, not by the 90 s timeout a hang would reach: 37 s was
    # seen with four jobs sharing 2 cores, so the bound leaves room for load.
    assert elapsed < 75
    _assert_gone(tmp_path, (0, 1))


# Each run of each rank records its restart count, coordinator and pid; rank
# `restart % 2` of the first two runs fails (status 5, then 6) while the other waits.
_RESTARTS = """
import os, sys, time
rank, restart = int(os.environ["EQXPAR_PROCESS_ID"]), int(os.environ["EQXPAR_RESTART_COUNT"])
here = os.path.dirname(__file__)
with open(os.path.join(here, f"run{restart}-{rank}"), "w") as f:
    f.write(f"{os.getpid()} {os.environ['EQXPAR_COORDINATOR']}")
if restart < 2:
    if rank == restart % 2:
        time.sleep(0.3)
        print(f"run {restart} failing", flush=True)
        sys.exit(5 + restart)
    time.sleep(600)
print(f"run {restart} done", flush=True)
"""


def test_max_restarts_restarts_the_whole_job(tmp_path, capsys):
    script = _script(tmp_path, "restarts.py", _RESTARTS)
    assert eqxpar.launch.run(script, processes=2, max_restarts=2, timeout=120) == 0
    out, err = capsys.readouterr()
    assert "eqxpar.launch: restart 1 of 2: rank 0 exited with status 5; starting all 2 process(es)" in err
    assert "eqxpar.launch: restart 2 of 2: rank 1 exited with status 6; starting all 2 process(es)" in err
    assert "[rank 0] run 2 done" in out and "[rank 1] run 2 done" in out
    records = {f.name: f.read_text().split() for f in tmp_path.glob("run*-*")}
    assert sorted(records) == [f"run{r}-{k}" for r in range(3) for k in range(2)]
    # A fresh coordinator port for each run, the same for the ranks of one run.
    coordinators = [{records[f"run{r}-{k}"][1] for k in range(2)} for r in range(3)]
    assert all(len(c) == 1 for c in coordinators) and len(set.union(*coordinators)) == 3
    assert_processes_gone([int(pid) for pid, _ in records.values()], "a rank of an earlier run")

    # Restarts spent: the last failure's status.
    for f in tmp_path.glob("run*-*"):
        f.unlink()
    assert eqxpar.launch.run(script, processes=2, max_restarts=1, timeout=120) == 6
    err = capsys.readouterr().err
    assert "restart 1 of 1: rank 0 exited with status 5" in err
    assert (
        "eqxpar.launch: rank 1 (pid" in err and "all 1 restart(s) used; the last failure's status is 6" in err
    )
    assert_processes_gone([int(f.read_text().split()[0]) for f in tmp_path.glob("run*-*")])


# On SIGTERM, rank k does what argv[k + 1] says: exit 0 (having saved, say), exit 7
# (failing to), or nothing (ignoring it, as a process would that never saves).
_TERMINATED = """
import os, signal, sys, time
rank = int(os.environ["EQXPAR_PROCESS_ID"])
here = os.path.dirname(__file__)
action = sys.argv[1 + rank]
if action == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    status = int(action.removeprefix("exit"))
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.2 * status), os._exit(status)))
with open(os.path.join(here, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(
    "actions,grace,report",
    [
        (["exit0", "ignore"], 2, "rank 0 exited with status 0; rank(s) 1 did not exit within 2 s"),
        (
            ["exit0", "ignore", "exit7"],
            60,
            "rank 0 exited with status 0, rank 2 exited with status 7; rank(s) 1 were still "
            "running after rank 2 failed",
        ),
    ],
)
def test_sigterm_to_the_launcher_is_forwarded_and_the_grace_period_kept(tmp_path, actions, grace, report):
    script = _script(tmp_path, "terminated.py", _TERMINATED)
    command = [sys.executable, "-m", "eqxpar.launch", "-n", str(len(actions)), "--grace-period", str(grace)]
    command += ["--max-restarts", "3", "--timeout", "120", str(script), *actions]
    run = StreamedRun(command, dict(os.environ))
    for rank in range(len(actions)):
        run.wait_for_line(f"[rank {rank}] ready")
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(90) == 128 + signal.SIGTERM, run.output
    # Rank 1 got its grace period, or less once a peer failed; then SIGKILL.
    assert (2 if grace == 2 else 0) <= run.end - sent < 20
    assert (
        f"SIGTERM received: forwarded to the {len(actions)} running process(es); waiting up to {grace} s"
        in (run.output)
    )
    assert f"eqxpar.launch: stopped by SIGTERM: {report} and were killed (SIGKILL)." in run.output
    assert "restart" not in run.output  # a job told to stop is not restarted
    assert_processes_gone([int((tmp_path / f"pid{rank}").read_text()) for rank in range(len(actions))])


def test_a_platform_set_by_the_user_is_kept(tmp_path, capsys, monkeypatch):
    script = _script(
        tmp_path,
        "platform.py",
        """
        import os
        keys = ["JAX_PLATFORMS", "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS"]
        print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
        """,
    )
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nowhere")
    # Real GPUs: the platform stays, and each process drives its own devices.
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS", raising=False)
    assert eqxpar.launch.run(script, processes=2, devices_per_process=2) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "[rank 0] JAX_PLATFORMS=cuda JAX_LOCAL_DEVICE_IDS=0,1 XLA_FLAGS=--xla_dump_to=/tmp/nowhere",
        "[rank 1] JAX_PLATFORMS=cuda JAX_LOCAL_DEVICE_IDS=2,3 XLA_FLAGS=--xla_dump_to=/tmp/nowhere",
    ]
    # Given through `env=`, likewise.
    monkeypatch.delenv("JAX_PLATFORMS")
    assert eqxpar.launch.run(script, processes=1, env={"JAX_PLATFORMS": "rocm"}) == 0
    assert capsys.readouterr().out.startswith("[rank 0] JAX_PLATFORMS=rocm JAX_LOCAL_DEVICE_IDS=0 ")
    # Nothing set: simulated CPU devices.
    assert eqxpar.launch.run(script, processes=1, devices_per_process=3) == 0
    assert capsys.readouterr().out == (
        "[rank 0] JAX_PLATFORMS=cpu JAX_LOCAL_DEVICE_IDS=None "
        "XLA_FLAGS=--xla_dump_to=/tmp/nowhere --xla_force_host_platform_device_count=3\n"
    )


def test_timeout_and_bad_arguments(tmp_path, capsys):
    sleeper = _script(tmp_path, "sleep.py", "import time\ntime.sleep(600)\n")
    start = time.monotonic()
    assert eqxpar.launch.run(sleeper, processes=2, timeout=1) == 124
    assert time.monotonic() - start < 15
    assert "did not finish within 1 s" in capsys.readouterr().err
    with pytest.raises(DistributedError, match=r"processes=0.*>= 1"):
        eqxpar.launch.run(sleeper, processes=0)
    with pytest.raises(DistributedError, match=r"devices_per_process=-4"):
        eqxpar.launch.run(sleeper, processes=1, devices_per_process=-4)
    with pytest.raises(DistributedError, match=r"max_restarts=-1.*>= 0"):
        eqxpar.launch.run(sleeper, processes=1, max_restarts=-1)
    with pytest.raises(DistributedError, match=r"grace_period=-1.*>= 0"):
        eqxpar.launch.run(sleeper, processes=1, grace_period=-1)
    with pytest.raises(DistributedError, match=r"missing\.py' does not exist"):
        eqxpar.launch.run(tmp_path / "missing.py", processes=1)
    with pytest.raises(
        DistributedError, match=r"expected a sequence of arguments, e\.g\. \['--steps', '3'\]"
    ):
        eqxpar.launch.run(sleeper, "--steps 3", processes=1)


def test_command_line(tmp_path, capsys):
    script = _script(tmp_path, "hi.py", "import os\nprint('hi from', os.environ['EQXPAR_PROCESS_ID'])\n")
    ok = subprocess.run(
        [sys.executable, "-m", "eqxpar.launch", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == ["[rank 0] hi from 0", "[rank 1] hi from 1"]
    with pytest.raises(SystemExit) as info:
        eqxpar.launch.main(["-n", "0", str(script)])
    assert info.value.code == 2
    assert "processes=0" in capsys.readouterr().err


def _launch(n, devices, *args):
    return [sys.executable, "-m", "eqxpar.launch", "-n", str(n), "--devices-per-process", str(devices)] + [
        "--timeout",
        "280",
        str(SCRIPT),
        "train",
        *args,
    ]


def test_two_processes_match_one_and_a_killed_run_resumes_exactly(tmp_path):
    # Each run sets its own device count beside the suite's compile flags.
    env = {**os.environ, "XLA_FLAGS": suite_xla_flags()}
    # Later runs reuse the executables earlier ones compiled (same programs): the
    # machine is small and each process compiles the same few steps.
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax-cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    common = ["--steps", "6", "--ckpt-every", "3", "--plan", "fsdp"]

    def files(name):
        return ["--ckpt-dir", str(tmp_path / name), "--metrics-json", str(tmp_path / f"{name}.json")]

    # Three independent runs at once: 1 x 8 without the launcher, 2 x 4 through
    # it, and a 2 x 4 run whose rank 1 dies by SIGKILL after step 4 (its last
    # checkpoint is step 3).
    single = StreamedRun(
        [sys.executable, str(ROOT / "examples" / "multihost.py"), *common, *files("single")]
        + ["--params-out", str(tmp_path / "single.npz")],
        env,
    )
    multi = StreamedRun(
        _launch(2, 4, "--", *common, *files("multi"), "--params-out", str(tmp_path / "multi.npz")), env
    )
    killed = StreamedRun(
        _launch(2, 4, "--die-after-step", "4", "--die-rank", "1", "--", *common, *files("killed")), env
    )
    killed_code = killed.wait()
    # Resumed from its step-3 checkpoint (while the other two still run).
    resumed = StreamedRun(
        _launch(
            2, 4, "--", *common, *files("killed"), "--resume", "--params-out", str(tmp_path / "resumed.npz")
        ),
        env,
    )
    assert single.wait() == 0, single.output[-4000:]
    assert multi.wait() == 0, multi.output[-4000:]

    # 2 processes x 4 devices train exactly like 1 process x 8 devices.
    one = json.loads((tmp_path / "single.json").read_text())
    two = json.loads((tmp_path / "multi.json").read_text())
    assert list(one) == [str(s) for s in range(1, 7)] == list(two)
    assert_trees_close(list(two.values()), list(one.values()))
    a, b = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
    assert sorted(a) == sorted(b)
    # The parameters after AdamW steps, relative to each leaf's scale: the two runs
    # reduce the gradients in different orders (gloo across processes), and AdamW
    # amplifies last-bit differences of near-zero gradients elementwise (see
    # tests/_helpers.py::assert_params_close).
    assert_params_close({k: b[k] for k in b}, {k: a[k] for k in a})
    # Each process fed half of every global batch; only process 0 printed losses.
    assert "[rank 0] [rank 0/2] feeds rows slice(0, 32, None)" in multi.output
    assert "[rank 1] [rank 1/2] feeds rows slice(32, 64, None)" in multi.output
    assert "[rank 0] step 6: loss" in multi.output and "[rank 1] step" not in multi.output

    # The launcher noticed the dead rank, stopped its peer and named it, fast.
    assert killed_code != 0, killed.output[-4000:]
    died_at = min(t for t, line in killed.lines if "[rank 1] [rank 1/2] killing myself with SIGKILL" in line)
    assert killed.end - died_at < 60
    assert "eqxpar.launch: rank 1 (pid" in killed.output and "was killed by signal SIGKILL" in killed.output
    assert "[rank 0] step 4: loss" in killed.output and "[rank 0] step 5: loss" not in killed.output

    # Resumed, it ends bit for bit where the uninterrupted 2 x 4 run ended.
    assert resumed.wait() == 0, resumed.output[-4000:]
    assert "resumed from step 3" in resumed.output
    after = json.loads((tmp_path / "killed.json").read_text())
    assert after == {s: two[s] for s in ("4", "5", "6")}
    c = np.load(tmp_path / "resumed.npz")
    for name in b:
        np.testing.assert_array_equal(c[name], b[name])
