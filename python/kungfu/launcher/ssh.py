"""The ssh command that starts one remote worker.

    ssh -o BatchMode=yes -o ConnectTimeout=T -o ServerAliveInterval=I -o ServerAliveCountMax=3 -- HOST
        'sh -c '\''<script>'\'''

The keepalive options make ssh notice a link that died silently (a cable, a switch, a host that lost
power: no FIN, no RST): without them the client waits forever, and kfrun cannot tell a lost host from a
hung worker. ssh then gives up after about 4 intervals with no answer and exits 255, and kfrun says the
connection was lost. The interval follows --timeout (keepalive_interval): a link the engine would wait
for is waited for here too. Where the user's ssh configuration sets ServerAliveInterval for the host
(`ssh -G` tells), kfrun leaves both options to it.

The script (POSIX sh, whatever the remote login shell) does what `cd CWD && env K=V... cmd` would, plus
two things that plain form cannot:
  1. The job token is read from the first line of stdin, not put on a command line, so it does not
     show in `ps` on either machine.
  2. A watcher holds the rest of stdin. When kfrun closes that pipe, or kfrun or ssh dies (sshd then
     closes it), the watcher sends SIGTERM (and SIGCONT, in case it was stopped) to the worker's
     process group, then SIGKILL after a few seconds. Without a tty, killing ssh alone would leave the
     remote worker running. A line USR1, USR2, STOP or CONT on stdin makes the watcher send that signal
     to the group: that is how kfrun passes those signals on (ssh cannot carry signals without a tty).
The worker runs under setsid (when the remote has it) so its whole process group can be signalled.
Once the worker exits, whatever it left running in that group gets SIGTERM, then SIGKILL, as kfrun
does for local workers. What the worker started in a session of its own (setsid, a daemon) is out of
reach here: sh cannot adopt orphans as kfrun does for local workers (orphans.py); docs/launcher.md says
so. The worker's exit status becomes ssh's (ssh itself fails with 255).
"""

import functools
import re
import shlex
import subprocess
import tempfile

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
KEEPALIVE_COUNT = 3  # ServerAliveCountMax: unanswered keepalives before ssh gives up (and exits 255)

_SCRIPT = """\
cd {cwd} || exit 1
IFS= read -r KUNGFU_TOKEN || {{ echo "kfrun: no job token on stdin" >&2; exit 1; }}
export KUNGFU_TOKEN
{exports}
exec 3<&0
s=; command -v setsid >/dev/null 2>&1 && s=setsid
$s {command} </dev/null 3<&- &
pid=$!
sig() {{ kill -$1 -$pid 2>/dev/null || kill -$1 $pid 2>/dev/null; }}
{{ while IFS= read -r name; do case $name in USR1|USR2|STOP|CONT) sig $name;; esac; done
sig TERM; sig CONT; sleep {kill_after}; sig KILL; }} <&3 >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait $pid
rc=$?
kill $watcher 2>/dev/null
if kill -TERM -$pid 2>/dev/null; then
  kill -CONT -$pid 2>/dev/null
  i=0
  while [ $i -lt {kill_after} ] && kill -0 -$pid 2>/dev/null; do sleep 1; i=$((i+1)); done
  kill -KILL -$pid 2>/dev/null
fi
exit $rc
"""


def check_env_name(name):
    if not _NAME.match(name):
        raise ValueError(f"'{name}' is not a valid environment variable name")
    return name


def remote_script(cwd, env, command, kill_after=5):
    """The sh script run on the remote host. env must not hold KUNGFU_TOKEN (it travels on stdin)."""
    if "KUNGFU_TOKEN" in env:
        raise ValueError("KUNGFU_TOKEN is sent on stdin, not in the remote environment")
    exports = "\n".join(f"export {check_env_name(k)}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return _SCRIPT.format(
        cwd=shlex.quote(cwd),
        exports=exports,
        command=" ".join(shlex.quote(a) for a in command),
        kill_after=max(1, int(kill_after)),
    )


def keepalive_interval(timeout):
    """ServerAliveInterval, in whole seconds, for a job whose KUNGFU_TIMEOUT is timeout: a quarter of it,
    from 1 to 15 s. ssh gives up on a silent link about KEEPALIVE_COUNT + 1 intervals after its last
    answer: within the timeout (for a timeout of 4 s or more), so before kfrun would take a finished
    job's remaining workers for stalled (--timeout + --grace), and at most about a minute."""
    return max(1, min(15, int(timeout // 4)))


@functools.lru_cache(maxsize=256)
def user_sets_keepalive(host):
    """Whether the user's ssh configuration (~/.ssh/config, /etc/ssh/ssh_config) sets ServerAliveInterval
    for host. `ssh -G` prints the configuration that applies, without connecting; an ssh without -G, or
    one that fails, counts as no."""
    # Its output goes to a file, not a pipe, so that nothing it leaves running can hold the answer up.
    with tempfile.TemporaryFile() as f:
        try:
            subprocess.run(["ssh", "-G", "--", host], stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.DEVNULL,
                           timeout=5)
        except (OSError, subprocess.SubprocessError):
            return False
        f.seek(0)
        out = f.read().decode("utf-8", "replace")
    for line in out.splitlines():
        key, _, value = line.strip().partition(" ")
        if key.lower() == "serveraliveinterval":
            return value.strip() not in ("", "0")
    return False


def ssh_command(host, cwd, env, command, connect_timeout=60, kill_after=5, keepalive=True):
    """argv for subprocess; write the token and a newline to its stdin, and keep stdin open while it runs.
    keepalive: add kfrun's ServerAlive options, their interval from connect_timeout (kfrun passes
    --timeout); False where the user's ssh configuration sets them (user_sets_keepalive)."""
    script = remote_script(cwd, env, command, kill_after)
    alive = ["-o", f"ServerAliveInterval={keepalive_interval(connect_timeout)}",
             "-o", f"ServerAliveCountMax={KEEPALIVE_COUNT}"] if keepalive else []
    return [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
        *alive,
        "--",  # HOST is never an option, whatever its spelling (hosts.py refuses a leading '-' too)
        host,
        "sh -c " + shlex.quote(script),
    ]
