"""The injection plan: everything a container will get, as data, before anything happens.

A plan is the contract between deciding and doing. ``configure --dry-run`` prints it; the apply
layer performs it and nothing else. Its JSON form is stable and documented in ``docs/plan.md``.
Container paths are absolute paths as seen inside the container's rootfs; host paths are
absolute paths on the host (the driver root prefix included).
"""

from __future__ import annotations

from ..records import field, record

# Mount options per class (REFERENCE §2.7); the apply layer maps them to MOUNT_ATTR_* flags.
LIBRARY_OPTIONS = ("ro", "nosuid", "nodev")
DEVICE_OPTIONS = ("ro", "nosuid", "noexec")
IPC_OPTIONS = ("nosuid", "nodev", "noexec")
PROC_OPTIONS = ("ro", "nosuid", "nodev", "noexec")
TMPFS_OPTIONS = ("ro", "nosuid", "nodev", "noexec")


@record
class Mount:
    source: str                 # host path
    target: str                 # container path
    options: tuple[str, ...]
    kind: str = "file"          # file | dir | socket: what the target placeholder must be

    def to_json(self) -> dict:
        return {"source": self.source, "target": self.target, "options": list(self.options), "kind": self.kind}


@record
class Device:
    """A device node given to the container: bound from ``source`` (checked by ``st_rdev``)."""

    path: str                   # container path
    major: int
    minor: int
    source: str                 # host path of the node

    @property
    def rule(self) -> str:
        return f"c {self.major}:{self.minor} rw"

    def to_json(self) -> dict:
        return {"path": self.path, "major": self.major, "minor": self.minor, "source": self.source}


@record
class Symlink:
    link: str                   # container path of the link
    target: str                 # what it points to (a name in the same directory)

    def to_json(self) -> dict:
        return {"link": self.link, "target": self.target}


@record
class File:
    """A small file the plan writes: into a tmpfs it builds, or an ld.so.conf.d drop-in."""

    path: str
    content: str
    mode: int = 0o444

    def to_json(self) -> dict:
        return {"path": self.path, "content": self.content, "mode": f"{self.mode:04o}"}


@record
class Tmpfs:
    """A tmpfs built detached, filled, made read-only, then attached whole at ``target``.

    ``dirs`` are created inside it first so later bind mounts (the selected GPUs'
    ``/proc/driver/nvidia/gpus/<bus>``) have somewhere to land.
    """

    target: str
    files: tuple[File, ...]
    dirs: tuple[str, ...] = ()
    options: tuple[str, ...] = TMPFS_OPTIONS
    mode: int = 0o555

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "options": list(self.options),
            "mode": f"{self.mode:04o}",
            "dirs": list(self.dirs),
            "files": [f.to_json() for f in self.files],
        }


@record
class Ldconfig:
    ldconfig: str               # "@/sbin/ldconfig": a host binary, run sealed in a sandbox
    directories: tuple[str, ...]

    def to_json(self) -> dict:
        return {"ldconfig": self.ldconfig, "directories": list(self.directories)}


@record
class Plan:
    gpu: bool
    rootfs: str = ""
    pid: int | None = None
    tmpfs: tuple[Tmpfs, ...] = ()
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Device, ...] = ()
    symlinks: tuple[Symlink, ...] = ()
    files: tuple[File, ...] = ()
    cgroup_rules: tuple[str, ...] = ()
    ldconfig: Ldconfig | None = None
    devbind: bool = True
    cgroups: bool = True
    owner: tuple[int, int] = (0, 0)
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def to_json(self) -> dict:
        if not self.gpu:
            return {"gpu": False}
        return {
            "gpu": True,
            "rootfs": self.rootfs,
            "pid": self.pid,
            "tmpfs": [t.to_json() for t in self.tmpfs],
            "mounts": [m.to_json() for m in self.mounts],
            "devices": [d.to_json() for d in self.devices],
            "symlinks": [s.to_json() for s in self.symlinks],
            "files": [f.to_json() for f in self.files],
            "cgroup_rules": list(self.cgroup_rules),
            "ldconfig": self.ldconfig.to_json() if self.ldconfig else None,
            "devbind": self.devbind,
            "cgroups": self.cgroups,
            "owner": list(self.owner),
            "warnings": list(self.warnings),
        }

    def dumps(self) -> str:
        import json   # --dry-run only

        return json.dumps(self.to_json(), indent=2) + "\n"

    def text(self) -> str:
        """A human summary, one action per line, in the order they are applied."""
        if not self.gpu:
            return "not a GPU container: nothing to do\n"
        lines = [f"rootfs {self.rootfs}" + (f" (pid {self.pid})" if self.pid else "")]
        for t in self.tmpfs:
            lines.append(f"tmpfs   {t.target} ({', '.join(f.path.rsplit('/', 1)[-1] for f in t.files)})")
        for m in self.mounts:
            lines.append(f"mount   {m.source} -> {m.target} [{','.join(m.options)}]")
        for d in self.devices:
            verb = "device " if self.devbind else "rule   "
            lines.append(f"{verb} {d.path} ({d.major}:{d.minor})")
        for s in self.symlinks:
            lines.append(f"symlink {s.link} -> {s.target}")
        for f in self.files:
            lines.append(f"file    {f.path}")
        if self.cgroups:
            for r in self.cgroup_rules:
                lines.append(f"cgroup  {r}")
        if self.ldconfig:
            lines.append(f"ldconfig {self.ldconfig.ldconfig} {' '.join(self.ldconfig.directories)}")
        return "".join(line + "\n" for line in lines)
