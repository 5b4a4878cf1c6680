"""kfrun's ssh client and a link that dies: keepalive options, the user's own ssh configuration, and what
kfrun says when ssh fails (exit 255). Through a fake `ssh` on PATH; no network, no TensorFlow.

The rest of the ssh path (the remote script, signals, what is left running) is in test_launcher.py and
test_launcher_signals.py.
"""

import sys

import pytest

from kungfu.launcher import ssh
from launcher_util import run_kfrun
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
