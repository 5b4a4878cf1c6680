"""Where workers run: parsing -H and --hostfile, and telling local hosts from remote ones.

A host is "local" when kfrun starts its workers itself (subprocess) instead of through ssh. All local
names (127.0.0.1, localhost, this machine's name or one of its addresses) are one machine: they share
one pool of ports and one LOCAL_RANK numbering.
"""

import codecs
import dataclasses
import ipaddress
import socket

LOCAL_MACHINE = "<local>"  # machine key shared by every name of this machine


class UsageError(ValueError):
    """Bad command-line input; kfrun prints the message and exits with status 2."""


@dataclasses.dataclass(frozen=True)
class HostSpec:
    host: str  # name or IPv4 literal, exactly as it will appear in KUNGFU_PEERS
    slots: int  # how many workers may run there


def _parse_slots(text, where, what="slots"):
    """A positive integer in ASCII digits: not ' 2', '1_0' or full-width digits, which int() would take."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UsageError(f"{where}: {what} must be a positive integer, got '{text}'")
    return int(text)


def _check_host_name(host, where):
    if host.startswith("-"):  # ssh would take it for an option (-F file, -oProxyCommand...)
        raise UsageError(f"{where}: '{host}' is not a host name (a host name cannot start with '-')")
    if not host or any(c in host for c in " \t,:=/@'\"\\$`;&|<>()"):
        raise UsageError(f"{where}: '{host}' is not a host name or IPv4 address")
    return host


def _looks_like_ipv6(entry):
    """[addr]..., anything with '::', or a whole IPv6 address (zone included), but not 'a:2:' or 10.1.0.2:4:1."""
    if entry.startswith("[") or "::" in entry:
        return True
    try:
        return isinstance(ipaddress.ip_address(entry.partition("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def _parse_entry(entry, where):
    """'host:N' or 'host' (1 slot); returns (host, N or None)."""
    if _looks_like_ipv6(entry):
        raise UsageError(f"{where}: '{entry}' looks like an IPv6 address; the engine speaks IPv4 only, so give "
                         "a host name or an IPv4 address")
    if entry.count(":") > 1 or ";" in entry:
        raise UsageError(f"{where}: '{entry}' is not host or host:N (hosts are separated by commas, e.g. "
                         "-H 127.0.0.1:4,10.1.0.2:4)")
    host, sep, slots = entry.partition(":")
    return _check_host_name(host, where), (_parse_slots(slots, where) if sep else None)


def parse_host_list(texts):
    """Parses -H: 'host:N,host:N,...', or a list of such (-H given more than once adds hosts, as with
    OpenMPI's mpirun: `-H a:2 -H b:2` is `-H a:2,b:2`). A host given again adds its slots, as with mpirun
    (`-H a:2,b:1,a` is `-H a:3,b:1`); ranks fill hosts in the order of their first mention."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    slots = {}  # host -> slots, in the order of first mention
    for text in texts:
        entries = [e.strip() for e in text.split(",")]
        if not text.strip() or any(not e for e in entries):
            raise UsageError(f"-H '{text}': expected host:slots[,host:slots...], e.g. -H 127.0.0.1:4,10.1.0.2:4")
        for e in entries:
            host, n = _parse_entry(e, f"-H '{text}'")
            slots[host] = slots.get(host, 0) + (1 if n is None else n)
    return [HostSpec(h, n) for h, n in slots.items()]


_MAX_SLOTS_KEYS = ("max_slots", "max-slots", "slots_max", "slots-max")  # the spellings OpenMPI takes


def _parse_hostfile_line(line, where):
    """'host:N' or 'host' followed by OpenMPI's 'slots=N' and 'max_slots=M' in any order; returns
    (host, N or None, M or None)."""
    fields = line.split()
    host, slots = _parse_entry(fields[0], where)
    max_slots = None
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if not sep or key not in ("slots",) + _MAX_SLOTS_KEYS:
            raise UsageError(f"{where}: expected 'host slots=N [max_slots=M]' or 'host:N', got '{line}'")
        if key == "slots":
            if slots is not None:
                raise UsageError(f"{where}: '{line}' gives the slots of '{host}' twice")
            slots = _parse_slots(value, where)
        else:
            if max_slots is not None:
                raise UsageError(f"{where}: '{line}' gives {key} twice")
            max_slots = _parse_slots(value, where, key)
    return host, slots, max_slots


def parse_hostfile_text(text, name="hostfile"):
    """Parses hostfile lines 'host slots=N [max_slots=M]' or 'host:N' (or 'host'); '#' starts a comment.

    As OpenMPI's mpirun (4.1) reads a hostfile: max_slots alone gives the slots (kfrun never places more
    workers on a host than its slots, so max_slots is only checked: not below slots); a host on several
    lines gets one more slot for each line after its first (the old one-line-per-slot machine files), and
    slots= (or :N) on such a later line is an error, as it is for mpirun."""
    slots = {}  # host -> slots, in the order of first mention
    first_line = {}
    max_slots = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name}:{number}"
        host, n, most = _parse_hostfile_line(line, where)
        if host in slots:
            if n is not None:
                raise UsageError(f"{where}: host '{host}' is already listed on line {first_line[host]}; a "
                                 "repeated line adds one slot, as with mpirun, so it cannot give slots again: "
                                 "give all of the host's slots on one line")
            n = slots[host] + 1
        elif n is None:
            n = most or 1
        if most is not None:
            max_slots[host] = most
        if host in max_slots and max_slots[host] < n:
            raise UsageError(f"{where}: '{host}' has {n} slots, more than its {max_slots[host]} max_slots")
        first_line.setdefault(host, number)
        slots[host] = n
    if not slots:
        raise UsageError(f"{name}: no hosts listed; add lines like '10.1.0.2 slots=4'")
    return [HostSpec(h, n) for h, n in slots.items()]


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
