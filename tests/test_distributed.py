"""eqxpar.distributed: argument checks, single-process behaviour, rank-aware output.

Joining a real multi-process run is exercised in tests/test_launch.py, through
the launcher (a process whose JAX backend already runs, like pytest's, cannot join).
"""

import logging

import pytest

import eqxpar.distributed as dist
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
