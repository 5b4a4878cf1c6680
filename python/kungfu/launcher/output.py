"""Copies worker output to kfrun's stdout/stderr, one whole line at a time, prefixed with the rank.

One thread per pipe reads lines; every write of a line (to either stream) happens under one lock,
so lines of different workers never interleave mid-line. A line longer than MAX_LINE is cut into
pieces, each printed as its own prefixed line, so a worker cannot make kfrun buffer without bound.
With kfrun --output-filename, each pump also copies its lines, unprefixed, to a file of its own.
When kfrun's stdout or stderr is closed (`kfrun ... >&-`), what would go there is dropped, as mpirun does.
"""

import os
import queue
import sys
import threading

MAX_LINE = 1 << 16


class LinePrinter:
    """Writes worker lines (from the pumps, which may block while kfrun's reader is not reading: the
    workers then block too, as under mpirun) and kfrun's own notes (queued; see message())."""

    def __init__(self, stdout=None, stderr=None):
        self._out = stdout if stdout is not None else _binary(sys.stdout)
        self._err = stderr if stderr is not None else _binary(sys.stderr)
        self._lock = threading.Lock()  # one line at a time, whoever writes it
        self._notes = queue.SimpleQueue()  # its put() may be called from a signal handler
        self._notes_writer = threading.Thread(target=self._write_notes, name="kfrun-notes", daemon=True)
        self._notes_writer.start()

    def write_line(self, prefix, line, to_stderr=False):
        """prefix and line are bytes; a newline is added when the line lacks one."""
        if not line.endswith(b"\n"):
            line += b"\n"
        stream = self._err if to_stderr else self._out
        with self._lock:
            try:
                stream.write(prefix + line)
                stream.flush()
            except (OSError, ValueError):
                pass  # our reader went away (e.g. `kfrun ... | head`), or the stream is closed: keep draining

    def message(self, text):
        """kfrun's own note, on stderr. It never blocks: a thread of its own writes it, because kfrun's main
        thread forwards signals and keeps the deadlines, and must not wait on a reader that has stopped
        reading (a paused pager, a full pipe)."""
        self._notes.put(text)

    def _write_notes(self):
        for text in iter(self._notes.get, None):
            self.write_line(b"[kfrun] ", text.encode("utf-8", "replace"), to_stderr=True)

    def close(self, timeout=2.0):
        """Writes the notes still queued, waiting at most timeout seconds for the reader; True if it could."""
        self._notes.put(None)
        self._notes_writer.join(timeout)
        return not self._notes_writer.is_alive()


def _binary(stream):
    """The binary buffer under a text stream; a sink for None, which is what Python makes sys.stdout or
    sys.stderr when that descriptor was closed at start (`>&-`)."""
    return open(os.devnull, "wb") if stream is None else stream.buffer


def _pump(pipe, prefix, printer, to_stderr, copy=None):
    try:
        with pipe:
            for line in iter(lambda: pipe.readline(MAX_LINE), b""):
                printer.write_line(prefix, line, to_stderr)
                if copy is not None:
                    try:
                        copy.write(line)
                        copy.flush()  # a worker's log is complete up to its last line, even if kfrun is killed
                    except (OSError, ValueError) as e:
                        printer.message(f"stopped copying to {copy.name}: {e}")
                        _close_quietly(copy)
                        copy = None
    except (OSError, ValueError):
        pass  # the pipe was closed under us during shutdown
    finally:
        if copy is not None:
            _close_quietly(copy)


def _close_quietly(f):
    try:
        f.close()
    except OSError:
        pass  # the write that failed has been reported


def copy_file(output_dir, rank, to_stderr):
    """The file a pump copies worker rank's stdout or stderr to: output_dir/rank.N/stdout or stderr."""
    return open(os.path.join(output_dir, f"rank.{rank}", "stderr" if to_stderr else "stdout"), "wb")


def start_pump(pipe, rank, printer, to_stderr, copy=None):
    """Starts a daemon thread copying pipe to the printer (and to the binary file copy, which it closes
    at the end); returns it (join with a timeout)."""
    t = threading.Thread(
        target=_pump,
        args=(pipe, f"[{rank}] ".encode(), printer, to_stderr, copy),
        name=f"kfrun-pump-{rank}-{'err' if to_stderr else 'out'}",
        daemon=True,
    )
    t.start()
    return t
