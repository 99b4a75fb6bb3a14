"""The hook's fast path: hand the run to a resident ``nvcontainer serve`` when one is listening.

A container start waits for the hook, and most of a cold hook run is the interpreter importing
the code it is about to run (see docs/performance.md). A resident server has everything
imported and the inventory warm; this client only passes it what the hook would have had:
its argv, its umask, two variables of its environment, and its stdin, stdout, stderr and
working directory as file descriptors (``SCM_RIGHTS``). The server forks, reads the OCI state from
that very stdin and runs the same ``nvcontainer-hook`` code, so output, exit status, errors and
``--debug`` traces are the same as in-process; only the time differs.

When nothing listens, or the server declines (it runs in another mount, PID, cgroup or user
namespace or another root than this hook, so the container's PID or paths would mean
something else to it), the run happens here, in this process, exactly as without a server.
The server declines before it reads anything, so the state on stdin is still unread then.

``hookclient.c`` is the same client as a native program (``nvcontainer setup --serve`` builds
it where a C compiler is found): this module is its specification.

This module imports nothing but built-in modules (``_socket``, ``os``, ``sys``) and may be run
as a script with ``python -I -S`` (no ``site``): registration files written by
``nvcontainer setup`` do that, which makes the client start in about the time of a bare
interpreter. Run that way it falls back by executing ``python -I -m nvcontainer.hook``.
``_socket`` is imported only where a socket is there to ask: the in-process hook of a node
whose server is down does not load it (an extension module where Python is built that way).
"""

import os
import sys

SOCKET = "/run/nvcontainer/hook.sock"
MAGIC = b"NVC1"
RUNTIME_MAGIC = b"NVR1"   # the runtime shim's front asking for its spec edit (serve/request.py)
ENV = ("PATH", "CUDA_MPS_PIPE_DIRECTORY")   # what the hook's code reads from its environment
MAX_REQUEST = 64 << 10
MAX_FDS = 4
REPLY_TIMEOUT = 600.0   # the server bounds every run by its deadline; this only bounds a wedged server
PROG = "nvcontainer-hook"


# The hook's options that take a value (as the next argument unless given with "="), with their
# short forms. The one list: ``prestart.parse_args`` reads it too, so the two parsers cannot drift.
OPTIONS = {"--root": "-r", "--ldcache": "-l", "--debug": "-d", "--user": "-u", "--config": None, "--socket": None}
VALUED = frozenset([*OPTIONS, *filter(None, OPTIONS.values())])


def socket_path(argv):
    """``--socket PATH`` among the global options (before the stage word), else the default;
    ``--socket ''`` turns the fast path off."""
    path = SOCKET
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            break   # the stage
        name, eq, value = arg.partition("=")
        if name in VALUED and not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        if name == "--socket":
            path = value
        i += 1
    return path


def encode_request(argv, env, umask):
    """``NVC1 <pid> <umask> <nargs> <nenv>\\n`` then the arguments and ``NAME=value`` pairs,
    each ending in NUL. Nothing here can hold a NUL (argv and environ are C strings)."""
    head = b"%s %d %d %d %d\n" % (MAGIC, os.getpid(), umask, len(argv), len(env))
    return head + b"".join(os.fsencode(s) + b"\0" for s in (*argv, *env))


def decode_request(data, magic=MAGIC):
    """(client pid, umask, argv, env) from :func:`encode_request`'s bytes (with ``magic`` as
    its first word); ValueError if malformed."""
    head, sep, rest = data.partition(b"\n")
    parts = head.split(b" ")
    if (not sep or len(parts) != 5 or parts[0] != magic
            or not all(p.isascii() and p.isdigit() and len(p) < 10 for p in parts[1:])):
        raise ValueError("bad request header")
    pid, umask, nargs, nenv = (int(p) for p in parts[1:])
    if umask > 0o777:
        raise ValueError("bad umask")
    fields = rest.split(b"\0")
    if fields[-1] != b"" or len(fields) != nargs + nenv + 1:
        raise ValueError("bad request body")
    strings = [os.fsdecode(f) for f in fields[:-1]]
    env = {}
    for pair in strings[nargs:]:
        name, eq, value = pair.partition("=")
        if not eq or name not in ENV:
            raise ValueError("bad environment entry")
        env[name] = value
    return pid, umask, strings[:nargs], env


def pack_fds(fds):
    """The SCM_RIGHTS payload for ``fds``."""
    return b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)


def unpack_fds(ancillary):
    """The fds of the SCM_RIGHTS messages in ``recvmsg``'s ancillary data (a truncated tail
    ignored)."""
    fds = []
    import _socket

    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(payload[i:i + 4], sys.byteorder, signed=True)
                    for i in range(0, len(payload) - 3, 4)]
    return fds


def forward(argv):
    """The exit status of the run done by the server, or None when no server took it."""
    path = socket_path(argv)
    if not path:
        return None
    try:
        os.stat(path)
    except FileNotFoundError:   # nothing there (no server): connect() would fail the same way
        return None
    except (OSError, ValueError):   # e.g. an abstract name: connect() tells
        pass
    import _socket

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            sock.connect(path)
            cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        env = ["%s=%s" % (name, os.environ[name]) for name in ENV if name in os.environ]
        umask = os.umask(0o022)
        os.umask(umask)
        try:
            sock.sendmsg([encode_request(argv, env, umask)],
                          [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pack_fds((0, 1, 2, cwd)))])
        except OSError:
            return None   # e.g. a closed stdio fd: the in-process run reports it its own way
        finally:
            os.close(cwd)
        sock.settimeout(REPLY_TIMEOUT)
        try:
            reply = sock.recv(4096)
        except OSError as exc:
            reply = ("no answer (%s)" % (exc.strerror or "timed out")).encode()
    finally:
        sock.close()
    if reply.startswith(b"declined "):
        return None
    if reply.startswith(b"rc ") and reply[3:].isdigit() and len(reply) < 8:
        return int(reply[3:])
    detail = reply.decode("ascii", "replace")
    if not (reply.isascii() and detail.isprintable() and detail):
        detail = "no answer"
    os.write(2, ("%s: error: nvcontainer serve at %s: %s\n" % (PROG, path, detail)).encode())
    return 1


def main():
    argv = sys.argv[1:]
    status = forward(argv)
    if status is not None:
        os._exit(status)
    # Nobody took it: the full hook, in a fresh interpreter (this one runs without site, so it
    # cannot import the package). -I keeps the environment's PYTHON* variables out.
    exe = sys.executable
    try:
        os.execv(exe, [exe, "-I", "-m", "nvcontainer.hook", *argv])
    except OSError as exc:
        os.write(2, ("%s: error: cannot run %s: %s\n" % (PROG, exe, exc.strerror)).encode())
        os._exit(1)


if __name__ == "__main__":
    main()
