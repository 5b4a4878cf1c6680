"""Where workers run: parsing -H and --hostfile, and telling local hosts from remote ones.

A host is "local" when kfrun starts its workers itself (subprocess) instead of through ssh. All local
names (127.0.0.1, localhost, this machine's name or one of its addresses) are one machine: they share
one pool of ports and one LOCAL_RANK numbering.
"""

import codecs
import dataclasses
import socket

LOCAL_MACHINE = "<local>"  # machine key shared by every name of this machine


class UsageError(ValueError):
    """Bad command-line input; kfrun prints the message and exits with status 2."""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    host: str  # name or IPv4 literal, exactly as it will appear in KUNGFU_PEERS
    slots: int  # how many workers may run there


def _parse_slots(text, where):
    try:
        slots = int(text)
    except ValueError:
        slots = 0
    if slots < 1:
        raise UsageError(f"{where}: slots must be a positive integer, got '{text}'")
    return slots


def _check_host_name(host, where):
    if host.startswith("-"):  # ssh would take it for an option (-F file, -oProxyCommand...)
        raise UsageError(f"{where}: '{host}' is not a host name (a host name cannot start with '-')")
    if not host or any(c in host for c in " \t,:=/@'\"\\$`;&|<>()"):
        raise UsageError(f"{where}: '{host}' is not a host name or IPv4 address")
    return host


_IPV6_CHARS = set("0123456789abcdefABCDEF:.%")


def _parse_entry(entry, where):
    """'host:N' or 'host' (1 slot)."""
    if entry.startswith("[") or "::" in entry or (entry.count(":") > 1 and set(entry) <= _IPV6_CHARS
                                                  and "." not in entry):  # not 10.1.0.2:4:1
        raise UsageError(f"{where}: '{entry}' looks like an IPv6 address; the engine speaks IPv4 only, so give "
                         "a host name or an IPv4 address")
    if entry.count(":") > 1 or ";" in entry:
        raise UsageError(f"{where}: '{entry}' is not host or host:N (hosts are separated by commas, e.g. "
                         "-H 127.0.0.1:4,10.1.0.2:4)")
    host, sep, slots = entry.partition(":")
    if not sep:
        return HostSpec(_check_host_name(host, where), 1)
    return HostSpec(_check_host_name(host, where), _parse_slots(slots, where))


def _no_duplicates(hosts, where):
    seen = set()
    for h in hosts:
        if h.host in seen:
            raise UsageError(f"{where}: host '{h.host}' is listed twice; give it once with all its slots")
        seen.add(h.host)
    return hosts


def parse_host_list(texts):
    """Parses -H: 'host:N,host:N,...', or a list of such (-H given more than once adds hosts, as with
    OpenMPI's mpirun: `-H a:2 -H b:2` is `-H a:2,b:2`)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    where = " ".join(f"-H '{t}'" for t in texts)
    hosts = []
    for text in texts:
        entries = [e.strip() for e in text.split(",")]
        if not text.strip() or any(not e for e in entries):
            raise UsageError(f"-H '{text}': expected host:slots[,host:slots...], e.g. -H 127.0.0.1:4,10.1.0.2:4")
        hosts.extend(_parse_entry(e, f"-H '{text}'") for e in entries)
    return _no_duplicates(hosts, where)


def _parse_hostfile_line(line, where):
    fields = line.split()
    if len(fields) == 1:
        return _parse_entry(fields[0], where)
    if len(fields) == 2 and fields[1].startswith("slots="):
        return HostSpec(_check_host_name(fields[0], where), _parse_slots(fields[1][len("slots="):], where))
    raise UsageError(f"{where}: expected 'host slots=N' or 'host:N', got '{line}'")


def parse_hostfile_text(text, name="hostfile"):
    """Parses hostfile lines 'host slots=N' or 'host:N'; '#' starts a comment."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_parse_hostfile_line(line, f"{name}:{number}"))
    if not hosts:
        raise UsageError(f"{name}: no hosts listed; add lines like '10.1.0.2 slots=4'")
    return _no_duplicates(hosts, name)


def _decode_hostfile(data, path):
    """UTF-8 text of the file's bytes; a byte-order mark some editors write is dropped."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = data.count(b"\n", 0, at) + 1
        raise UsageError(f"--hostfile {path}: not UTF-8 text: byte 0x{data[at]:02x} at offset {at} (line {line}); "
                         "save it as UTF-8") from None


def parse_hostfile(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"--hostfile {path}: cannot read it: {e.strerror}") from None
    return parse_hostfile_text(_decode_hostfile(data, path), path)


def is_loopback(host):
    h = host.lower()
    return h == "localhost" or h.startswith("127.") or h == "::1"


def _can_bind(host):
    """True when one of host's IPv4 addresses belongs to this machine (binding to it succeeds)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False  # unknown here; ssh may still know it (~/.ssh/config alias)
    for info in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((info[4][0], 0))
                return True
            except OSError:
                continue
    return False


def is_local(host):
    if is_loopback(host):
        return True
    name = socket.gethostname().lower()
    if host.lower() in (name, name.split(".")[0]):
        return True
    return _can_bind(host)


def machine_key(host, local_check=is_local):
    """Hosts with the same key are one machine (shared ports and LOCAL_RANK numbering)."""
    return LOCAL_MACHINE if local_check(host) else host.lower()


def check_reachable_names(names, local_check=is_local):
    """Refuses a loopback name in a job that also has remote hosts: they could not reach it."""
    names = list(dict.fromkeys(names))
    remote = [h for h in names if not local_check(h)]
    loop = [h for h in names if is_loopback(h)]
    if remote and loop:
        raise UsageError(
            f"host '{loop[0]}' is a loopback name, which the remote hosts ({', '.join(remote)}) cannot reach; "
            "name this machine by an address they can reach (its LAN address, not a loopback name)"
        )
