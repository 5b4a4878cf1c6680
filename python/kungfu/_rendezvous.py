"""Rendezvous for jobs started without kfrun (e.g. by mpirun): rank 0 collects every worker's engine
address and hands back the full peer list and the job token.

Protocol (TCP, one connection per worker, messages are a 4-byte big-endian length then UTF-8 JSON,
at most MAX_MESSAGE bytes):
    worker -> rank 0: {"proto", "job", "rank", "size", "peer": "host:port", "proof"?}
    rank 0 -> worker: {"peers": [...], "token"?} or {"error": "...", "timed_out"?: true}
  - "job" is the launcher's job id, so a worker that reaches another job's rank 0 (two jobs whose
    derived ports collide) is refused instead of joining it.
  - When KUNGFU_TOKEN is given to every rank, "proof" is HMAC-SHA256(token, job|rank|peer): rank 0
    checks it and never sends the token. Otherwise rank 0 generates the token and sends it.
  - "timed_out": rank 0's deadline passed before every rank registered. The workers then raise
    TimeoutError, as rank 0 does, so that every rank fails with the same error class.
Rank 0 keeps its listening socket open until every worker has been answered, then closes it.
Every socket operation has a deadline; workers retry connecting while rank 0 is not up yet.
This module imports only the standard library (no TensorFlow), so launchers and tests can use it; its
timeout errors name what sets the deadline (kungfu._env, also standard library only), once.
"""

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time

PROTOCOL = "kungfu-rendezvous/1"
MAX_MESSAGE = 1 << 20
PER_CONNECTION_SECONDS = 10.0  # bound on how long one worker may take to send its registration
_HEADER = struct.Struct("!I")


def _deadline_knob():
    """'KUNGFU_TIMEOUT, set by `mpirun -x KUNGFU_TIMEOUT=S`': the deadline's variable and what sets it under
    this worker's launcher. Said here, where the deadline is named, so that kungfu.init adds it nowhere else."""
    from ._env import timeout_knob  # not at the top: _env imports this module

    return f"KUNGFU_TIMEOUT, set by {timeout_knob()}"


def _timed_out(what):
    return TimeoutError(f"still {what} at the deadline")


def _remaining(deadline, what):
    left = deadline - time.monotonic()
    if left <= 0:
        raise _timed_out(what)
    return left


def _recv_exact(sock, n, deadline, what):
    chunks = []
    while n:
        sock.settimeout(_remaining(deadline, what))
        try:
            chunk = sock.recv(min(n, 1 << 16))
        except socket.timeout:
            raise _timed_out(what) from None
        if not chunk:
            raise ConnectionError(f"connection closed {what}")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(sock, deadline, what="waiting for a rendezvous message"):
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline, what))
    if length > MAX_MESSAGE:
        raise ConnectionError(f"rendezvous message of {length} bytes exceeds the {MAX_MESSAGE}-byte limit")
    try:
        message = json.loads(_recv_exact(sock, length, deadline, what).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConnectionError(f"malformed rendezvous message: {e}") from None
    if not isinstance(message, dict):
        raise ConnectionError("malformed rendezvous message: not a JSON object")
    return message


def send_message(sock, message, deadline, what="sending a rendezvous message"):
    body = json.dumps(message).encode("utf-8")
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"rendezvous message of {len(body)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    sock.settimeout(_remaining(deadline, what))
    try:
        sock.sendall(_HEADER.pack(len(body)) + body)
    except socket.timeout:
        raise _timed_out(what) from None


def proof(token, job, rank, peer):
    return hmac.new(token.encode(), f"{PROTOCOL}|{job}|{rank}|{peer}".encode(), hashlib.sha256).hexdigest()


def listen(address, backlog):
    """Rank 0's listening socket: on the loopback address itself, else on every interface."""
    host, port = address
    bind_host = host if host.startswith("127.") or host == "localhost" else "0.0.0.0"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
        sock.listen(max(16, backlog))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"rank 0 cannot listen for the rendezvous on {bind_host}:{port}: {e.strerror}; another job may "
            "hold that port: pick a free one with mpirun -x KUNGFU_RENDEZVOUS=<rank 0 host>:<port>",
        ) from None
    return sock


class _Server:
    """Rank 0's side: collects registrations, then answers them all."""

    def __init__(self, size, self_peer, job, token, deadline):
        self.size, self.job, self.deadline = size, job, deadline
        self.token_given = bool(token)
        self.token = token or secrets.token_hex(32)
        self.peers = {0: self_peer}
        self.conns = {}  # rank -> socket, registered and waiting for the reply
        self.rejected = []  # why registrations were refused, for the timeout message

    def check(self, msg):
        """Returns (rank, peer) of a valid registration; raises ValueError saying what is wrong."""
        rank, peer = msg.get("rank"), msg.get("peer")
        if msg.get("proto") != PROTOCOL or msg.get("job") != self.job:
            raise ValueError(f"this rendezvous belongs to job '{self.job}' ({PROTOCOL}), not to job "
                             f"'{msg.get('job')}' ({msg.get('proto')}); give each job its own KUNGFU_RENDEZVOUS")
        if not isinstance(rank, int) or not 0 < rank < self.size or msg.get("size") != self.size:
            raise ValueError(f"rank {rank} of size {msg.get('size')} does not fit a job of size {self.size}")
        if rank in self.conns:
            raise ValueError(f"rank {rank} registered twice")
        if not isinstance(peer, str) or not peer or peer in self.peers.values():
            raise ValueError(f"rank {rank} registered a missing or duplicate address {peer!r}")
        got = msg.get("proof")
        if self.token_given != (got is not None):
            raise ValueError(f"rank {rank} {'has' if got else 'lacks'} KUNGFU_TOKEN but rank 0 "
                             f"{'has' if self.token_given else 'lacks'} it; give the same KUNGFU_TOKEN to "
                             "every rank (mpirun -x KUNGFU_TOKEN) or to none")
        if got is not None and not hmac.compare_digest(str(got), proof(self.token, self.job, rank, peer)):
            raise ValueError(f"rank {rank} has a different KUNGFU_TOKEN than rank 0")
        return rank, peer

    def accept_one(self, listener):
        listener.settimeout(_remaining(self.deadline, "accepting"))
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            raise TimeoutError("accepting") from None
        try:
            per_conn = min(self.deadline, time.monotonic() + PER_CONNECTION_SECONDS)
            rank, peer = self.check(recv_message(conn, per_conn))
        except (ValueError, ConnectionError, TimeoutError, OSError) as e:
            self.rejected.append(str(e))
            self.reply(conn, {"error": str(e)})
            return
        self.conns[rank], self.peers[rank] = conn, peer

    def reply(self, conn, message):
        try:
            # Not bounded by self.deadline: after a timeout the workers still deserve to hear why.
            send_message(conn, message, time.monotonic() + PER_CONNECTION_SECONDS)
        except (OSError, TimeoutError):
            pass  # that worker is gone; it fails on its own
        finally:
            conn.close()

    def missing(self):
        return [r for r in range(1, self.size) if r not in self.conns]

    def answer_all(self, message):
        for rank in sorted(self.conns):
            self.reply(self.conns.pop(rank), message)


def serve(listener, size, self_peer, job="", token="", timeout=60.0):
    """Rank 0: waits for ranks 1..size-1 on listener (deadline: timeout); returns (peers, token)."""
    server = _Server(size, self_peer, job, token, time.monotonic() + timeout)
    try:
        while server.missing():
            try:
                server.accept_one(listener)
            except TimeoutError:
                why = f" (refused: {'; '.join(server.rejected)})" if server.rejected else ""
                error = (f"rank(s) {server.missing()} of {size} never registered within {timeout:g}s "
                         f"({_deadline_knob()}){why}; check they were started and can reach rank 0")
                server.answer_all({"error": error, "timed_out": True})
                raise TimeoutError(error) from None
        peers = [server.peers[r] for r in range(size)]
        server.answer_all({"peers": peers} if server.token_given else {"peers": peers, "token": server.token})
        return peers, server.token
    finally:
        server.answer_all({"error": "rank 0 gave up the rendezvous"})


def _connect(address, deadline, rank):
    """Connects to rank 0, retrying while it is not listening yet."""
    delay, last = 0.02, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            return socket.create_connection(address, timeout=min(2.0, left))
        except OSError as e:  # refused while rank 0 starts, or a timeout; both are retried
            last = e
        if deadline - time.monotonic() <= delay:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    raise TimeoutError(f"rank {rank} could not reach rank 0's rendezvous at {address[0]}:{address[1]} before the "
                       f"deadline ({_deadline_knob()}; last error: {last}); is rank 0 running, and is that address "
                       "reachable from here (KUNGFU_RENDEZVOUS)?")


ANSWER_GRACE = 10.0  # seconds a registered rank waits past its own deadline for rank 0's answer (at most timeout)


def register(address, rank, size, peer, job="", token="", timeout=60.0):
    """Rank > 0: registers peer with rank 0 at address; returns (peers, token). Once registered it waits for
    rank 0's answer up to ANSWER_GRACE past its own deadline: rank 0's deadline runs from its own start,
    which may come later, and its answer names the ranks that never registered."""
    deadline = time.monotonic() + timeout
    msg = {"proto": PROTOCOL, "job": job, "rank": rank, "size": size, "peer": peer}
    if token:
        msg["proof"] = proof(token, job, rank, peer)
    where = f"rank 0's rendezvous at {address[0]}:{address[1]}"
    with _connect(address, deadline, rank) as sock:
        send_message(sock, msg, deadline, f"registering with {where}")
        reply = recv_message(sock, deadline + min(ANSWER_GRACE, timeout),
                             f"waiting for {where} to hear from all {size} ranks")
    if "error" in reply:
        if reply.get("timed_out") is True:  # rank 0 raises TimeoutError too: every rank fails alike
            raise TimeoutError(f"{where} gave up on rank {rank}: {reply['error']}")
        raise ConnectionError(f"{where} refused rank {rank}: {reply['error']}")
    peers, got_token = reply.get("peers"), reply.get("token", token)
    if not isinstance(peers, list) or len(peers) != size or peers[rank] != peer or not isinstance(got_token, str):
        raise ConnectionError(f"{where} sent a malformed peer list: {peers!r}")
    return peers, got_token
