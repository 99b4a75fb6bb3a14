"""``nvcontainer setup ENGINE``: what each container engine needs to give containers GPUs.

Engines find GPU support in different places: podman and CRI-O read OCI hook files from a
``hooks.d`` directory, Docker's ``--gpus`` runs ``nvidia-container-runtime-hook`` found on PATH,
containerd (and so Kubernetes) runs no hooks of its own and takes devices from CDI specs, and a
bare runc runs what the bundle's ``config.json`` names. :func:`steps` decides the files, links
and configuration fragments (pure); :func:`perform` shows or makes them. Files that belong to the
operator (``daemon.json``, containerd's ``config.toml``) are never edited: their fragment is
printed to merge by hand. A file this command does write is written atomically, and one that
already exists with other contents is first copied to ``PATH.bak-<timestamp>`` and the change
shown as a unified diff.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
from dataclasses import dataclass, replace

from ..errors import NvcError, escape
from ..inventory.catalog import DEFAULT_PATH

ENGINES = ("runc", "docker", "containerd", "podman", "crio")
HOOK_FILE = "oci-nvcontainer-hook.json"
HOOKS_DIRS = {"podman": "/etc/containers/oci/hooks.d", "crio": "/usr/share/containers/oci/hooks.d"}
PATH_DIR = "/usr/local/bin"
CDI_SPEC = "/var/run/cdi/nvidia.yaml"
CDI_COMMAND = f"nvcontainer cdi generate --output {CDI_SPEC}"
MAX_FILE = 1 << 20
UNIT_NAME = "nvcontainer-serve.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
SERVE_SOCKET = "/run/nvcontainer/hook.sock"


@dataclass(frozen=True)
class WriteFile:
    path: str
    content: str
    mode: int = 0o644


@dataclass(frozen=True)
class Link:
    path: str
    target: str


@dataclass(frozen=True)
class Steps:
    files: tuple[WriteFile, ...] = ()
    links: tuple[Link, ...] = ()
    fragments: tuple[tuple[str, str], ...] = ()   # (where it goes, text to merge by hand)
    notes: tuple[str, ...] = ()
    builds: tuple[BuildClient, ...] = ()


@dataclass(frozen=True)
class Served:
    """How the hook is run when a resident ``nvcontainer serve`` does the work. ``native``: the
    native client (``hookclient.c``, built by set-up), registered when there is one; else the
    interpreter runs the client module as a script without ``site`` (builtin modules only, so it
    starts about as fast as a bare interpreter). ``cli`` is the ``nvcontainer`` program the
    service runs."""
    python: str
    client: str
    cli: str
    native: str | None = None

    def entry(self) -> dict:
        if self.native:
            return {"path": self.native, "args": [self.native, "prestart"]}
        return {"path": self.python, "args": [self.python, "-I", "-S", self.client, "prestart"]}


@dataclass(frozen=True)
class BuildClient:
    """The native hook client, compiled on this node for this install's interpreter."""
    path: str
    python: str


def hook_entry(hook_path: str, served: Served | None = None) -> dict:
    return served.entry() if served else {"path": hook_path, "args": ["nvcontainer-hook", "prestart"]}


def hook_json(hook_path: str, served: Served | None = None) -> str:
    """An OCI hooks.d entry (version 1.0.0) that runs the hook for every container: the hook
    itself decides, from the image's environment, whether there is anything to do."""
    entry = {"version": "1.0.0", "hook": hook_entry(hook_path, served), "when": {"always": True},
             "stages": ["prestart"]}
    return json.dumps(entry, indent=2) + "\n"


def unit_file(served: Served) -> str:
    """A systemd service for ``nvcontainer serve``, started before the engines so that their first
    containers are served (a hook that finds no server does the work itself, only slower)."""
    return (
        "[Unit]\n"
        "Description=nvcontainer: container GPU hooks, run warm\n"
        "Documentation=man:nvcontainer-serve(1)\n"
        "Before=docker.service containerd.service crio.service podman.service\n"
        "\n"
        "[Service]\n"
        f"Environment=PATH={DEFAULT_PATH}\n"
        f"ExecStart={served.cli} serve --socket {SERVE_SOCKET}\n"
        "Restart=on-failure\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def steps(engine: str, hook_path: str, bin_dir: str, cdi_spec: str | None = None,
          served: Served | None = None) -> Steps:
    """``hook_path``: the installed ``nvcontainer-hook``; ``bin_dir``: where the drop-in scripts
    are installed; ``cdi_spec``: a generated CDI spec to install, if asked for; ``served``: also
    install the ``nvcontainer serve`` service and register its client."""
    if engine not in ENGINES:
        raise NvcError("input", f"unknown engine '{escape(engine, 40)}' (one of {', '.join(ENGINES)})")
    made = _steps(engine, hook_path, bin_dir, cdi_spec, served)
    if not served:
        return made
    if served.native:
        return replace(made, builds=(BuildClient(served.native, served.python),))
    return replace(made, notes=(*made.notes, "the hook client registered is hookclient.py: no C compiler was found "
                                             "to build the native one, which starts about 8 ms faster"))


def _steps(engine: str, hook_path: str, bin_dir: str, cdi_spec: str | None, served: Served | None) -> Steps:
    cdi = (WriteFile(CDI_SPEC, cdi_spec),) if cdi_spec is not None else ()
    cdi_note = () if cdi_spec is not None else (f"for CDI devices, add --cdi (or run: {CDI_COMMAND})",)
    service = (WriteFile(UNIT_PATH, unit_file(served)),) if served else ()
    service_note = (f"start the server: systemctl daemon-reload && systemctl enable --now {UNIT_NAME}",) \
        if served else ()
    if engine == "runc":
        fragment = json.dumps({"hooks": {"prestart": [hook_entry(hook_path, served)]}}, indent=2)
        return Steps(files=service, fragments=((f"each bundle's config.json", fragment),),
                     notes=("runc reads no configuration of its own: the hook is named in each bundle; "
                            "the container's NVIDIA_VISIBLE_DEVICES selects its GPUs", *service_note))
    if engine in ("podman", "crio"):
        where = HOOKS_DIRS[engine]
        notes = [f"{engine} runs the hook for every container; NVIDIA_VISIBLE_DEVICES selects the GPUs"]
        if engine == "crio":
            notes.append(f"CRI-O reads hooks from hooks_dir in crio.conf ({where} by default)")
        return Steps(files=(WriteFile(f"{where}/{HOOK_FILE}", hook_json(hook_path, served)), *service, *cdi),
                     notes=(*notes, *service_note, *cdi_note))
    if engine == "docker":
        link = Link(f"{PATH_DIR}/nvidia-container-runtime-hook", f"{bin_dir}/nvidia-container-runtime-hook")
        fragment = json.dumps({"features": {"cdi": True}}, indent=2)
        return Steps(files=(*service, *cdi), links=(link,), fragments=(("/etc/docker/daemon.json", fragment),),
                     notes=("docker run --gpus runs nvidia-container-runtime-hook from PATH: no daemon change "
                            "needed for --gpus (it hands its runs to nvcontainer serve when one listens)",
                            "the daemon.json fragment (Docker 25+) enables --device nvidia.com/gpu=...; "
                            "restart dockerd after merging it", *service_note, *cdi_note))
    if served:
        # containerd runs no hooks: CDI specs name `nvcontainer-hook` for their hooks, and those
        # find the server by themselves; the service is still worth having
        return Steps(files=(*service, *cdi), fragments=_CONTAINERD_FRAGMENTS,
                     notes=(*_CONTAINERD_NOTES, *service_note, *cdi_note))
    return Steps(files=cdi, fragments=_CONTAINERD_FRAGMENTS, notes=(*_CONTAINERD_NOTES, *cdi_note))


_CONTAINERD_FRAGMENTS = (("/etc/containerd/config.toml (version 2)",
                          '[plugins."io.containerd.grpc.v1.cri"]\n'
                          "  enable_cdi = true\n"
                          '  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]'),)
_CONTAINERD_NOTES = ("containerd runs no OCI hooks: GPUs reach its containers through CDI; restart "
                     "containerd after merging the fragment",
                     "Kubernetes: run the NVIDIA device plugin with DEVICE_LIST_STRATEGY=cdi-cri "
                     "(see docs/engines/containerd-kubernetes.md)")


# --- doing ---------------------------------------------------------------------------------


def _at(prefix: str, path: str) -> str:
    return os.path.join(prefix, path.lstrip("/"))


def _current(path: str) -> str | None:
    """The file's text; None if absent. A symlink or non-regular file is refused, not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
        raise NvcError("setup", f"{escape(path)}: not a regular file of at most {MAX_FILE} bytes; "
                                "move it away first")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(MAX_FILE)


def _diff(old: str | None, new: str, path: str) -> str:
    lines = difflib.unified_diff((old or "").splitlines(True), new.splitlines(True),
                                 "/dev/null" if old is None else path, path)
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _write(path: str, content: str, mode: int) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.nvcontainer-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, content.encode())
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def perform(s: Steps, *, prefix: str = "/", dry_run: bool = False, stamp: str = "") -> str:
    """Show (``dry_run``) or make the steps under ``prefix``; the report, one item per paragraph.
    ``stamp`` names backups (``PATH.bak-<stamp>``)."""
    out: list[str] = []
    try:
        # First: a registration must never name a client that failed to build.
        for b in s.builds:
            out.append(_build(b, prefix, dry_run))
        for f in s.files:
            path = _at(prefix, f.path)
            old = _current(path)
            if old == f.content:
                out.append(f"unchanged {f.path}\n")
                continue
            if dry_run:
                out.append(f"would write {f.path}\n" + _diff(old, f.content, f.path))
                continue
            note = ""
            if old is not None:
                backup = f"{path}.bak-{stamp}"
                _write(backup, old, stat.S_IMODE(os.lstat(path).st_mode))
                note = f" (previous contents in {f.path}.bak-{stamp})"
            _write(path, f.content, f.mode)
            out.append(f"wrote {f.path}{note}\n" + _diff(old, f.content, f.path))
        for link in s.links:
            out.append(_link(link, prefix, dry_run, stamp))
    except OSError as exc:
        raise NvcError("setup", f"{escape(exc.filename or '')}: {exc.strerror}") from None
    for where, text in s.fragments:
        out.append(f"merge into {where}:\n" + "".join(f"    {line}\n" for line in text.splitlines()))
    out += [f"note: {n}\n" for n in s.notes]
    return "\n".join(out)


def _build(b: BuildClient, prefix: str, dry_run: bool) -> str:
    from ..native import build as nativeclient

    if dry_run:
        return f"would build {b.path}: the native hook client (from {nativeclient.SOURCE})\n"
    linked = nativeclient.build(_at(prefix, b.path), b.python)
    return f"built {b.path}: the native hook client ({linked}; falls back to {b.python})\n"


def _link(link: Link, prefix: str, dry_run: bool, stamp: str) -> str:
    path = _at(prefix, link.path)
    try:
        current = os.readlink(path)
    except FileNotFoundError:
        current = None
    except OSError:   # a file or directory of the operator's: kept as a backup
        current = ""
    if current == link.target:
        return f"unchanged {link.path} -> {link.target}\n"
    verb = "would link" if dry_run else "linked"
    moved = f" (replacing {'a file' if current == '' else 'a link to ' + current}, kept as " \
            f"{link.path}.bak-{stamp})" if current is not None else ""
    if not dry_run:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if current is not None:
            os.rename(path, f"{path}.bak-{stamp}")
        os.symlink(link.target, path)
    return f"{verb} {link.path} -> {link.target}{moved}\n"
