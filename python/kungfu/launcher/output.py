"""Copies worker output to kfrun's stdout/stderr, one whole line at a time, prefixed with the rank.

One thread per pipe (a Pump) reads lines; every write of a line happens under a lock (one for both
streams when they go to one file), so lines of different workers never interleave mid-line. A line
longer than MAX_LINE is cut into pieces, each printed as its own prefixed line, so a worker cannot make
kfrun buffer without bound.
With kfrun --output-filename, each pump also copies its lines, unprefixed, to a file of its own.
When kfrun's stdout or stderr is closed (`kfrun ... >&-`), what would go there is dropped, as mpirun does.
When its reader goes away (`kfrun ... | head`: EPIPE), LinePrinter.reader_gone says so and the supervisor
ends the job, as a pipeline ends a command whose reader exited, and as mpirun does.

kfrun writes to its own file descriptors with write_all(): a descriptor that another process sharing it
made non-blocking (O_NONBLOCK) is waited on until it can be written, never taken for a reader that went
away. Once every worker is gone, drain() waits for the pumps to copy all the workers wrote, for as long
as that takes (a slow or paused reader of kfrun's output included); only a pipe that some process the
job left running still holds open is given up, DRAIN_GRACE seconds after everything the workers wrote
has been copied.
"""

import fcntl
import os
import queue
import select
import sys
import termios
import threading
import time

from .exits import signal_name

MAX_LINE = 1 << 16
DRAIN_GRACE = 2.0  # seconds a pipe held open by a leftover process gets to reach its end, once caught up
_READ_SIZE = 1 << 16
_POLL_MS = 500  # a pump's look at whether the workers are gone, while the job runs
_DRAIN_POLL_MS = 100  # once they are: a pipe empty this long holds nothing more of theirs
_PIPE_SIZE_FALLBACK = 1 << 20  # Linux's default /proc/sys/fs/pipe-max-size


def write_all(fd, data):
    """Writes all of data to fd. When fd is non-blocking (O_NONBLOCK, which a process sharing the pipe or
    terminal may set), waits until it can be written instead of failing with EAGAIN. Raises OSError when
    it cannot be written at all (EPIPE: the reader went away; EBADF: closed)."""
    view = memoryview(data)
    busy = False
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            if busy:
                time.sleep(0.005)  # poll said writable, yet it is not: do not spin
            busy = _wait_writable(fd)
            continue
        busy = False
        view = view[n:]


def _wait_writable(fd):
    """Waits (at most a second, then the caller tries again) until fd is writable; returns whether poll
    said so. POLLERR or POLLHUP also end the wait: the next write then raises."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(1000))


class _Sink:
    """One of kfrun's output streams: its file descriptor, written with write_all; a stream without one
    (a test's BytesIO) is written as a stream; None (closed at start: `kfrun ... >&-`) drops everything."""

    def __init__(self, stream):
        self._fd = None
        self._stream = None
        if stream is None:
            return
        try:
            stream.flush()  # what was written through the stream before goes first
        except (OSError, ValueError, AttributeError):
            pass
        try:
            self._fd = stream.fileno()
        except (OSError, ValueError, AttributeError):
            self._stream = getattr(stream, "buffer", stream)

    def same_file(self, other):
        """Whether both write to one file (2>&1, one terminal): True when unknown."""
        if self._fd is None or other._fd is None:
            return self._stream is other._stream
        try:
            a, b = os.fstat(self._fd), os.fstat(other._fd)
        except OSError:
            return True
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def write(self, data):
        if self._fd is not None:
            write_all(self._fd, data)
        elif self._stream is not None:
            self._stream.write(data)
            self._stream.flush()


class LinePrinter:
    """Writes worker lines (from the pumps, which may block while kfrun's reader is not reading: the
    workers then block too, as under mpirun) and kfrun's own notes (queued; see message())."""

    def __init__(self, stdout=None, stderr=None):
        self._out = _Sink(sys.stdout if stdout is None else stdout)
        self._err = _Sink(sys.stderr if stderr is None else stderr)
        # One line at a time, whoever writes it; one lock per destination, so that a reader who stopped
        # reading kfrun's stdout does not hold up what goes to its stderr elsewhere (kfrun's notes).
        self._out_lock = threading.Lock()
        self._err_lock = self._out_lock if self._out.same_file(self._err) else threading.Lock()
        self._notes = queue.SimpleQueue()  # its put() may be called from a signal handler
        self._closed = False
        # "stdout" or "stderr" once a write found that stream's reader gone (EPIPE: `kfrun ... | head`)
        self.reader_gone = None
        self._gave_up = False  # close() stopped waiting on a signal (the notes writer is blocked for good)
        self._notes_writer = threading.Thread(target=self._write_notes, name="kfrun-notes", daemon=True)
        self._notes_writer.start()

    def write_line(self, prefix, line, to_stderr=False):
        """prefix and line are bytes; a newline is added when the line lacks one."""
        self.write_lines(prefix, [line], to_stderr)

    def write_lines(self, prefix, lines, to_stderr=False):
        """Writes each of lines (bytes) with prefix, in one write; a newline is added where one lacks it."""
        data = b"".join(prefix + (line if line.endswith(b"\n") else line + b"\n") for line in lines)
        sink, lock = (self._err, self._err_lock) if to_stderr else (self._out, self._out_lock)
        with lock:
            try:
                sink.write(data)
            except BrokenPipeError:  # our reader went away (`kfrun ... | head`): the job ends (Supervisor)
                if self.reader_gone is None:
                    self.reader_gone = "stderr" if to_stderr else "stdout"
            except (OSError, ValueError):
                pass  # the stream is closed (`kfrun ... >&-`): what would go there is dropped, the job runs on

    def message(self, text):
        """kfrun's own note, on stderr. It never blocks: a thread of its own writes it, because kfrun's main
        thread forwards signals and keeps the deadlines, and must not wait on a reader that has stopped
        reading (a paused pager, a full pipe)."""
        self._notes.put(text)

    def _write_notes(self):
        for text in iter(self._notes.get, None):
            self.write_line(b"[kfrun] ", text.encode("utf-8", "replace"), to_stderr=True)

    def close(self, stopped=None):
        """Writes the notes still queued, waiting as long as the reader takes, as for the workers' output;
        once stopped() (a signal to kfrun) is true, DRAIN_GRACE seconds more at most. True if it could."""
        if not self._closed:
            self._closed = True
            self._notes.put(None)
        if self._gave_up:  # a signal already ended an earlier close's wait: a later one must not wait again
            return False
        while self._notes_writer.is_alive():
            if stopped is not None and stopped():
                self._notes_writer.join(DRAIN_GRACE)
                self._gave_up = self._notes_writer.is_alive()
                break
            self._notes_writer.join(0.05)
        return not self._notes_writer.is_alive()


def _pipe_size(fd):
    try:
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except (AttributeError, OSError):
        return _PIPE_SIZE_FALLBACK


def _unread(fd):
    """Bytes waiting in the pipe fd; None when unknown."""
    try:
        return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)
    except OSError:
        return None


class Pump:
    """Copies one worker pipe to the printer (and to the binary file copy, which it closes at the end),
    in a daemon thread of its own: kfrun-pump-<rank>-out or -err.

    While the job runs it copies until the pipe's end. Once workers_gone() says that no worker's process
    group is left, what is still to come from them is what the pipe holds when the pump sees that (FIONREAD;
    where unknown, at most the pipe's capacity). The pump copies it however long kfrun's reader takes. Then,
    caught up (that much read, or the pipe empty through a poll), it gives the pipe DRAIN_GRACE more
    seconds to reach its end, which it does unless a process the job left running holds it open; then it
    stops, and `dropped` says whether that process was still writing to it."""

    def __init__(self, pipe, rank, printer, to_stderr, copy=None):
        self.what = f"worker {rank}'s {'stderr' if to_stderr else 'stdout'}"
        self.dropped = False  # whether it stopped with data still coming (see above)
        self._pipe = pipe
        self._prefix = f"[{rank}] ".encode()
        self._printer = printer
        self._to_stderr = to_stderr
        self._copy = copy
        self._gone = False  # set by workers_gone()
        self._stop = False  # set by stop(): drop the rest now
        self.thread = threading.Thread(target=self._run, name=f"kfrun-pump-{rank}-{'err' if to_stderr else 'out'}",
                                       daemon=True)
        self.thread.start()

    def workers_gone(self):
        self._gone = True

    def stop(self):
        """Stops copying (a signal to kfrun while it was still writing the workers' output)."""
        self._stop = True

    def _run(self):
        try:
            with self._pipe:
                self._copy_pipe(self._pipe.fileno())
        except (OSError, ValueError):
            pass  # the pipe was closed under us
        finally:
            if self._copy is not None:
                _close_quietly(self._copy)

    def _copy_pipe(self, fd):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        buf = bytearray()
        read = 0  # bytes read from the pipe
        budget = None  # once the workers are gone: read beyond this, the bytes are not theirs
        caught_up = None  # monotonic time, once the workers are gone, everything they wrote was copied
        while not self._stop:
            gone = self._gone
            if gone and budget is None:  # what the workers left is what the pipe holds now
                unread = _unread(fd)
                budget = read + (_pipe_size(fd) + _READ_SIZE if unread is None else unread)
            if budget is not None and read >= budget and caught_up is None:
                caught_up = time.monotonic()
            ready = poller.poll(_DRAIN_POLL_MS if gone else _POLL_MS)
            if caught_up is not None and time.monotonic() - caught_up >= DRAIN_GRACE:
                # A process the job left running holds the pipe open: stop, unless the pipe has just ended.
                if not ready or _unread(fd) != 0:
                    self.dropped = bool(ready)
                    break
            if not ready:
                if gone and caught_up is None:
                    caught_up = time.monotonic()  # empty through a whole poll after the workers were gone
                continue
            data = os.read(fd, _READ_SIZE)
            if not data:
                break  # the end of the pipe
            read += len(data)
            buf += data
            self._emit(buf, final=False)
        if not self._stop:
            self._emit(buf, final=True)  # a last line without a newline

    def _emit(self, buf, final):
        """Writes buf's complete lines (and MAX_LINE pieces; with final, the rest too) and removes them."""
        lines = []
        pos = 0
        while pos < len(buf):
            end = buf.find(b"\n", pos, pos + MAX_LINE)
            if end >= 0:
                stop = end + 1
            elif len(buf) - pos >= MAX_LINE:
                stop = pos + MAX_LINE
            elif final:
                stop = len(buf)
            else:
                break
            lines.append(bytes(buf[pos:stop]))
            pos = stop
        del buf[:pos]
        if lines and not self._stop:
            self._write(lines)

    def _write(self, lines):
        self._printer.write_lines(self._prefix, lines, self._to_stderr)
        if self._copy is not None:
            try:
                self._copy.write(b"".join(lines))
                self._copy.flush()  # a worker's log is complete up to its last line, even if kfrun is killed
            except (OSError, ValueError) as e:
                self._printer.message(f"stopped copying to {self._copy.name}: {e}")
                _close_quietly(self._copy)
                self._copy = None


def drain(pumps, printer, stopped):
    """Waits, once no worker's process group is left, until every pump has copied all that the workers
    wrote (see Pump), however long kfrun's reader takes, unless stopped() (a signal to kfrun, as a
    number) says to stop: then the rest is dropped. Says what was dropped; returns stopped()'s signal or
    None."""
    for p in pumps:
        p.workers_gone()
    while True:
        live = [p for p in pumps if p.thread.is_alive()]
        if not live:
            break
        signum = stopped()
        if signum:
            for p in live:
                p.stop()
            printer.message(f"got {signal_name(signum)} while still writing the workers' output; dropped the "
                            f"rest of {', '.join(p.what for p in live)}")
            return signum
        live[0].thread.join(0.05)
    for p in pumps:
        if p.dropped:
            printer.message(f"stopped copying {p.what} {DRAIN_GRACE:g}s after it had copied all the workers "
                            "wrote: a process the job left running holds it open and still writes to it; what it "
                            "writes from now on is dropped")
    return None


def _close_quietly(f):
    try:
        f.close()
    except OSError:
        pass  # the write that failed has been reported


def copy_file(output_dir, rank, to_stderr):
    """The file a pump copies worker rank's stdout or stderr to: output_dir/rank.N/stdout or stderr."""
    return open(os.path.join(output_dir, f"rank.{rank}", "stderr" if to_stderr else "stdout"), "wb")


def start_pump(pipe, rank, printer, to_stderr, copy=None):
    """Starts a Pump copying pipe to the printer (and to copy); returns it."""
    return Pump(pipe, rank, printer, to_stderr, copy)
