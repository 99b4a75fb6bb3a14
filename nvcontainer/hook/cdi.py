"""The hooks a CDI spec names: ``nvcontainer-hook create-symlinks|update-ldcache|
disable-device-node-modification``.

The engine's OCI runtime runs them at ``createRuntime``, in the runtime's namespaces, with the
container's state on standard input: the container's mounts are in place and its root is not
pivoted yet, the same moment the prestart hook works in. So they use the same apply layer: the
container is pinned by its PID (:func:`apply.pin.pin`), and every change happens in a forked
worker that has entered the container's mount namespace, through in-root resolution and
detached mounts (:func:`apply.mounter.place`), or in the ldconfig sandbox. Paths come from the
spec (the operator's file), never from the image.
"""

from __future__ import annotations

import os
import time

from .. import log
from ..errors import NvcError, escape
from .usage import PROG, Usage, usage_status

DEADLINE = 20.0   # the prestart hook's default (config.toml deadline), under any registration's timeout
MAX_LINKS = 4096
MAX_PATH = 4096
PARAMS = "/proc/driver/nvidia/params"
DROP_IN = "/etc/ld.so.conf.d/00-nvcontainer-cdi.conf"

USAGE = f"""usage: {PROG} create-symlinks [--debug FILE] --link TARGET::LINK...
       {PROG} update-ldcache [--debug FILE] --folder DIR... [--ldconfig-path PATH]
                             [--host-driver-version VERSION]
       {PROG} disable-device-node-modification [--debug FILE]

CDI hooks: the engine's runtime runs them at createRuntime with the container's state on stdin.
update-ldcache --host-driver-version: CUDA forward compatibility (NVIDIA's enable-cuda-compat
hook): an image's /usr/local/cuda/compat libcuda newer than that driver is scanned first.
"""

_OPTIONS = {
    "create-symlinks": {"--link": "links"},
    "update-ldcache": {"--folder": "folders", "--ldconfig-path": "ldconfig",
                       "--host-driver-version": "host_driver_version"},
    "disable-device-node-modification": {},
}
_REPEATABLE = {"links", "folders"}
SUBCOMMANDS = tuple(_OPTIONS)
# compiled by re on first use: only disable-device-node-modification matches it, and the other
# hooks (every container in CDI mode runs them) do not pay re's import
_MODIFY = r"(?m)^(ModifyDeviceFiles:[ \t]*)1[ \t]*$"


def parse_args(argv: list[str]) -> tuple[str, dict]:
    """(subcommand, options); ``argv`` starts with the subcommand."""
    sub, args = argv[0], list(argv[1:])
    if sub not in _OPTIONS:
        raise Usage(f"unknown CDI hook {escape(sub, 80)} ({', '.join(SUBCOMMANDS)})")
    known = {"--debug": "debug", **_OPTIONS[sub]}
    opts: dict = {"links": [], "folders": []}
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            raise Usage("")
        name, eq, value = arg.partition("=")
        if name not in known:
            raise Usage(f"{sub}: unknown option {escape(arg, 80)}")
        if not eq:
            if not args:
                raise Usage(f"{sub}: {name} needs a value")
            value = args.pop(0)
        key = known[name]
        if key in _REPEATABLE:
            opts[key].append(value)
        else:
            opts[key] = value
    if sub == "create-symlinks" and not opts["links"]:
        raise Usage("create-symlinks: at least one --link TARGET::LINK")
    if sub == "update-ldcache" and not opts["folders"]:
        raise Usage("update-ldcache: at least one --folder DIR")
    version = opts.get("host_driver_version")
    if version is not None:
        from ..plan.volume import check_version   # the driver version's one check (the volume's directory name)

        try:
            check_version(version)
        except NvcError:
            raise Usage(f"update-ldcache: --host-driver-version {escape(version, 80)}: expected a driver version "
                        "such as 550.54.14") from None
    return sub, opts


def parse_link(value: str) -> tuple[str, str]:
    """``TARGET::LINK`` → (target, link). The link is a container path; the target is stored in
    the link as it is (relative targets are the norm), so only its form is checked."""
    target, sep, link = value.partition("::")
    if not sep or not target or not link.startswith("/") or "\0" in value or len(value) > MAX_PATH:
        raise NvcError("input", f"--link {escape(value, 120)}: expected TARGET::/ABSOLUTE/LINK")
    if os.path.basename(link) in ("", ".", ".."):
        raise NvcError("input", f"--link {escape(value, 120)}: the link must name a file")
    return target, link


def params_without_modify(text: str | None) -> str | None:
    """The driver's ``params`` with ``ModifyDeviceFiles: 0``, or None when the host does not let
    NVML create device files anyway (or has no driver loaded): then there is nothing to hide."""
    import re

    if text is None or not re.search(_MODIFY, text):
        return None
    return re.sub(_MODIFY, r"\g<1>0", text)


def main(argv: list[str]) -> int:
    try:
        sub, opts = parse_args(argv)
    except Usage as exc:
        return usage_status(exc, USAGE)
    if opts.get("debug"):
        log.open_debug(opts["debug"])
    try:
        log.info(f"CDI hook {sub}")
        _run(sub, opts)
        return 0
    except NvcError as exc:
        return log.fail(exc, PROG)
    except Exception as exc:  # a bug of ours: still one line, never a traceback in the runtime's error
        return log.fail(NvcError("internal", f"{type(exc).__name__}: {escape(exc)}"), PROG)
    finally:
        log.close()


def _run(sub: str, opts: dict) -> None:
    end = time.monotonic() + DEADLINE
    state, rootfs = _container()   # read first, whatever follows: the runtime is writing it
    if len(opts["links"]) > MAX_LINKS:
        raise NvcError("input", f"more than {MAX_LINKS} links")
    links = [parse_link(v) for v in opts["links"]]
    content = None
    if sub == "disable-device-node-modification":
        from ..inventory.procfs import read_text

        content = params_without_modify(read_text(PARAMS))
        if content is None:
            log.info("ModifyDeviceFiles is not 1 on the host (or no driver): nothing to do")
            return
    from ..apply.pin import pin

    pinned = pin(state.pid)
    try:
        owner = _owner(pinned)
        if sub == "create-symlinks":
            _place(pinned, rootfs, [{"op": "symlink", "target": link, "link": target} for target, link in links],
                   owner, end)
        elif sub == "update-ldcache":
            _update_ldcache(pinned, rootfs, opts, owner, end)
        else:
            _cover_params(pinned, rootfs, content, owner, end)
        if not pinned.alive():
            raise NvcError("container", f"container process {state.pid} exited during the {sub} hook")
    finally:
        pinned.close()


def _container():
    from ..request import oci

    try:
        state = oci.read_state_from_stdin()
    except NvcError as exc:
        if exc.detail.startswith("state: pid:"):
            raise NvcError("input", f"{exc.detail}: CDI hooks run at createRuntime, where the state holds the "
                                    "container's PID (createContainer hooks get 0 or 1)") from None
        raise
    rootfs = state.root or oci.read_spec(state.bundle).rootfs
    log.info(f"container pid {state.pid}, rootfs {rootfs}")
    return state, rootfs


def _owner(pinned) -> tuple[int, int]:
    """Who the container's files belong to: the owner of its process (a user-namespaced
    container's mapped root), as the prestart path decides. Read through /proc/PID, so it
    counts only if the pinned process is still alive afterwards: a number reused by a host
    process in between would hand out that process's owner."""
    pid = pinned.pid
    try:
        st = os.stat(f"/proc/{pid}")
    except OSError as exc:
        raise NvcError("container", f"cannot stat /proc/{pid}: {exc.strerror.lower()}") from None
    if not pinned.alive():
        raise NvcError("container", f"container process {pid} exited during configuration")
    return st.st_uid, st.st_gid


def _left(end: float, step: str) -> float:
    left = end - time.monotonic()
    if left <= 0:
        raise NvcError("timeout", f"deadline passed before the {step} step")
    return left


def _place(pinned, rootfs: str, actions: list[dict], owner, end: float) -> None:
    from ..apply import execute, mounter, worker

    reply = worker.run(mounter.place, pinned.mntns_fd, rootfs, actions, list(owner), deadline=_left(end, "mount"),
                       name="mount worker", keep_fds=[pinned.mntns_fd], category="mount")
    execute.log_placed(reply, rootfs)


def _update_ldcache(pinned, rootfs: str, opts: dict, owner, end: float) -> None:
    """A drop-in naming the folders (so a later ldconfig in the container keeps them), then the
    host's ldconfig in its sandbox, scanning them: one worker for both, as for a plan.

    With ``--host-driver-version``, CUDA forward compatibility as the hook path's ldconfig mode
    gives it: when the image's compat libcuda is newer than the host driver, its directory comes
    first, in the ldconfig run and in the drop-in (so a later ldconfig in the container keeps
    it first), ahead of the host's libcuda. NVIDIA's specs run that as a hook of its own
    (enable-cuda-compat) ordered by drop-in file names; here it is the same process and the
    same ldconfig run, so the order is the argument order, and a start pays one process less.
    Nothing from the image is mounted or opened beyond its names and ELF headers."""
    from ..apply import execute, ldconfig, worker
    from ..config.model import LDCONFIG, host_ldconfig

    folders = list(dict.fromkeys(opts["folders"]))
    compat = _compat_dir(pinned.pid, rootfs, opts["host_driver_version"]) if opts.get("host_driver_version") else None
    if compat:
        folders = [compat, *(f for f in folders if f != compat)]
        log.info(f"CUDA forward compatibility: {compat} scanned first")
    program = host_ldconfig(opts.get("ldconfig", LDCONFIG))
    if not program.startswith("/"):
        raise NvcError("input", f"--ldconfig-path {escape(program)}: must be an absolute host path")
    # An image without /etc/ld.so.conf gets upstream's one line, so that an ldconfig run later in
    # the container reads the drop-in too; one it has is never touched.
    conf = {"op": "file", "target": "/etc/ld.so.conf", "content": "include /etc/ld.so.conf.d/*.conf\n", "mode": 0o644,
            "keep": True}
    drop_in = {"op": "file", "target": DROP_IN, "content": "".join(f + "\n" for f in folders), "mode": 0o644}
    # validates the folders (absolute, bounded, no option-like names) before anything is placed
    job = ldconfig.prepare_run(rootfs, folders, ldconfig_host_path=program, uid=owner[0], gid=owner[1])
    try:
        running = worker.start(execute.place_then_ldconfig, pinned.mntns_fd, rootfs, [conf, drop_in], list(owner), [],
                               job, deadline=_left(end, "mount"), name="mount worker", category="mount",
                               keep_fds=[pinned.mntns_fd, job.exe], isolated=True)
        try:
            execute.log_placed(running.next_stage(), rootfs)
        except BaseException:
            running.kill()
            raise
        ldconfig.report(running.wait(), job.program)
    finally:
        job.close()
    log.info("ldconfig done")


def _compat_dir(pid: int, rootfs: str, host_version: str) -> str | None:
    """The image's CUDA compat directory when it holds a libcuda newer than the host driver,
    else None: its names and ELF headers read in-root from the container's own mount view, as
    the hook path reads them."""
    from ..plan.container import COMPAT_DIR, compat_libs, forward_compat
    from ..plan.gather import open_rootfs

    fd = open_rootfs(rootfs, pid)
    try:
        return COMPAT_DIR if forward_compat(compat_libs(fd), host_version) else None
    finally:
        os.close(fd)


def _cover_params(pinned, rootfs: str, content: str, owner, end: float) -> None:
    from ..apply import worker

    reply = worker.run(_params_worker, pinned.mntns_fd, rootfs, content, list(owner), deadline=_left(end, "mount"),
                       name="params worker", keep_fds=[pinned.mntns_fd], category="mount")
    log.info(f"{PARAMS} covered ({reply['done']} mount)")


def _params_worker(mntns_fd: int, rootfs: str, content: str, owner: list[int]) -> dict:
    """Worker body: a read-only one-file mount holding ``content``, placed on the container's
    ``params``.

    A file-sized mount is a bind of a file inside a tmpfs. The kernel clones only mounts of the
    caller's own namespace, so the tmpfs is attached first in a private, throw-away copy of
    this worker's namespace (nothing propagates out of it), the file cloned from there into a
    detached mount, and that mount placed in the container like any other.
    """
    from ..apply import mounter
    from ..fs import inroot, mounts
    from ..fs import syscalls as sc

    sealed = sc.MOUNT_ATTR_RDONLY | sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV | sc.MOUNT_ATTR_NOEXEC
    sc.unshare(sc.CLONE_NEWNS)
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    tmp = mounts.tmpfs_detached({"mode": "0555", "size": "64k", "nr_inodes": "8"},
                                sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV | sc.MOUNT_ATTR_NOEXEC)
    fd = inroot.create_file_at(tmp, "params", 0o444)
    try:
        view = memoryview(content.encode())
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    mounts.set_attrs(tmp, sealed)
    anchor = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    mounts.attach(tmp, anchor)
    source = os.open("params", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tmp)
    clone = mounts.clone_mount(source, sealed)
    action = {"op": "mount", "fd": clone, "target": PARAMS, "kind": "file", "step": "params"}
    return mounter.place(mntns_fd, rootfs, [action], tuple(owner))
