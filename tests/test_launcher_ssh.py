"""kfrun's remote workers through ssh: the command it builds, keepalive options, the user's own ssh
configuration, what kfrun says when ssh fails (exit 255), and remote workers that end with the job and
leave nothing behind. Through a fake `ssh` on PATH; no network, no TensorFlow.

Signals to a job with remote workers are in test_launcher_signals.py.
"""

import signal
import subprocess
import sys
import time

import pytest

from kungfu.launcher import ssh
from launcher_util import PID_WORKER, alive, fake_ssh_path, run_kfrun, start_kfrun, wait_for_files, wait_until
from launcher_util import reaper  # noqa: F401  (a fixture)


def _fake_ssh(tmp_path, body):
    """A PATH whose `ssh` runs body (sh)."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n" + body)
    fake.chmod(0o755)
    return f"{fake.parent}:/usr/bin:/bin"


# `ssh -G HOST` prints the configuration that applies (here: a ServerAliveInterval of $FAKE_ALIVE, if
# set); any other call records its options (up to `--`) in $ARGS_FILE and fails as ssh does when the link
# dies: "Timeout, server not responding.", exit 255.
_LOST_LINK = """\
if [ "$1" = -G ]; then [ -n "$FAKE_ALIVE" ] && echo "serveraliveinterval $FAKE_ALIVE"; echo "user root"; exit 0; fi
for a; do [ "$a" = -- ] && break; printf '%s ' "$a"; done > "$ARGS_FILE"
echo "Timeout, server not responding." >&2
exit 255
"""


def test_keepalive_interval_follows_the_timeout():
    """ssh gives up about 4 intervals after the last answer: within --timeout (4 s and more), at most ~60 s."""
    assert [ssh.keepalive_interval(t) for t in (0.5, 1, 4, 8, 30, 60, 600, 1e7)] == [1, 1, 1, 2, 7, 15, 15, 15]
    argv = ssh.ssh_command("h", "/", {}, ["x"], 8)
    assert argv[argv.index("--") - 4:argv.index("--")] == ["-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]
    assert not [a for a in ssh.ssh_command("h", "/", {}, ["x"], 8, keepalive=False) if "ServerAlive" in a]


@pytest.mark.parametrize("printed, sets", [
    ("serveraliveinterval 30\nserveralivecountmax 3\n", True),
    ("ServerAliveInterval 5\n", True),
    ("serveraliveinterval 0\nserveralivecountmax 3\n", False),  # ssh's default: off
    ("", False),  # an ssh without -G
])
def test_user_sets_keepalive_reads_ssh_G(tmp_path, monkeypatch, printed, sets):
    monkeypatch.setenv("PATH", _fake_ssh(tmp_path, f'[ "$1 $2 $3" = "-G -- somehost" ] && printf "{printed}"\n'))
    ssh.user_sets_keepalive.cache_clear()
    try:
        assert ssh.user_sets_keepalive("somehost") is sets
    finally:
        ssh.user_sets_keepalive.cache_clear()


def test_user_sets_keepalive_without_ssh(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh at all: kfrun's options (starting it then fails)
    ssh.user_sets_keepalive.cache_clear()
    try:
        assert ssh.user_sets_keepalive("somehost") is False
    finally:
        ssh.user_sets_keepalive.cache_clear()


@pytest.mark.parametrize("user_alive", ["", "20"])
def test_a_lost_connection_is_named_and_keepalive_is_left_to_the_users_config(tmp_path, reaper, user_alive):
    """kfrun passes its keepalive options unless the user's ssh configuration sets ServerAliveInterval, and
    when ssh fails (255) says that the connection to the host could not be made or was lost."""
    args_file = tmp_path / "ssh_args"
    rc, out, err = run_kfrun(["-np", "1", "-H", "nohost-a.invalid:1", "--timeout", "8", "--", sys.executable, "-c",
                              "pass"], reaper, {"PATH": _fake_ssh(tmp_path, _LOST_LINK), "ARGS_FILE": str(args_file),
                                                "FAKE_ALIVE": user_alive})
    assert rc == 255, err
    options = args_file.read_text()
    if user_alive:
        assert "ServerAlive" not in options, options
    else:
        assert "-o ServerAliveInterval=2 -o ServerAliveCountMax=3 " in options, options
    assert "[0] Timeout, server not responding." in err, err
    assert ("worker 0 (nohost-a.invalid:" in err and "via ssh) failed with exit code 255 (255 is ssh's own failure: "
            "ssh could not connect to nohost-a.invalid, or lost the connection to it" in err), err


def test_ssh_command_construction():
    argv = ssh.ssh_command("10.1.0.2", "/data/my job", {"KUNGFU_RANK": "1"}, ["python", "t.py", "--x=a b"], 30)
    assert argv[:11] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-o", "ServerAliveInterval=7", "-o",
                         "ServerAliveCountMax=3", "--", "10.1.0.2"]  # -- : not an option
    assert argv[11].startswith("sh -c ") and len(argv) == 12
    assert "KUNGFU_TOKEN=" not in argv[11]  # the token travels on stdin
    with pytest.raises(ValueError):
        ssh.ssh_command("h", "/", {"KUNGFU_TOKEN": "t"}, ["x"])
    with pytest.raises(ValueError):
        ssh.ssh_command("h", "/", {"BAD NAME": "t"}, ["x"])


def test_ssh_remote_command_runs_under_a_login_shell(tmp_path, reaper):
    """Runs the remote string as sshd would ($SHELL -c "..."), with no ssh involved."""
    code = "import os,sys; print(os.getcwd(), os.environ['A'], os.environ['KUNGFU_TOKEN'], sys.argv[1]); sys.exit(5)"
    workdir = tmp_path / "dir with 'quotes'"
    workdir.mkdir()
    argv = ssh.ssh_command("h", str(workdir), {"A": "x'y \"z $HOME"}, [sys.executable, "-c", code, "a;b"])
    proc = subprocess.Popen(["sh", "-c", argv[-1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    reaper[1].append(proc)
    proc.stdin.write("secret\n")
    proc.stdin.flush()  # and keep stdin open, as kfrun does: closing it stops the worker
    out = proc.stdout.read()
    assert (proc.wait(timeout=20), out) == (5, f"{workdir} x'y \"z $HOME secret a;b\n")
    proc.stdin.close()


def test_ssh_remote_worker_dies_when_stdin_closes(reaper):
    pid_dir, _ = reaper
    argv = ssh.ssh_command("h", "/", {"KUNGFU_RANK": "0", "PID_DIR": str(pid_dir)}, [sys.executable, "-c", PID_WORKER],
                           kill_after=1)
    proc = subprocess.Popen(["sh", "-c", argv[-1]], stdin=subprocess.PIPE, start_new_session=True)
    reaper[1].append(proc)
    proc.stdin.write(b"secret\n")
    proc.stdin.flush()
    pids = wait_for_files(pid_dir, ["w0", "c0"])
    proc.stdin.close()  # what kfrun does to stop it, and what sshd does when kfrun or ssh dies
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)]


def test_remote_workers_through_fake_ssh(tmp_path, reaper):
    """kfrun's ssh path end to end, with an `ssh` that runs the command here as sshd would."""
    pid_dir, _ = reaper
    out_path = tmp_path / "kfrun.out"
    with open(out_path, "w") as out_file:
        proc = start_kfrun(["-np", "3", "-H", "nohost-a.invalid:2,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                            f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER],
                           reaper, {"PATH": fake_ssh_path(tmp_path)}, stdout=out_file)
    pids = wait_for_files(pid_dir, [f"{k}{r}" for k in "wc" for r in range(3)])
    # A worker writes its pid files before it prints "ready": stop the job only once kfrun has passed on
    # all three lines (it once lost that race on a loaded machine, and the test took it for a lost line).
    wait_until(lambda: out_path.read_text().count("ready\n") == 3, "kfrun has written the 3 workers' ready lines",
               timeout=30)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sorted(out_path.read_text().splitlines()) == ["[0] ready", "[1] ready", "[2] ready"]
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "remote processes left behind"


def test_remote_worker_leaves_no_grandchild(tmp_path, reaper):
    """A remote worker that exits leaves a child running in its (setsid) group: the remote script stops it."""
    pid_dir, _ = reaper
    rc, out, err = run_kfrun(["-np", "2", "-H", "nohost-a.invalid:1,nohost-b.invalid:1", "-x", "PYTHONPATH", "-x",
                              f"PID_DIR={pid_dir}", "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER,
                              "0=exit0", "1=exit0"], reaper, {"PATH": fake_ssh_path(tmp_path)})
    assert rc == 0, err
    pids = wait_for_files(pid_dir, ["c0", "c1"])
    time.sleep(0.2)
    assert not [n for n, pid in pids.items() if alive(pid)], "remote grandchildren left behind"


def test_what_ssh_itself_leaves_running_is_left_alone(tmp_path, reaper):
    """ssh's ControlPersist master outlives the client on purpose, and may serve the user's other sessions:
    kfrun does not take it for a stray of the job, although it is re-parented to kfrun."""
    pid_dir, _ = reaper
    master = ('( exec setsid sh -c \'echo $$ > "$PID_DIR/t$$"; mv "$PID_DIR/t$$" "$PID_DIR/s$$"; exec sleep 60\' ) '
              '</dev/null >/dev/null 2>&1 &\n')
    path = fake_ssh_path(tmp_path, before=master)
    rc, out, err = run_kfrun(["-np", "1", "-H", "nohost-a.invalid:1", "-x", "PYTHONPATH", "-x", f"PID_DIR={pid_dir}",
                              "--kill-after", "1", "--", sys.executable, "-c", PID_WORKER, "0=exit0"], reaper,
                             {"PATH": path})
    assert rc == 0, err
    wait_until(lambda: list(pid_dir.glob("s*")), "the fake ssh's master wrote its pid")
    masters = list(pid_dir.glob("s*"))
    assert len(masters) == 1 and alive(int(masters[0].read_text())), "kfrun killed what ssh left running"
