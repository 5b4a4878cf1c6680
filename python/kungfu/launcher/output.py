"""Copies worker output to kfrun's stdout/stderr, one whole line at a time, prefixed with the rank.

One thread per pipe reads lines; every write of a line (to either stream) happens under one lock,
so lines of different workers never interleave mid-line. A line longer than MAX_LINE is cut into
pieces, each printed as its own prefixed line, so a worker cannot make kfrun buffer without bound.
"""

import sys
import threading

MAX_LINE = 1 << 16


class LinePrinter:
    def __init__(self, stdout=None, stderr=None):
        self._out = stdout if stdout is not None else sys.stdout.buffer
        self._err = stderr if stderr is not None else sys.stderr.buffer
        # Reentrant: kfrun's signal handler prints from the main thread, which may hold it already.
        self._lock = threading.RLock()

    def write_line(self, prefix, line, to_stderr=False):
        """prefix and line are bytes; a newline is added when the line lacks one."""
        if not line.endswith(b"\n"):
            line += b"\n"
        stream = self._err if to_stderr else self._out
        with self._lock:
            try:
                stream.write(prefix + line)
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # our reader went away (e.g. `kfrun ... | head`); keep draining the worker

    def message(self, text):
        """kfrun's own notes, on stderr."""
        self.write_line(b"[kfrun] ", text.encode("utf-8", "replace"), to_stderr=True)


def _pump(pipe, prefix, printer, to_stderr):
    try:
        with pipe:
            for line in iter(lambda: pipe.readline(MAX_LINE), b""):
                printer.write_line(prefix, line, to_stderr)
    except (OSError, ValueError):
        pass  # the pipe was closed under us during shutdown


def start_pump(pipe, rank, printer, to_stderr):
    """Starts a daemon thread copying pipe to the printer; returns it (join with a timeout)."""
    t = threading.Thread(
        target=_pump,
        args=(pipe, f"[{rank}] ".encode(), printer, to_stderr),
        name=f"kfrun-pump-{rank}-{'err' if to_stderr else 'out'}",
        daemon=True,
    )
    t.start()
    return t
