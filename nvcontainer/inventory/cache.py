"""A per-boot cache of the driver inventory, so that container starts do not initialise NVML.

Why: building the inventory means loading NVML in a child process, which on a real driver
without persistence mode takes hundreds of milliseconds (upstream pays it on every container
start, and its "driver rpc error: timed out" is the most common complaint after cgroups), plus
resolving and ELF-checking every driver library. The answer only changes when the driver, the
GPUs, the ld cache or the driver's files change, so it is kept in one root-only file per
configuration and program (:func:`entry_name`) under ``cache-dir`` (default
``/run/nvcontainer``) and checked, not trusted, on every read:

* the file: a regular file owned by us (root), mode 0600 or stricter, one link, opened without
  following symlinks from a directory owned by us with mode 0700, at most ``MAX_FILE`` bytes,
  JSON of exactly the inventory's shape;
* the inputs: format, nvcontainer version, the program (:data:`PROGRAM`: which code computed
  the entry, so an upgrade, even one that keeps the version number, never serves what older
  code found), driver root, ld cache path, ``--user``, and the PATH
  and MPS directory the files were searched in;
* the machine: boot id, the text of ``/proc/driver/nvidia/version``, the ``nvidia`` lines of
  ``/proc/devices`` (majors), the GPUs under ``/proc/driver/nvidia/gpus`` and the names in the
  MIG capability tree (instances created or destroyed);
* the files: the ``lstat`` identity (inode, device, size, mode, mtime, ctime, rdev) of every
  path the inventory was read from or would have found something at: the ld cache, every
  listed library, program and firmware file and its directory, the PATH directories and the
  driver's own ``bin``, the firmware directory, the IPC paths themselves (never their
  directories: the MPS pipe directory's is ``/tmp``, which a node writes all the time), and the
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
import os

from .. import __version__, jsontext, log
from ..errors import escape
from ..records import replace
from . import procfs
from .cachefile import LOCK, PREFIX, Lock, open_cache_dir, read_entry, write_entry
from .stored import checker, facts_ok, inventory_to_json, minors_from_json
from .catalog import DEFAULT_PATH, FABRICMANAGER_SOCKET, MPS_PIPE_DIRECTORY, PERSISTENCED_SOCKET
from .model import DeviceNode, Inventory

FORMAT = 1


def _program_stamp() -> str:
    """The identity of the code that builds an inventory: name, size and mtime of every module
    of this package and of ``fs`` (how it resolves and reads the driver's files), as they were
    when this process imported them (an upgrade rewrites them; a resident server keeps the stamp
    of the code it runs). Some twenty-five ``stat`` calls, once per process: hashing the sources
    on every container start would cost more than the cache saves."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    try:
        for folder in (here, os.path.join(os.path.dirname(here), "fs")):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".py"):
                    st = os.stat(os.path.join(folder, name))
                    parts.append(f"{os.path.basename(folder)}/{name}:{st.st_size}:{st.st_mtime_ns}")
    except OSError as exc:   # unreadable: a stamp no entry can match, so nothing stale is served
        parts.append(f"unreadable:{exc.errno}:{os.getpid()}")
    return f"{binascii.crc32(chr(10).join(parts).encode()):08x}-{len(parts)}"


PROGRAM = _program_stamp()
MAX_CAP_NAMES = 4096      # bound on the MIG capability tree walk

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
            lock = Lock(dfd, config.deadline)
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
        "program": PROGRAM,
        "root": os.path.abspath(config.root),
        "ldcache": config.ldcache,
        "user": config.user,
        "search_path": os.environ.get("PATH") or DEFAULT_PATH,
        "mps_dir": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY,
    }


def entry_name(inputs: dict) -> str:
    """One file per configuration and program: ``inventory-<configuration>-<program>.json``.
    The program (format, version and :data:`PROGRAM`) is named, not only checked inside, so
    two programs sharing the directory (a package's server beside a pip-installed hook, an old
    server still running after an upgrade) each keep their own entry instead of rebuilding each
    other's on every start; :func:`.cachefile.write_entry` keeps a few programs per
    configuration, the newest. The boot is checked inside, not named: an entry is replaced, not
    joined by a new one, after a reboot."""
    what = {k: v for k, v in inputs.items() if k not in ("format", "version", "program")}
    program = [inputs.get("format"), inputs.get("version"), inputs.get("program")]
    return (f"{PREFIX}{binascii.crc32(jsontext.dumps(what, sort_keys=True).encode()):08x}-"
            f"{binascii.crc32(jsontext.dumps(program).encode()):08x}.json")


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
    from . import files, graphics   # only on a miss: the hook's cache hit imports no inventory reader

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
    for f in (*inventory.libraries, *inventory.libraries32, *inventory.binaries, *inventory.firmwares):
        add(f.path)
        add(os.path.dirname(f.path))
    for d in inputs["search_path"].split(":"):
        if d.startswith("/"):
            add(d, resolved=True)
    for f in inventory.libraries:   # the driver's own bin directory, searched after the PATH
        if os.path.basename(f.path).startswith("libnvidia-ml.so"):
            add(files.driver_bin(f.path), resolved=True)
    # The IPC paths themselves, present or not, never their directories: the MPS pipe directory
    # lives in /tmp, which anything on a node writes to (ctr's FIFO directories, on every
    # container), and a watched /tmp made every GPU start there rebuild the inventory.
    for path in (PERSISTENCED_SOCKET, FABRICMANAGER_SOCKET, inputs["mps_dir"]):
        add(path, resolved=True)
    add(f"/lib/firmware/nvidia/{inventory.driver_version}", resolved=True)
    for path in (*CONTROL_NODES, *NODE_DIRS, *(g.node.path for g in inventory.gpus)):
        add(path)
    for node in _cap_nodes(inventory):
        add(node.path)
    for path in graphics.watched(inventory):   # config files, Xorg modules, sysfs drm, DRI nodes
        add(path)
    return list(dict.fromkeys(wanted))


def _cap_nodes(inventory: Inventory) -> list[DeviceNode]:
    nodes = [inventory.mig.config_cap, inventory.mig.monitor_cap]
    for gpu in inventory.gpus:
        for mig in gpu.migs:
            nodes += [mig.gi_cap, mig.ci_cap]
    return [n for n in nodes if n is not None]


# --- checking an entry -------------------------------------------------------------------------


def valid_inventory(entry: dict | None, inputs: dict, machine: dict) -> Inventory | None:
    """The entry's inventory when it was built from these inputs on this machine and none of the
    files it depends on changed since; None otherwise."""
    if entry is None or entry.get("inputs") != inputs or entry.get("machine") != machine:
        return None
    if not _watched_unchanged(entry.get("watch")):
        return None
    data, minors, warnings = entry.get("inventory"), minors_from_json(entry.get("mig_minors")), entry.get("warnings")
    if (minors is None or not checker("Inventory")(data) or data["root"] != inputs["root"]
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


# --- building and writing ---------------------------------------------------------------------


def _build(config, inputs: dict, machine: dict, cached: dict | None, proc: str) -> tuple[Inventory, dict | None]:
    """A fresh inventory and the entry to store (None when the machine changed meanwhile)."""
    from .identity import parse_user
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
