"""kfrun's input: bad arguments and hostfiles (a clear error each), hosts and host lists read as OpenMPI
reads them, the plan of ports and ranks, and the worker environment it hands on (kungfu._env). Helpers
and the `reaper` fixture are in launcher_util.py (see test_launcher.py)."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kungfu import _env as env_mod
from kungfu import _lib
from kungfu import errors
from kungfu.launcher import cli
from kungfu.launcher import hosts
from kungfu.launcher import plan
from launcher_util import PYTHONPATH, run_kfrun
from launcher_util import reaper  # noqa: F401  (a fixture)


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "--", "x"], "-np must be at least 1"),
    (["--", "x"], "-np is required"),
    (["-np", "2"], "no worker command"),
    (["-np", "5", "-H", "127.0.0.1:4", "--", "x"], "-np 5 needs 5 slots but the hosts give 4"),
    (["-np", "1", "-H", "a:b", "--", "x"], "slots must be a positive integer"),
    (["-np", "1", "-H", "a:1,,b:1", "--", "x"], "expected host:slots"),
    (["-np", "1", "--hostfile", "/nonexistent/hosts", "--", "x"], "cannot read it"),
    (["-np", "1", "-H", "a:1", "--hostfile", "f", "--", "x"], "either -H or --hostfile"),
    (["-np", "1", "--port-range", "20-10", "--", "x"], "--port-range '20-10'"),
    (["-np", "1", "--timeout", "0", "--", "x"], "--timeout must be between 0.001 and 1e+07 seconds"),
    (["-np", "1", "--", ""], "the worker command's program name is empty"),
    (["-np", "two", "--", "x"], "--np=two"),
    (["-np", "1", "--bogus", "--", "x"], "bogus"),
    (["-np", "2", "-H", "127.0.0.1:1,nohost.invalid:1", "--", "x"], "loopback name"),
    (["-np", "1", "-H", "[::1]:1", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "fe80::1", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "2001:4860:4860::8888", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "fe80:0:0:0:0:0:0:1%eth0", "--", "x"], "IPv6"),
    (["-np", "1", "-H", "a:2:", "--", "x"], "'a:2:' is not host or host:N"),  # not IPv6: a stray colon
    (["-np", "2", "-H", "10.1.0.1:1;10.1.0.2:1", "--", "x"], "hosts are separated by commas"),
    (["-np", "1", "-H", "10.1.0.1:2:3", "--", "x"], "is not host or host:N"),
    (["-np", "2", "-H", "10.1.0.1", "slots=2", "--", "x"], "-H takes host:N"),
    (["-np", "1", "--timeout", "1e10", "--", "x"], "--timeout must be between"),
    (["-np", "1", "--timeout", "0.0001", "--", "x"], "--timeout must be"),
    (["-np", "1", "--grace", "nan", "--", "x"], "--grace must not be negative"),
    (["-np", "1", "--kill-after", "inf", "--", "x"], "--kill-after must be positive"),
    (["-np", "1", "-x", "KUNGFU_RANK=0", "--", "x"], "kfrun sets KUNGFU_RANK for each worker itself"),
    (["-np", "1", "-x", "KUNGFU_TIMEOUT=5", "--", "x"], "use --timeout"),
    (["-np", "1", "-H=-Fevil:1", "--", "x"], "'-Fevil' is not a host name (a host name cannot start with '-')"),
    (["-np", "2", "-H", "-oProxyCommand=x", "--", "x"], "cannot start with '-'"),
    (["-np", "1", "-H", "127.0.0.1: 2", "--", "x"], "slots must be a positive integer, got ' 2'"),
    (["-np", "1", "-H", "127.0.0.1:1_0", "--", "x"], "slots must be a positive integer, got '1_0'"),
    (["-np", "1", "-H", "127.0.0.1:\uff12", "--", "x"], "slots must be a positive integer, got '\uff12'"),
    (["-np", "1", "--grace", "1e300", "--", "x"],
     "--grace must not be negative and at most 10000010 seconds, got 1e+300"),  # not 1e+07: 10^7 + 10
])
def test_bad_arguments(args, message, reaper):
    rc, out, err = run_kfrun(args, reaper)
    assert rc == 2 and message in err and "kfrun --help" in err, err


@pytest.mark.parametrize("content, message", [
    (b"-Fevil slots=1\n", "hosts:1: '-Fevil' is not a host name (a host name cannot start with '-')"),
    (b"node1 slots=2 # caf\xe9\n", "not UTF-8 text: byte 0xe9 at offset 19 (line 1)"),
    (b"\xef\xbb\xbfnode1:1\nnode2:1 # \xff\n", "not UTF-8 text: byte 0xff at offset 21 (line 2)"),
])
def test_bad_hostfile(content, message, reaper, tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(content)
    rc, out, err = run_kfrun(["-np", "1", "--hostfile", str(path), "--", "true"], reaper)
    assert rc == 2 and message in err and "kfrun --help" in err and "Traceback" not in err, err


def test_repeated_h_adds_hosts_as_mpirun_does():
    opts = cli.parse_args(["kfrun", "-np", "3", "-H", "10.1.0.1:2", "-H", "10.1.0.2", "--", "x"])
    assert opts.hosts == [hosts.HostSpec("10.1.0.1", 2), hosts.HostSpec("10.1.0.2", 1)]


def test_kungfu_timeout_in_the_environment_is_the_default(reaper):
    code = "import os; print(os.environ['KUNGFU_TIMEOUT'])"
    rc, out, err = run_kfrun(["-np", "1", "--", sys.executable, "-c", code], reaper, {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 300\n"), err
    rc, out, err = run_kfrun(["-np", "1", "--timeout", "7", "--", sys.executable, "-c", code], reaper,
                             {"KUNGFU_TIMEOUT": "300"})
    assert (rc, out) == (0, "[0] 7\n"), err
    for value in ("soon", "0", "1e8", "inf"):  # the error names the variable the user set, not --timeout
        rc, out, err = run_kfrun(["-np", "1", "--", "true"], reaper, {"KUNGFU_TIMEOUT": value})
        assert rc == 2 and f"KUNGFU_TIMEOUT={value!r} is not a number of seconds from 0.001 to 1e+07" in err, err
        assert "--timeout must" not in err, err


def test_timeout_range_is_the_workers():
    """kfrun accepts exactly the --timeout values its workers (kungfu._env) accept as KUNGFU_TIMEOUT."""
    for value in (0.0009, 0.001, 1.5, 1e7, 1.0000001e7):
        try:
            took = cli.parse_args(["kfrun", "-np", "1", "--timeout", repr(value), "--", "x"]).timeout
        except hosts.UsageError:
            took = None
        try:
            wanted = env_mod.parse_timeout(repr(value))
        except ValueError:
            wanted = None
        assert took == wanted, value


def test_x_sets_the_variable_for_every_worker(reaper):
    code = "import os; print(os.environ['FOO'], os.environ['KUNGFU_RING_THRESHOLD'])"
    rc, out, err = run_kfrun(["-np", "2", "-x", "FOO=bar", "-x", "KUNGFU_RING_THRESHOLD=0", "--", sys.executable,
                              "-c", code], reaper, {"FOO": "inherited"})
    assert rc == 0, err
    assert sorted(out.splitlines()) == ["[0] bar 0", "[1] bar 0"]


def test_command_not_found(reaper):
    rc, out, err = run_kfrun(["-np", "2", "--", "/nonexistent/program"], reaper)
    assert rc == 127 and "cannot start worker 0: /nonexistent/program" in err


@pytest.mark.parametrize("kind, code, why", [
    ("no execute permission", 126, "Permission denied"),
    ("directory", 126, "it is a directory"),
    ("missing #! interpreter", 127, "its interpreter '/nonexistent/interp', named in its #! line, was not found"),
])
def test_a_program_that_cannot_be_executed(kind, code, why, reaper, tmp_path):
    """126 when the program is there but cannot be executed, 127 when it (or its interpreter) is not: as sh."""
    program = tmp_path / "prog"
    if kind == "directory":
        program.mkdir()
    else:
        program.write_text("#!/nonexistent/interp\necho hi\n" if kind.startswith("missing") else "#!/bin/sh\necho hi\n")
        program.chmod(0o644 if kind.startswith("no execute") else 0o755)
    rc, out, err = run_kfrun(["-np", "2", "--", str(program)], reaper)
    assert rc == code and f"cannot start worker 0: {program}: {why}" in err, err


def test_help(reaper):
    rc, out, err = run_kfrun(["--help"], reaper)
    assert rc == 0 and "usage: kfrun" in out and "--port-range" in out


def test_parse_hostfile():
    text = "# cluster\n10.1.0.1 slots=4  # first\n\n10.1.0.2:2\nnode3\n"
    assert hosts.parse_hostfile_text(text) == [
        hosts.HostSpec("10.1.0.1", 4), hosts.HostSpec("10.1.0.2", 2), hosts.HostSpec("node3", 1)]
    for bad, message in [("h slots=0", "hostfile:1: slots must be"), ("a:1\nh cores=2", "hostfile:2: expected"),
                         ("a:1\na slots=2", "hostfile:2: host 'a' is already listed on line 1"),
                         ("# none\n", "no hosts listed"), ("a b c", "expected")]:
        with pytest.raises(hosts.UsageError, match=message):
            hosts.parse_hostfile_text(bad)


def test_slot_counts_are_ascii_digits():
    """int() takes ' 2', '1_0' and other scripts' digits; a slot count is ASCII digits only."""
    for bad in [" 2", "1_0", "\uff12", "\u0663", "+2", "0x2", "2.0", "0"]:
        with pytest.raises(hosts.UsageError, match="slots must be a positive integer"):
            hosts.parse_host_list(f"a:{bad}")
        with pytest.raises(hosts.UsageError, match="slots must be a positive integer"):
            hosts.parse_hostfile_text(f"a slots={bad}")
    assert hosts.parse_host_list("a:012") == [hosts.HostSpec("a", 12)]


def test_hosts_are_read_as_openmpi_reads_them():
    """mpirun (4.1): max_slots=M is allowed (alone it gives the slots; slots above it are an error); a host on
    another hostfile line gets one more slot, but slots= on that line is an error; -H a:2,a adds up to 3."""
    parse, host = hosts.parse_hostfile_text, hosts.HostSpec
    assert parse("a slots=2 max_slots=4") == [host("a", 2)]
    assert parse("a max_slots=3\nb max-slots=2 slots=1\nc:2 slots_max=2") == [host("a", 3), host("b", 1), host("c", 2)]
    assert parse("a\nb slots=2\na\na  # one line per slot\nb") == [host("a", 3), host("b", 3)]
    for bad, message in [("a slots=3 max_slots=2", "hostfile:1: 'a' has 3 slots, more than its 2 max_slots"),
                         ("a slots=2\na slots=2", "hostfile:2: host 'a' is already listed on line 1"),
                         ("a:2\nb\na:1", "hostfile:3: host 'a' is already listed on line 1"),
                         ("a slots=2 max_slots=2\na", "hostfile:2: 'a' has 3 slots, more than its 2 max_slots"),
                         ("a slots=2 slots=3", "gives the slots of 'a' twice"),
                         ("a max_slots=x", "max_slots must be a positive integer"),
                         ("a slots=2 foo", "expected 'host slots=N"), ("a cpus=2", "expected 'host slots=N")]:
        with pytest.raises(hosts.UsageError, match=re.escape(message)):
            parse(bad)
    assert hosts.parse_host_list(["a:2,b", "a"]) == [host("a", 3), host("b", 1)]
    opts = cli.parse_args(["kfrun", "-np", "2", "-H", "127.0.0.1:1", "-H", "127.0.0.1:1", "--", "x"])
    assert opts.hosts == [host("127.0.0.1", 2)]


def test_parse_hostfile_drops_a_byte_order_mark(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes("\ufeffnode1 slots=2\n".encode("utf-8"))
    assert hosts.parse_hostfile(str(path)) == [hosts.HostSpec("node1", 2)]


def test_parse_host_list():
    assert hosts.parse_host_list("127.0.0.1:4,10.1.0.2:4") == [
        hosts.HostSpec("127.0.0.1", 4), hosts.HostSpec("10.1.0.2", 4)]
    assert hosts.parse_host_list("node") == [hosts.HostSpec("node", 1)]
    assert hosts.parse_host_list(["a:1", "b:2,c"]) == [
        hosts.HostSpec("a", 1), hosts.HostSpec("b", 2), hosts.HostSpec("c", 1)]
    for bad in ["", "a:", "a:-1", "a:1,", "a b:1", "a:1:2", "-F:1", "-oProxyCommand=x", ["a:1", ""]]:
        with pytest.raises(hosts.UsageError):
            hosts.parse_host_list(bad)


def test_is_local():
    assert hosts.is_local("127.0.0.1") and hosts.is_local("localhost")
    assert not hosts.is_local("nohost.invalid") and not hosts.is_local("192.0.2.254")


def test_plan_fills_hosts_in_order():
    local = {"127.0.0.1": True, "localhost": True, "10.1.0.2": False, "10.1.0.3": False}.__getitem__
    spec = [hosts.HostSpec("127.0.0.1", 2), hosts.HostSpec("10.1.0.2", 2), hosts.HostSpec("localhost", 1),
            hosts.HostSpec("10.1.0.3", 9)]
    busy = {10001}
    workers = plan.plan_workers(spec, 6, (10000, 10010), local_check=local, port_free=lambda p: p not in busy,
                                start=0)
    got = [(w.rank, w.addr, w.local_rank, w.local_size, w.is_local) for w in workers]
    assert got == [
        (0, "127.0.0.1:10000", 0, 3, True), (1, "127.0.0.1:10002", 1, 3, True),  # 10001 is taken
        (2, "10.1.0.2:10000", 0, 2, False), (3, "10.1.0.2:10001", 1, 2, False),
        (4, "localhost:10003", 2, 3, True),  # same machine as 127.0.0.1: shares its ports
        (5, "10.1.0.3:10000", 0, 1, False)]
    with pytest.raises(hosts.UsageError, match="widen --port-range"):
        plan.plan_workers(spec[:1], 2, (10000, 10001), local_check=local, port_free=lambda p: p != 10001, start=0)


def test_plan_starts_at_a_random_port_and_wraps_around():
    """Two jobs started together with the same --port-range must not both take its first ports."""
    local = {"127.0.0.1": True, "10.1.0.2": False}.__getitem__
    spec = [hosts.HostSpec("127.0.0.1", 3), hosts.HostSpec("10.1.0.2", 2)]
    workers = plan.plan_workers(spec, 5, (10000, 10003), local_check=local, port_free=lambda p: p != 10000, start=2)
    assert [w.port for w in workers] == [10002, 10003, 10001, 10002, 10003]  # 10000 is taken here, not there
    with pytest.raises(hosts.UsageError, match="widen --port-range"):
        plan.plan_workers(spec[:1], 3, (10000, 10002), local_check=local, port_free=lambda p: p != 10001, start=2)
    firsts = {plan.plan_workers(spec, 5, (10000, 10999), local_check=local, port_free=lambda p: True)[0].port
              for _ in range(20)}
    assert len(firsts) > 1, firsts  # 20 equal draws from 1000 places: about 1e-57
    for _ in range(20):
        workers = plan.plan_workers(spec, 5, (10000, 10003), local_check=local, port_free=lambda p: True)
        ports = [w.port for w in workers]
        assert len(set(ports[:3])) == 3 and len(set(ports[3:])) == 2  # distinct on each host


def test_a_port_is_free_again_once_its_job_ended():
    """A port that a job's engine listened on stays in TIME_WAIT for a minute after the job; the engine
    binds with SO_REUSEADDR, so the next job may take it (tests run one job after another in one range)."""
    import socket
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not plan.port_is_free(port)  # listening: taken
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = listener.accept()
            served.close()  # the listening side closes first: its end of the connection goes to TIME_WAIT
            client.recv(1)
    with open("/proc/net/tcp") as table:  # local address "0100007F:PORT", state 06 is TIME_WAIT
        states = [line.split()[3] for line in table.readlines()[1:] if line.split()[1].endswith(f":{port:04X}")]
    assert "06" in states, states
    assert plan.port_is_free(port)


def test_init_errors_name_the_kfrun_flag_that_fixes_them():
    cluster = SimpleNamespace(rank=1, size=2, launcher="kfrun")
    text = "listening as 127.0.0.1:25002 (rank 1): bind port 25002: Address already in use"
    message = _lib._init_error_message(14, cluster, text)
    assert message.startswith("kungfu.init (rank 1 of 2): listening as") and "`kfrun --port-range A-B`" in message
    assert "`kfrun --timeout`" in _lib._init_error_message(4, cluster, "peer 127.0.0.1:25001 (rank 0): not up")
    timeout = "allreduce 'g': timed out after 5 s (KUNGFU_TIMEOUT); waiting for rank 1"
    e = errors.from_code(4, timeout)
    assert "(KUNGFU_TIMEOUT, set by `kfrun --timeout`); waiting for rank 1" in str(e), str(e)
    assert str(errors.from_code(14, timeout)) == timeout  # not a timeout: left alone


_SAME = "WARNING:kungfu:kungfu.finalize: not every worker reached finalize (why); leaving anyway\n"


@pytest.mark.parametrize("setup, expected", [
    ("", _SAME),  # nothing configured: logging's last resort would print the bare message
    ("logging.basicConfig()", _SAME),
    ("from absl import logging as absl_logging\nabsl_logging.info('x')", _SAME),  # absl calls basicConfig()
    ("logging.basicConfig(format='%(levelname)s|%(message)s')", "WARNING|" + _SAME.split(":", 2)[2]),
    ("logging.getLogger('kungfu').setLevel(logging.ERROR)", ""),
], ids=["nothing", "basicConfig", "absl", "own format", "silenced"])
def test_finalize_warnings_read_the_same_on_every_rank(setup, expected):
    """A rank where TF or Keras logged through absl (which configures the root logger)
    and one where nothing did print kungfu's finalize warning alike; a program's own configuration wins."""
    code = (f"import logging\n{setup}\nfrom kungfu import _lib\n"
            "_lib._warn('kungfu.finalize: not every worker reached finalize (%s); leaving anyway', 'why')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    assert (done.returncode, done.stderr) == (0, expected)


def test_plan_skips_a_port_in_use():
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (port, min(port + 50, 65535)))
    assert port not in [w.port for w in workers]


def test_worker_env_contract():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 2)], 2, (10000, 10100), port_free=lambda p: True,
                                start=0)
    env = plan.worker_env(workers[1], workers, "tok", 12.5, environ={})
    assert env == {"KUNGFU_PEERS": "127.0.0.1:10000,127.0.0.1:10001", "KUNGFU_RANK": "1", "KUNGFU_SIZE": "2",
                   "KUNGFU_LOCAL_RANK": "1", "KUNGFU_LOCAL_SIZE": "2", "KUNGFU_TOKEN": "tok",
                   "KUNGFU_TIMEOUT": "12.5", "KUNGFU_CLUSTER_VERSION": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    for timeout, said in ((1234567, "1234567"), (100.123456789, "100.123456789"), (7.0, "7")):
        assert plan.worker_env(workers[1], workers, "tok", timeout, environ={})["KUNGFU_TIMEOUT"] == said


def test_worker_defaults_yield_to_the_callers_environment():
    workers = plan.plan_workers([hosts.HostSpec("127.0.0.1", 1)], 1, (10000, 10100), port_free=lambda p: True)
    env = plan.worker_env(workers[0], workers, "tok", 1, environ={"TF_CPU_ALLOCATOR_USE_BFC": "false"})
    assert "TF_CPU_ALLOCATOR_USE_BFC" not in env  # the worker inherits the caller's "false"


@pytest.mark.parametrize("env, message", [
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "2"}, "KUNGFU_RANK=2 is out of range"),
    ({"KUNGFU_PEERS": "a:1,b:2"}, "KUNGFU_RANK is not set"),
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "x"}, "KUNGFU_RANK='x' is not an integer"),
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "0", "KUNGFU_SIZE": "3"}, "KUNGFU_SIZE=3 but"),
    ({"KUNGFU_PEERS": "a:1,a:1", "KUNGFU_RANK": "0"}, "lists a:1 twice"),
    ({"KUNGFU_PEERS": "a:99999", "KUNGFU_RANK": "0"}, "KUNGFU_PEERS: 'a:99999'"),
    ({"KUNGFU_PEERS": "a:1", "KUNGFU_RANK": "0", "KUNGFU_LOCAL_RANK": "1"}, "KUNGFU_LOCAL_RANK=1"),
    ({"KUNGFU_PEERS": "a:1", "KUNGFU_RANK": "0", "KUNGFU_TIMEOUT": "-1"}, "KUNGFU_TIMEOUT"),
    ({"KUNGFU_RANK": "0"}, "KUNGFU_RANK is set but KUNGFU_PEERS is not"),
    ({"KUNGFU_PEERS": "a:1,b:2", "KUNGFU_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     "one launcher was started inside the other"),  # kfrun ... mpirun -np 2 python3 ..., or the reverse
])
def test_resolve_cluster_rejects_bad_kfrun_variables(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        env_mod.resolve_cluster(env)


def test_kfrun_refuses_to_run_as_one_of_several_mpirun_ranks(reaper):
    code, out, err = run_kfrun(["-np", "1", "--", sys.executable, "-c", "print('ran')"], reaper,
                               extra_env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert code == 2 and "ran" not in out and "one of 2 OpenMPI ranks" in err, (code, out, err)
    code, out, _ = run_kfrun(["-np", "1", "--", sys.executable, "-c", "print('ran')"], reaper,
                             extra_env={"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"})
    assert code == 0 and "ran" in out  # mpirun -np 1 kfrun ...: one job


def test_resolve_cluster_defaults():
    spec = env_mod.resolve_cluster({"KUNGFU_PEERS": "h:1,g:2,h:3", "KUNGFU_RANK": "2"})
    assert (spec.size, spec.local_rank, spec.local_size, spec.token, spec.timeout) == (3, 1, 2, "", 60.0)
    lone = env_mod.resolve_cluster({})
    assert (lone.peers, lone.rank, lone.size, lone.token) == ([], 0, 1, "")
