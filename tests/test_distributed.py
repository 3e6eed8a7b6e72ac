"""eqxpar.distributed: argument checks, single-process behaviour, rank-aware output,
how a failing process exits, and joining a run from a (faked) Slurm environment.

Runs through the launcher are exercised in tests/test_launch.py (a process whose
JAX backend already runs, like pytest's, cannot join a run: they use subprocesses).
"""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import pytest

import eqxpar.distributed as dist
import eqxpar.launch
from eqxpar import EqxparError
from eqxpar.distributed import DistributedError

_CLUSTER_VARS = (
    "EQXPAR_COORDINATOR",
    "EQXPAR_NUM_PROCESSES",
    "EQXPAR_PROCESS_ID",
    "SLURM_JOB_ID",
    "OMPI_MCA_orte_hnp_uri",
    "JAX_COORDINATOR_ADDRESS",
    "KUBERNETES_SERVICE_HOST",
    "TPU_WORKER_HOSTNAMES",
    "TPU_PROCESS_ADDRESSES",
)


@pytest.fixture
def alone(monkeypatch):
    for name in _CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"coordinator_address": "localhost"}, r"coordinator_address='localhost'.*'host:port'"),
        ({"coordinator_address": "10.0.0.1:0"}, r"port 0 is not in 1\.\.65535"),
        ({"coordinator_address": "10.0.0.1:70000"}, r"port 70000"),
        ({"num_processes": 0}, r"num_processes=0.*>= 1"),
        ({"process_id": -1}, r"process_id=-1.*>= 0"),
        ({"num_processes": 2, "process_id": 2}, r"process ids run from 0 to 1"),
    ],
)
def test_initialize_rejects_bad_arguments(alone, kwargs, match):
    with pytest.raises(DistributedError, match=match):
        dist.initialize(**kwargs)


def test_initialize_checks_the_launcher_environment(alone):
    alone.setenv("EQXPAR_NUM_PROCESSES", "two")
    with pytest.raises(DistributedError, match=r"EQXPAR_NUM_PROCESSES='two' is not an integer"):
        dist.initialize()
    alone.setenv("EQXPAR_NUM_PROCESSES", "2")
    alone.setenv("EQXPAR_PROCESS_ID", "1")
    with pytest.raises(DistributedError, match=r"coordinator_address not given.*eqxpar\.launch"):
        dist.initialize()


def test_initialize_alone_is_a_no_op(alone):
    assert dist.initialize() is False
    assert dist.initialize() is False  # repeated calls are safe
    assert dist.initialize(num_processes=1, process_id=0) is False
    assert issubclass(DistributedError, EqxparError)


def test_initialize_after_the_backend_started_says_so(alone):
    # pytest's process already runs JAX computations (conftest), as a notebook might.
    with pytest.raises(DistributedError, match=r"after JAX started its backend.*very start"):
        dist.initialize("127.0.0.1:12345", 2, 0, initialization_timeout=1)


def test_restart_count_reads_the_launcher_then_slurm(alone):
    alone.delenv("EQXPAR_RESTART_COUNT", raising=False)
    alone.delenv("SLURM_RESTART_COUNT", raising=False)
    assert dist.restart_count() == 0
    alone.setenv("SLURM_RESTART_COUNT", "4")
    assert dist.restart_count() == 4
    alone.setenv("EQXPAR_RESTART_COUNT", "2")  # the launcher's, first
    assert dist.restart_count() == 2
    alone.setenv("EQXPAR_RESTART_COUNT", "-1")
    with pytest.raises(DistributedError, match=r"EQXPAR_RESTART_COUNT=-1 is negative"):
        dist.restart_count()
    alone.setenv("EQXPAR_RESTART_COUNT", "once")
    with pytest.raises(DistributedError, match=r"EQXPAR_RESTART_COUNT='once' is not an integer"):
        dist.restart_count()


def test_preemption_guard_alone_stops_on_sigterm(alone):
    before = signal.getsignal(signal.SIGTERM)
    with dist.PreemptionGuard() as guard:
        assert not guard.should_stop(1) and not guard.should_stop(2)
        with pytest.raises(DistributedError, match=r"should_stop\(step=2\) after step 2.*increasing"):
            guard.should_stop(2)
        with pytest.raises(DistributedError, match=r"step=-3.*>= 0"):
            guard.should_stop(-3)
        os.kill(os.getpid(), signal.SIGTERM)  # caught: the test goes on
        assert guard.should_stop(3) and guard.stop_step == 3
        assert guard.should_stop(4) and guard.stop_step == 3  # stays stopped
        assert "stop_step=3" in repr(guard)
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_guard_needs_the_preemption_service_in_a_run(alone):
    # As if initialize() had joined a run without preemption_service=True (which
    # pytest's process, whose backend runs, cannot do).
    alone.setattr(jax.distributed, "is_initialized", lambda: True)
    previous = jax.config.jax_enable_preemption_service
    jax.config.update("jax_enable_preemption_service", False)
    try:
        with pytest.raises(DistributedError, match=r"initialize\(preemption_service=True\)"):
            dist.PreemptionGuard()
    finally:
        jax.config.update("jax_enable_preemption_service", previous)


def test_rank_aware_printing_and_logging(alone, capsys, caplog):
    assert dist.rank_prefix() == "[rank 0/1]"
    assert dist.is_main_process()
    dist.print_once("only on zero")
    dist.log("hello")
    out, err = capsys.readouterr()
    assert out == "only on zero\n"
    assert err == "[rank 0/1] hello\n"

    # Before initialize(), a launched process knows its rank from the environment.
    alone.setenv("EQXPAR_PROCESS_ID", "1")
    alone.setenv("EQXPAR_NUM_PROCESSES", "2")
    assert (dist.process_index(), dist.process_count()) == (1, 2)
    assert not dist.is_main_process()
    dist.print_once("never printed")
    dist.log("from one")
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "[rank 1/2] from one\n"

    logger = dist.get_logger("eqxpar.test")
    with caplog.at_level(logging.INFO, logger="eqxpar.test"):
        logger.info("restored step %d", 3)
        dist.log("via a logger", logger=logging.getLogger("eqxpar.test"), level=logging.WARNING)
    assert [r.getMessage() for r in caplog.records] == [
        "[rank 1/2] restored step 3",
        "[rank 1/2] via a logger",
    ]
    assert caplog.records[1].levelno == logging.WARNING


# A process with the exit hooks of a joined run. The atexit handler stands for
# JAX's, whose shutdown barrier waits for every other process of the run: a
# failing process must skip it, a clean one must run it.
_HOOKED = """
import atexit, sys
from eqxpar.runtime._distributed import _install_exit_hooks
atexit.register(print, "shut down with the others", flush=True)
_install_exit_hooks()
"""

# name: (program, its exit status, what its standard error shows)
_EXITS = {
    "exit": ("def main():\n    sys.exit(7)\nmain()", 7, ""),
    "message": ("sys.exit('bad input: --steps -1')", 1, "bad input: --steps -1"),
    "interrupt": ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),
    # Caught exits and reported exceptions are not the end of the program.
    "caught": (
        textwrap.dedent(
            """
            try:
                sys.exit(3)
            except SystemExit:
                pass
            try:
                raise ValueError("only reported")
            except ValueError:
                sys.excepthook(*sys.exc_info())
            print("carried on", flush=True)
            """
        ),
        0,
        "ValueError: only reported",
    ),
}


def test_a_failing_process_exits_at_once_with_its_status():
    # An uncaught exception is checked through the launcher (tests/test_launch.py).
    env = {k: v for k, v in os.environ.items() if not k.startswith("EQXPAR_")}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _HOOKED + body],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (body, _, _) in _EXITS.items()
    }
    outputs = {name: run.communicate(timeout=60) for name, run in runs.items()}
    for name, (out, err) in outputs.items():
        _, status, message = _EXITS[name]
        assert runs[name].returncode == status, (name, err[-2000:])
        assert message in err, (name, err[-2000:])
        ran_atexit = "shut down with the others" in out
        assert ran_atexit == (status == 0), (name, out)
    assert "carried on" in outputs["caught"][0]


def test_initialize_passes_a_slurm_environment_to_jax():
    # Two processes started as srun would start them (no eqxpar.launch), on this
    # host: initialize() with no arguments joins them through JAX's Slurm detection.
    script = textwrap.dedent(
        """
        import eqxpar.distributed as dist
        assert dist.initialize() is True
        import jax
        print(jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EQXPAR_", "SLURM_"))}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        SLURM_JOB_ID="4242",
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_NTASKS="2",
        # JAX derives the coordinator's port from the job id; a free one instead.
        JAX_COORDINATOR_PORT=str(eqxpar.launch.free_port()),
    )
    start = time.monotonic()
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [run.communicate(timeout=90) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for rank, (run, (out, err)) in enumerate(zip(runs, outputs, strict=True)):
        assert run.returncode == 0, err[-3000:]
        assert out.split() == [str(rank), "2", "4"]
    assert time.monotonic() - start < 60
