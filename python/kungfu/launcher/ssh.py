"""The ssh command that starts one remote worker.

    ssh -o BatchMode=yes -o ConnectTimeout=T -- HOST 'sh -c '\''<script>'\'''

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

import re
import shlex

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

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


def ssh_command(host, cwd, env, command, connect_timeout=60, kill_after=5):
    """argv for subprocess; write the token and a newline to its stdin, and keep stdin open while it runs."""
    script = remote_script(cwd, env, command, kill_after)
    return [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
        "--",  # HOST is never an option, whatever its spelling (hosts.py refuses a leading '-' too)
        host,
        "sh -c " + shlex.quote(script),
    ]
