"""How kfrun names a worker's exit: its code as a shell reports it, the signal that killed it."""

import signal


def exit_code(returncode):
    """A worker's exit code as a shell reports it: a death by signal N is 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum):
    """SIGSEGV for 11, or "an unknown signal"."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "an unknown signal"


# After a remote worker's exit code 255: ssh's own failure (its message, on the worker's stderr, says which).
SSH_FAILED = (" (255 is ssh's own failure: ssh could not connect to {host}, or lost the connection to it (the host "
              "or the network went down, or stopped answering); check that this machine can `ssh -o BatchMode=yes "
              "{host}`)")


def describe_exit(returncode, is_local=True):
    """'exit code 7', or for a worker killed by a signal, 'exit code 139: killed by signal 11 (SIGSEGV)'."""
    code = exit_code(returncode)
    if returncode < 0:
        return f"exit code {code}: killed by signal {-returncode} ({signal_name(-returncode)})"
    if not is_local and 128 < code < 128 + 65:  # the remote shell reports a signal N as 128+N
        return f"exit code {code} (128+{code - 128}: killed by signal {code - 128}, {signal_name(code - 128)}?)"
    return f"exit code {code}"
