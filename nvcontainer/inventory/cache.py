"""A per-boot cache of the driver inventory, so that container starts do not initialise NVML.

Why: building the inventory means loading NVML in a child process, which on a real driver
without persistence mode takes hundreds of milliseconds (upstream pays it on every container
start, and its "driver rpc error: timed out" is the most common complaint after cgroups), plus
resolving and ELF-checking every driver library. The answer only changes when the driver, the
GPUs, the ld cache or the driver's files change, so it is kept in one root-only file per
configuration under ``cache-dir`` (default ``/run/nvcontainer``) and checked, not trusted, on
every read:

* the file: a regular file owned by us (root), mode 0600 or stricter, one link, opened without
  following symlinks from a directory owned by us with mode 0700, at most ``MAX_FILE`` bytes,
  JSON of exactly the inventory's shape;
* the inputs: format, nvcontainer version, driver root, ld cache path, ``--user``, and the PATH
  and MPS directory the files were searched in;
* the machine: boot id, the text of ``/proc/driver/nvidia/version``, the ``nvidia`` lines of
  ``/proc/devices`` (majors), the GPUs under ``/proc/driver/nvidia/gpus`` and the names in the
  MIG capability tree (instances created or destroyed);
* the files: the ``lstat`` identity (inode, device, size, mode, mtime, ctime, rdev) of every
  path the inventory was read from or would have found something at: the ld cache, every
  listed file and its directory, the PATH directories, IPC and firmware locations, and the
  device nodes, present or not (``nvidia-uvm`` appears on first use).

Anything that does not match is a miss: the inventory is rebuilt and the file atomically
replaced (write a temporary file, rename over). NVML's own answers are kept in the same file
keyed by the machine part and the NVML library's identity only, so a new ld cache (any package
install runs ldconfig) or a new device node rescans files without loading NVML again: NVML is
initialised once per boot, driver and GPU/MIG layout. A miss takes an exclusive lock, so 32
containers starting at once after boot wait for one NVML initialisation, not 32.

Not visible without NVML: switching a GPU's MIG mode while creating no instance. Run
``nvcontainer info --refresh`` after doing that.
"""

from __future__ import annotations

import binascii
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import fields, replace

from .. import __version__, log
from ..errors import NvcError, escape
from ..fs.bounded import read_at_most
from . import procfs
from .catalog import DEFAULT_PATH, FABRICMANAGER_SOCKET, MPS_PIPE_DIRECTORY, PERSISTENCED_SOCKET
from .model import DeviceNode, DriverFile, Gpu, Inventory, MigControl, MigDevice

FORMAT = 1
MAX_FILE = 4 << 20
MAX_ENTRIES = 16          # cache files kept in the directory (one per configuration)
MAX_CAP_NAMES = 4096      # bound on the MIG capability tree walk
STALE_TEMP_S = 60         # a temporary file this old was left by a killed writer
PREFIX = "inventory-"
LOCK = "lock"

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
NODE_DIRS = ("/dev/nvidia-caps", "/dev/nvidia-caps-imex-channels")


def cached_inventory(config, *, refresh: bool = False, proc: str = "/proc") -> Inventory:
    """The inventory for ``config``: from the cache when every check passes, else built (and
    stored). ``refresh`` rebuilds even a valid entry, NVML included. Without a usable cache
    directory (not root, a directory owned by someone else) it is built every time."""
    inputs = _inputs(config)
    machine = machine_state(proc)
    dfd = open_cache_dir(config.cache_dir)
    if dfd is None:
        return _build(config, inputs, machine, None, proc)[0]
    try:
        name = entry_name(inputs)
        if not refresh:
            inventory = _recalled(dfd, name, inputs, machine)
            if inventory is None:
                entry = read_entry(dfd, name)
                inventory = valid_inventory(entry, inputs, machine)
                if inventory is not None:
                    _remember(dfd, name, entry, inventory)
            if inventory is not None:
                log.info(f"inventory from cache {config.cache_dir}/{name}")
                return inventory
        try:
            lock = _Lock(dfd, config.deadline)
        except OSError as exc:
            log.warning(f"inventory cache not used: {LOCK}: {exc.strerror}")
            return _build(config, inputs, machine, None, proc)[0]
        with lock:
            entry = read_entry(dfd, name)
            if not refresh:
                # another process may have built it while this one waited for the lock
                inventory = valid_inventory(entry, inputs, machine)
                if inventory is not None:
                    return inventory
            facts = None if refresh else valid_facts(entry, inputs, machine)
            inventory, record = _build(config, inputs, machine, facts, proc)
            if record is not None and write_entry(dfd, name, record):
                _remember(dfd, name, record, inventory)
            return inventory
    finally:
        os.close(dfd)


# --- what an entry is keyed and checked by ----------------------------------------------------


def _inputs(config) -> dict:
    return {
        "format": FORMAT,
        "version": __version__,
        "root": os.path.abspath(config.root),
        "ldcache": config.ldcache,
        "user": config.user,
        "search_path": os.environ.get("PATH") or DEFAULT_PATH,
        "mps_dir": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY,
    }


def entry_name(inputs: dict) -> str:
    """One file per configuration; the boot and the version are checked inside, not named, so
    an entry is replaced rather than joined by a new one after a reboot or an upgrade."""
    what = {k: v for k, v in inputs.items() if k not in ("format", "version")}
    return f"{PREFIX}{binascii.crc32(json.dumps(what, sort_keys=True).encode()):08x}.json"


def machine_state(proc: str = "/proc") -> dict:
    """What the kernel says about the boot, the driver and the GPUs, read fresh every time."""
    devices = procfs.read_text(os.path.join(proc, "devices")) or ""
    return {
        "boot_id": (procfs.read_text(os.path.join(proc, "sys/kernel/random/boot_id")) or "").strip(),
        "driver": procfs.read_text(os.path.join(proc, procfs.DRIVER_DIR, "version")),
        "majors": [line.strip() for line in devices.splitlines() if "nvidia" in line],
        "gpus": procfs.gpu_bus_dirs(proc),
        "capabilities": _cap_names(os.path.join(proc, procfs.DRIVER_DIR, "capabilities")),
    }


def _cap_names(top: str) -> list[str]:
    """Relative names under ``capabilities``: the MIG instances that exist right now."""
    names: list[str] = []
    todo = [""]
    while todo and len(names) < MAX_CAP_NAMES:
        rel = todo.pop()
        try:
            with os.scandir(os.path.join(top, rel)) as it:
                for entry in it:
                    name = f"{rel}/{entry.name}" if rel else entry.name
                    names.append(name)
                    if entry.is_dir(follow_symlinks=False) and name.count("/") < 6:
                        todo.append(name)
        except OSError:
            continue
    return sorted(names[:MAX_CAP_NAMES])


def identity(path: str):
    """What a path is right now: lstat facts, None when absent, or the errno as text."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"errno {exc.errno}"
    return [st.st_mode, st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_rdev]


def _host(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/")) if root != "/" else path


def watch_paths(inventory: Inventory, inputs: dict) -> list[str]:
    """Host paths whose change may change the inventory (present or not), without duplicates."""
    from ..fs.inroot import resolve_in_root

    root = inputs["root"]
    wanted: list[str] = []

    def add(path: str, resolved: bool = False) -> None:
        wanted.append(_host(root, path))
        if resolved:
            try:
                wanted.append(_host(root, resolve_in_root(root, path)))
            except OSError:
                pass

    add(inputs["ldcache"], resolved=True)
    for f in (*inventory.libraries, *inventory.libraries32, *inventory.binaries, *inventory.firmwares,
              *inventory.ipcs):
        add(f.path)
        add(os.path.dirname(f.path))
    for d in inputs["search_path"].split(":"):
        if d.startswith("/"):
            add(d, resolved=True)
    for path in (PERSISTENCED_SOCKET, FABRICMANAGER_SOCKET, inputs["mps_dir"]):
        add(path)
        add(os.path.dirname(path), resolved=True)
    add(f"/lib/firmware/nvidia/{inventory.driver_version}", resolved=True)
    for path in (*CONTROL_NODES, *NODE_DIRS, *(g.node.path for g in inventory.gpus)):
        add(path)
    for node in _cap_nodes(inventory):
        add(node.path)
    return list(dict.fromkeys(wanted))


def _cap_nodes(inventory: Inventory) -> list[DeviceNode]:
    nodes = [inventory.mig.config_cap, inventory.mig.monitor_cap]
    for gpu in inventory.gpus:
        for mig in gpu.migs:
            nodes += [mig.gi_cap, mig.ci_cap]
    return [n for n in nodes if n is not None]


# --- reading and checking an entry ------------------------------------------------------------


def open_cache_dir(path: str) -> int | None:
    """An fd of the cache directory, created 0700 if missing; None when it cannot be trusted or
    used (someone else owns it, it is a symlink, we may not create or open it)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.info(f"no inventory cache: cannot create {escape(path)}: {exc.strerror}")
        return None
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        log.info(f"no inventory cache: {escape(path)} is root's")
        return None
    except OSError as exc:
        log.warning(f"inventory cache {escape(path)} not used: {exc.strerror}")
        return None
    st = os.fstat(dfd)
    try:
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}")
        if st.st_mode & 0o077:
            os.fchmod(dfd, 0o700)   # ours: tighten it; every entry in it is checked anyway
    except OSError as exc:
        os.close(dfd)
        log.warning(f"inventory cache {escape(path)} not used: {exc.strerror}")
        return None
    return dfd


def read_entry(dfd: int, name: str) -> dict | None:
    """The parsed entry, or None when it is missing or is not a file we wrote."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning(f"inventory cache entry {escape(name)} ignored: {exc.strerror}")
        return None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077
                and st.st_nlink == 1 and st.st_size <= MAX_FILE):
            log.warning(f"inventory cache entry {escape(name)} ignored: not a private regular file of ours")
            return None
        data, more = read_at_most(fd, MAX_FILE)
        if more:
            return None
    finally:
        os.close(fd)
    try:
        entry = json.loads(data)
    except (ValueError, RecursionError):
        log.warning(f"inventory cache entry {escape(name)} ignored: not JSON")
        return None
    return entry if isinstance(entry, dict) else None


def valid_inventory(entry: dict | None, inputs: dict, machine: dict) -> Inventory | None:
    """The entry's inventory when it was built from these inputs on this machine and none of the
    files it depends on changed since; None otherwise."""
    if entry is None or entry.get("inputs") != inputs or entry.get("machine") != machine:
        return None
    if not _watched_unchanged(entry.get("watch")):
        return None
    data, minors, warnings = entry.get("inventory"), _minors_from_json(entry.get("mig_minors")), entry.get("warnings")
    if (minors is None or not _checker("Inventory")(data) or data["root"] != inputs["root"]
            or type(warnings) is not list or not set(map(type, warnings)) <= {str}):
        log.warning("inventory cache entry ignored: unexpected content")
        return None
    for w in warnings:
        log.warning(w)
    return replace(Inventory.from_dict(data), mig_minors=minors)


def _watched_unchanged(watch) -> bool:
    if not isinstance(watch, list):
        return False
    for item in watch:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            return False
        if identity(item[0]) != item[1]:
            log.info(f"inventory cache stale: {escape(item[0])} changed")
            return False
    return True


# --- the entry a resident server holds ----------------------------------------------------------
#
# ``nvcontainer serve`` reads (or builds) the entry once and forks a child per request. Parsing
# the JSON and checking its shape again in every child would cost a few milliseconds of every
# container start for a file that has not changed: the child instead compares the file's
# identity (same inode, size, mtime and ctime: not rewritten, renamed over, chmod-ed or linked)
# with the one the server parsed, and re-checks everything that describes the world rather than
# the file (inputs, machine, watched paths), exactly as a read would. Per process, never written
# anywhere.

_memo: dict[str, tuple] = {}


def _file_identity(dfd: int, name: str):
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_nlink


def _remember(dfd: int, name: str, entry: dict, inventory: Inventory) -> None:
    ident = _file_identity(dfd, name)
    if ident is not None:
        _memo[name] = (ident, entry["inputs"], entry["machine"], entry["watch"], inventory, list(entry["warnings"]))


def _recalled(dfd: int, name: str, inputs: dict, machine: dict) -> Inventory | None:
    memo = _memo.get(name)
    if memo is None:
        return None
    ident, memo_inputs, memo_machine, watch, inventory, warnings = memo
    if (_file_identity(dfd, name) != ident or memo_inputs != inputs or memo_machine != machine
            or not _watched_unchanged(watch)):
        return None
    for w in warnings:
        log.warning(w)
    return inventory


def inventory_to_json(inventory: Inventory) -> tuple[dict, list]:
    """The inventory as stored: ``mig_minors`` (thousands of pairs on every machine, most of the
    file) apart as two flat lists, which are checked and turned back into pairs at C speed."""
    data = replace(inventory, mig_minors=()).to_dict()
    del data["mig_minors"]
    return data, [[name for name, _ in inventory.mig_minors], [minor for _, minor in inventory.mig_minors]]


def _minors_from_json(value) -> tuple[tuple[str, int], ...] | None:
    if not (type(value) is list and len(value) == 2 and type(value[0]) is list and type(value[1]) is list):
        return None
    names, minors = value
    if len(names) != len(minors) or not set(map(type, names)) <= {str} or not set(map(type, minors)) <= {int}:
        return None
    return tuple(zip(names, minors))


_MODEL = {c.__name__: c for c in (Inventory, Gpu, MigDevice, DeviceNode, DriverFile, MigControl)}
_SCALARS = {"str": str, "int": int, "bool": bool}
_CHECKERS: dict = {}


def _checker(annotation: str):
    """A predicate: is a JSON value what ``to_dict`` makes of a value of this (model) type?
    Built once per annotation string from the model's own field types, so a model change is
    followed, and an unknown type fails closed (the entry is rebuilt, never half-trusted)."""
    ann = annotation.replace(" ", "")
    check = _CHECKERS.get(ann)
    if check is None:
        check = _CHECKERS[ann] = _make_checker(ann)
    return check


def _make_checker(ann: str):
    if ann.endswith("|None"):
        inner = _checker(ann[:-5])
        return lambda v: v is None or inner(v)
    if ann in _SCALARS:
        t = _SCALARS[ann]
        return lambda v: type(v) is t
    if ann.startswith("tuple[") and ann.endswith(",...]"):
        inner = _checker(ann[6:-5])
        return lambda v: type(v) is list and all(map(inner, v))
    if ann.startswith("tuple["):
        parts = tuple(_checker(p) for p in ann[6:-1].split(","))
        return lambda v: type(v) is list and len(v) == len(parts) and all(c(x) for c, x in zip(parts, v))
    cls = _MODEL.get(ann)
    if cls is None:
        return lambda v: False
    checks = [(f.name, _checker(f.type)) for f in fields(cls) if not (cls is Inventory and f.name == "mig_minors")]
    names = {name for name, _ in checks}
    return lambda v: type(v) is dict and v.keys() == names and all(c(v[name]) for name, c in checks)


def valid_facts(entry: dict | None, inputs: dict, machine: dict) -> dict | None:
    """NVML's stored answers, when they were given on this machine, to this user, by the same
    library file; checked against the shape :func:`nvml.query` returns."""
    if entry is None or entry.get("machine") != machine or entry.get("inputs") != inputs:
        return None
    nvml = entry.get("nvml")
    if not (isinstance(nvml, dict) and isinstance(nvml.get("library"), str) and facts_ok(nvml.get("facts"))):
        return None
    if identity(nvml["library"]) != nvml.get("identity"):
        return None
    return nvml


_GPU_FACTS = {"index": int, "minor": int, "name": str, "brand": int, "uuid": str, "bus": list, "cc": list,
              "mig_capable": bool, "mig_enabled": bool, "migs": list}
_MIG_FACTS = {"index": int, "uuid": str, "name": str, "gi": int, "ci": int}


def facts_ok(facts) -> bool:
    def typed(d, spec) -> bool:
        return isinstance(d, dict) and all(type(d.get(k)) is t for k, t in spec.items())

    if not typed(facts, {"driver_version": str, "cuda_version": int, "gpus": list}):
        return False
    for gpu in facts["gpus"]:
        if not typed(gpu, _GPU_FACTS) or len(gpu["bus"]) != 3 or len(gpu["cc"]) != 2:
            return False
        if not all(type(v) is int for v in (*gpu["bus"], *gpu["cc"])):
            return False
        if not all(typed(m, _MIG_FACTS) for m in gpu["migs"]):
            return False
    return True


# --- building and writing ---------------------------------------------------------------------


def _build(config, inputs: dict, machine: dict, cached: dict | None, proc: str) -> tuple[Inventory, dict | None]:
    """A fresh inventory and the entry to store (None when the machine changed meanwhile)."""
    from ..identity import parse_user
    from . import nvml
    from .build import build

    ldcache_before = identity(_host(inputs["root"], inputs["ldcache"]))
    asked: dict = {}

    def query(lib_path: str, user, deadline: float) -> dict:
        if cached is not None and cached["library"] == lib_path:
            log.info("NVML facts from cache")
            asked.update(cached)
            return cached["facts"]
        asked.update(library=lib_path, identity=identity(lib_path), facts=nvml.query(lib_path, user, deadline))
        return asked["facts"]

    mark = log.warning_count()   # what the build warns about is stored, and said again on every hit
    inventory = build(inputs["root"], inputs["ldcache"], parse_user(config.user), proc=proc,
                      deadline=config.deadline, search_path=inputs["search_path"], mps_dir=inputs["mps_dir"],
                      query=query)
    watch = [[path, identity(path)] for path in watch_paths(inventory, inputs)]
    if machine_state(proc) != machine or identity(_host(inputs["root"], inputs["ldcache"])) != ldcache_before:
        log.info("driver changed while the inventory was built: not cached")
        return inventory, None
    data, minors = inventory_to_json(inventory)
    record = {"inputs": inputs, "machine": machine, "nvml": asked, "watch": watch, "inventory": data,
              "mig_minors": minors, "warnings": log.warnings_since(mark)}
    return inventory, record


def write_entry(dfd: int, name: str, record: dict) -> bool:
    """Replace ``name`` atomically; a failure costs the next start a rebuild, nothing more."""
    data = json.dumps(record, separators=(",", ":")).encode()
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except FileExistsError:   # left by a killed process that had our pid
            os.unlink(tmp, dir_fd=dfd)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        log.warning(f"inventory cache not written: {exc.strerror}")
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return False
    _prune(dfd, keep=name)
    return True


def _prune(dfd: int, keep: str) -> None:
    """Keep the directory bounded: the newest ``MAX_ENTRIES`` entries, no stale temporaries."""
    entries, now = [], time.time()
    try:
        with os.scandir(dfd) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                if e.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                    os.unlink(e.name, dir_fd=dfd)
                elif e.name.startswith(PREFIX) and e.name != keep:
                    entries.append((st.st_mtime, e.name))
        for _, old in sorted(entries, reverse=True)[MAX_ENTRIES - 1:]:
            os.unlink(old, dir_fd=dfd)
    except OSError as exc:
        log.info(f"inventory cache: pruning stopped: {exc.strerror}")


class _Lock:
    """``flock`` on the directory's lock file, waited for at most ``deadline`` seconds."""

    def __init__(self, dfd: int, deadline: float):
        self.deadline = deadline
        self.fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600,
                          dir_fd=dfd)

    def __enter__(self):
        end, pause = time.monotonic() + self.deadline, 0.001
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                pass
            if time.monotonic() >= end:
                os.close(self.fd)
                raise NvcError("timeout", f"waited {self.deadline:g}s for another nvcontainer to build the driver inventory")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
