"""``nvcontainer``: the operator's command line (the imperative shell).

Global options come before the command word, as with nvidia-container-cli. Every failure is
one line on stderr and exit status 1; click's multi-line usage errors are folded into that
shape so scripts and log scrapers see one format.
"""

from __future__ import annotations

import sys
import time

import click

from . import __version__, log
from .errors import NvcError, escape

PROG = "nvcontainer"


class _Context:
    def __init__(self, config):
        self.config = config

    def inventory(self, refresh: bool = False):
        from .inventory.cache import cached_inventory

        return cached_inventory(self.config, refresh=refresh)

    def allow_list(self, inv):
        """The config's ``allowed-devices`` against ``inv``; what it holds back goes to the debug
        log (info's text form is upstream's and has no place for it)."""
        from .selection import allow_list, held_back

        allow = allow_list(inv, self.config.allowed_devices)
        if allow is not None:
            held = held_back(inv, allow)
            log.info("allowed-devices holds back: "
                     + (", ".join([f"GPU {g.index} ({g.uuid})" for g in held.gpus]
                                  + [f"MIG device {m.parent}:{m.index} ({m.uuid})" for m in held.migs]) or "nothing"))
            for token in allow.unknown:
                log.warning(f"allowed-devices: {escape(token)} matches no device on this node")
        return allow


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-r", "--root", metavar="PATH", help="Driver root: where the driver's files, ld cache and device nodes are looked up. [default: /]")
@click.option("-l", "--ldcache", metavar="FILE", help="The ld cache, relative to --root. [default: /etc/ld.so.cache]")
@click.option("-d", "--debug", metavar="FILE", help="Append a full trace to FILE (quiet otherwise).")
@click.option("-u", "--user", is_flag=False, flag_value="", default=None, metavar="UID[:GID]",
              help="Identity that loads NVML; without a value, the caller's. Default: the kernel's overflow ids.")
@click.option("--config", "config_path", metavar="FILE", help="Configuration file. [default: /etc/nvcontainer/config.toml if present]")
@click.option("-k", "--load-kmods", is_flag=True, hidden=True, help="Accepted for nvidia-container-cli compatibility; modules are not loaded.")
@click.option("-n", "--no-pivot", is_flag=True, hidden=True, help="Accepted for nvidia-container-cli compatibility; the ldconfig sandbox needs no pivot choice.")
@click.version_option(__version__, "-V", "--version", prog_name=PROG, message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, root, ldcache, debug, user, config_path, load_kmods, no_pivot) -> None:
    """Inject a host's NVIDIA driver and GPUs into containers."""
    from . import config as configuration

    cfg = configuration.load(config_path).with_overrides(root=root, ldcache=ldcache, debug=debug, user=user)
    if cfg.debug:
        log.open_debug(cfg.debug)
        log.info(f"running {PROG} {__version__}: {' '.join(sys.argv[1:])}")
    if load_kmods:
        log.warning("--load-kmods ignored: nvcontainer does not load kernel modules")
    ctx.obj = _Context(cfg)


@cli.command()
@click.option("--csv", "as_csv", is_flag=True, help="Comma-separated output, as nvidia-container-cli.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--refresh", is_flag=True, help="Ask NVML and rescan the driver's files now, and rewrite the inventory cache.")
@click.pass_obj
def info(obj: _Context, as_csv: bool, as_json: bool, refresh: bool) -> None:
    """Driver and GPU facts."""
    from . import views

    if as_csv and as_json:
        raise click.UsageError("--csv and --json are exclusive")
    inv = obj.inventory(refresh=refresh)
    allow = obj.allow_list(inv)
    if as_json:
        sys.stdout.write(views.info_json(inv, allow))
        return
    render = views.info_csv if as_csv else views.info_text
    sys.stdout.write(render(inv))


@cli.command("list")
@click.option("-d", "--device", "devices", multiple=True, metavar="ID", help="GPUs to list (repeatable, comma lists).")
@click.option("-l", "--libraries", is_flag=True, help="Driver libraries (64-bit).")
@click.option("-b", "--binaries", is_flag=True, help="Driver binaries.")
@click.option("-i", "--ipcs", is_flag=True, help="IPC sockets and directories.")
@click.option("-f", "--firmwares", is_flag=True, help="GSP firmware files.")
@click.option("--compat32", is_flag=True, help="Also the 32-bit libraries (with --libraries).")
@click.option("--mig-config", metavar="ID", help="MIG config capability (only 'all').")
@click.option("--mig-monitor", metavar="ID", help="MIG monitor capability (only 'all').")
@click.option("--imex-channel", "imex", multiple=True, metavar="CHANNEL", help="IMEX channel ids.")
@click.option("--no-persistenced", is_flag=True)
@click.option("--no-fabricmanager", is_flag=True)
@click.option("--no-gsp-firmware", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="JSON output, by section.")
@click.pass_obj
def list_(obj: _Context, devices, libraries, binaries, ipcs, firmwares, compat32, mig_config, mig_monitor,
          imex, no_persistenced, no_fabricmanager, no_gsp_firmware, as_json) -> None:
    """What a container would be given: device nodes, binaries, libraries, IPCs, firmware."""
    from . import views
    from .selection import held_back, select, split_tokens

    channels = parse_imex_channels(imex)
    with_config = views.check_mig_option("mig-config", mig_config)
    with_monitor = views.check_mig_option("mig-monitor", mig_monitor)
    if not (devices or libraries or binaries or ipcs or firmwares or compat32 or with_config or with_monitor):
        devices, libraries, binaries, ipcs, firmwares, compat32 = ("all",), True, True, True, True, True
    opts = views.ListOptions(
        devices=bool(devices), libraries=libraries, binaries=binaries, ipcs=ipcs, firmwares=firmwares,
        compat32=compat32, mig_config=with_config, mig_monitor=with_monitor, imex_channels=channels,
        no_persistenced=no_persistenced, no_fabricmanager=no_fabricmanager, no_gsp_firmware=no_gsp_firmware,
    )
    tokens = split_tokens(devices)
    inv = obj.inventory()
    allow = obj.allow_list(inv)
    sel = select(inv, tokens, allow)
    sections = views.list_sections(inv, sel, opts)
    if as_json:
        sys.stdout.write(views.list_json(sections, views.held_back_paths(held_back(inv, allow))))
        return
    sys.stdout.write(views.list_text(sections))


@cli.command()
@click.option("-p", "--pid", type=int, metavar="PID", help="Container init PID (supervised mode).")
@click.option("-d", "--device", "devices", multiple=True, metavar="ID", help="GPUs or MIG devices (repeatable, comma lists); none: the driver only.")
@click.option("-r", "--require", "requirements", multiple=True, metavar="EXPR", help="A requirement every selected GPU must meet (repeatable, ANDed).")
@click.option("-l", "--ldconfig", metavar="@PATH", help="Host ldconfig to run, as @/absolute/path. [default: @/sbin/ldconfig, i.e. /sbin/ldconfig.real where the host has it]")
@click.option("-c", "--compute", is_flag=True, help="Compute libraries and binaries.")
@click.option("-u", "--utility", is_flag=True, help="Utility libraries and binaries (NVML, nvidia-smi).")
@click.option("-v", "--video", is_flag=True, help="Video libraries (brings the compute libraries).")
@click.option("-g", "--graphics", is_flag=True, help="Graphics libraries.")
@click.option("-D", "--display", is_flag=True, help="Display: graphics plus the modeset device.")
@click.option("-n", "--ngx", is_flag=True, help="NGX library.")
@click.option("--compat32", is_flag=True, help="Also the 32-bit libraries.")
@click.option("--mig-config", metavar="ID", help="MIG config capability (only 'all').")
@click.option("--mig-monitor", metavar="ID", help="MIG monitor capability (only 'all').")
@click.option("--imex-channel", "imex", multiple=True, metavar="CHANNEL", help="IMEX channel ids.")
@click.option("--no-cgroups", is_flag=True, help="Leave the devices cgroup alone.")
@click.option("--no-devbind", is_flag=True, help="Do not bind-mount device nodes (cgroup rules are still added).")
@click.option("--no-persistenced", is_flag=True)
@click.option("--no-fabricmanager", is_flag=True)
@click.option("--no-gsp-firmware", is_flag=True)
@click.option("--cuda-compat-mode", type=click.Choice(["ldconfig", "disabled"]), help="CUDA forward compatibility from the image's /usr/local/cuda/compat.")
@click.option("--no-cntlibs", is_flag=True, help="Same as --cuda-compat-mode=disabled.")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the plan as JSON (docs/plan.md).")
@click.argument("rootfs")
@click.pass_obj
def configure(obj: _Context, pid, devices, requirements, ldconfig, compute, utility, video, graphics, display, ngx,
              compat32, mig_config, mig_monitor, imex, no_cgroups, no_devbind, no_persistenced, no_fabricmanager,
              no_gsp_firmware, cuda_compat_mode, no_cntlibs, dry_run, as_json, rootfs) -> None:
    """Inject the driver and the selected GPUs into ROOTFS of container PID."""
    started = time.monotonic()  # one deadline for the whole run: NVML, mounts, cgroup, ldconfig
    from .configure import check_rootfs, options_from_config, plan_for
    from .request import request_from_options

    check_rootfs(rootfs)
    if pid is not None and not 1 < pid < (1 << 22):
        raise NvcError("input", f"invalid pid: {pid}")
    if ldconfig is not None and not (ldconfig.startswith("@/") and len(ldconfig) > 2):
        raise NvcError("input", f"--ldconfig: {escape(ldconfig)}: must be @ and an absolute host path "
                       "(an image's own ldconfig is never run)")
    flags = {"compute": compute, "utility": utility, "video": video, "graphics": graphics,
             "display": display, "ngx": ngx, "compat32": compat32}
    request = request_from_options(
        devices=devices, capabilities=[name for name, on in flags.items() if on], requirements=requirements,
        mig_config=mig_config, mig_monitor=mig_monitor, imex_channels=imex,
    )
    options = options_from_config(
        obj.config, no_cgroups=no_cgroups, no_devbind=no_devbind, no_persistenced=no_persistenced,
        no_fabricmanager=no_fabricmanager, no_gsp_firmware=no_gsp_firmware, ldconfig=ldconfig,
        cuda_compat_mode="disabled" if no_cntlibs else cuda_compat_mode,
    )
    plan = plan_for(request, obj.config, rootfs, pid, options, inventory=obj.inventory())
    if dry_run:
        sys.stdout.write(plan.dumps() if as_json else plan.text())
        return
    if pid is None:
        raise NvcError("input", "configure needs --pid PID of the container (or --dry-run)")
    from .apply.execute import apply

    apply(plan, deadline=obj.config.deadline - (time.monotonic() - started))


CDI_DIRS_HELP = "A CDI spec directory, lowest priority first (repeatable). [default: /etc/cdi, /var/run/cdi]"


@cli.group()
def cdi() -> None:
    """Container Device Interface specs: generate, list, check."""


@cdi.command("generate")
@click.option("-o", "--output", metavar="FILE", help="Write the spec to FILE, atomically. [default: standard output]")
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]),
              help="Spec format. [default: from FILE's extension, else yaml]")
@click.option("--device-name-strategy", "strategies", multiple=True, type=click.Choice(["index", "uuid", "type-index"]),
              help="How devices are named: 0 and 0:1, GPU-/MIG-<uuid>, gpu0 and mig0:1 (repeatable). [default: index, uuid]")
@click.option("--vendor", default="nvidia.com", show_default=True, help="Vendor part of the device names.")
@click.option("--class", "cls", default="gpu", show_default=True, help="Class part of the device names.")
@click.option("--no-all-device", is_flag=True, help="No 'all' device.")
@click.option("--hook-path", metavar="PATH", help="nvcontainer-hook as the runtime will run it. [default: the installed one]")
@click.pass_obj
def cdi_generate(obj: _Context, output, fmt, strategies, vendor, cls, no_all_device, hook_path) -> None:
    """A CDI spec for the driver and every GPU and MIG device."""
    from .cdi import commands, generate, store

    hook = hook_path or commands.default_hook_path()
    inv = obj.inventory()
    opts = generate.Options(
        hook_path=hook, vendor=vendor, cls=cls,
        strategies=tuple(dict.fromkeys(strategies)) or generate.DEFAULT_STRATEGIES, all_device=not no_all_device,
        ldconfig=obj.config.ldconfig_program(), allow=obj.allow_list(inv),
    )
    text = commands.generate_spec(inv, opts, store.format_for(output, fmt), output)
    if text is not None:
        sys.stdout.write(text)


@cdi.command("list")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
def cdi_list(spec_dirs) -> None:
    """The device names the spec directories offer."""
    from .cdi import commands, store

    lines, problems = commands.list_names(spec_dirs or store.DEFAULT_DIRS)
    for problem in problems:
        log.warning(problem)
        sys.stderr.write(f"{PROG}: warning: {problem}\n")
    sys.stdout.write("".join(line + "\n" for line in lines))


@cdi.command("check")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
@click.argument("files", nargs=-1, metavar="[FILE]...")
def cdi_check(spec_dirs, files) -> None:
    """Whether specs are stale for the running driver (exit status 1 if any is)."""
    from .cdi import commands, store

    dirs = spec_dirs or store.DEFAULT_DIRS
    verdicts, problems = commands.check_specs(dirs, files)
    if not verdicts and not problems:
        sys.stdout.write(f"no CDI specs in {', '.join(escape(d) for d in dirs)}\n")
    sys.stdout.write("".join(line + "\n" for v in verdicts for line in v.lines()))
    stale = [v for v in verdicts if v.stale]
    if problems or stale:
        raise NvcError("cdi", "; ".join([*problems, *(f"{escape(v.path)} is stale" for v in stale)]))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
@click.option("--spec-dir", "spec_dirs", multiple=True, metavar="DIR", help=CDI_DIRS_HELP)
@click.pass_obj
def doctor(obj: _Context, as_json: bool, spec_dirs) -> None:
    """Check this host's driver, devices and engine set-up; a verdict and a fix for each."""
    from . import doctor as checks
    from .cdi import store

    report = checks.examine(obj.config, spec_dirs or store.DEFAULT_DIRS)
    sys.stdout.write(checks.render_json(report) if as_json else checks.render_text(report))
    failed = [c for c in report if c.verdict == checks.FAIL]
    if failed:
        raise NvcError("doctor", f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}")


@cli.command()
@click.option("--socket", "socket_path", metavar="PATH", default="/run/nvcontainer/hook.sock", show_default=True,
              help="Where to listen (in a directory only root may enter; the socket is 0600).")
@click.option("--spare/--no-spare", default=True, show_default=True,
              help="Fork each request's child ahead, while idle, and warm its memory.")
@click.pass_obj
def serve(obj: _Context, socket_path: str, spare: bool) -> None:
    """Run hooks warm: a resident helper that nvcontainer-hook hands its runs to."""
    from . import serve as server

    def ready(status: str) -> None:
        sys.stderr.write(f"{PROG} serve: listening on {escape(socket_path)}; {status}\n")
        sys.stderr.flush()

    server.serve(socket_path, obj.config, ready=ready, spare=spare)


@cli.command("device-plugin")
@click.option("--socket-dir", metavar="DIR", help="The kubelet's device plugin directory. [default: /var/lib/kubelet/device-plugins]")
@click.option("--mig-strategy", type=click.Choice(["none", "single", "mixed"]), help="How MIG devices are advertised. [default: none]")
@click.option("--device-id-strategy", type=click.Choice(["uuid", "index"]), help="Device IDs by UUID or index. [default: uuid]")
@click.option("--device-list-strategy", multiple=True,
              type=click.Choice(["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]),
              help="How Allocate names the devices to the runtime (repeatable). [default: envvar]")
@click.option("--replicas", type=int, metavar="N", help="Time-slicing: advertise each device N times. [default: 1]")
@click.option("--sysfs", metavar="DIR", help="Where the GPUs' NUMA nodes are read. [default: /sys]")
@click.pass_obj
def device_plugin(obj: _Context, socket_dir, mig_strategy, device_id_strategy, device_list_strategy, replicas,
                  sysfs) -> None:
    """Serve the kubelet's Device Plugin API for this node's GPUs."""
    from .deviceplugin import command

    command.run(obj.config, socket_dir=socket_dir, mig_strategy=mig_strategy, device_id_strategy=device_id_strategy,
                device_list_strategy=device_list_strategy or None, replicas=replicas, sysfs=sysfs)


@cli.group()
def volume() -> None:
    """Consolidated driver volumes (nvidia_<version>/ with bin, lib, lib64) for legacy images."""


@volume.command("create")
@click.argument("directory", required=False)
@click.option("--capabilities", metavar="LIST", default="all", show_default=True,
              help="Capability groups whose files go in (comma list of compute, utility, video, graphics, "
                   "display, ngx, compat32, or all).")
@click.pass_obj
def volume_create(obj: _Context, directory, capabilities) -> None:
    """Build DIRECTORY/nvidia_<driver version> from the driver's files. [default DIRECTORY: driver-volume-dir]"""
    from . import volume as volumes
    from .request import CAPABILITIES

    wanted = {c.strip() for c in capabilities.split(",") if c.strip()}
    if "all" in wanted:
        wanted = set(CAPABILITIES)
    unknown = sorted(wanted - set(CAPABILITIES))
    if unknown or not wanted:
        raise NvcError("input", f"--capabilities: unknown capability '{escape(unknown[0] if unknown else '', 40)}' "
                                f"(known: {','.join(CAPABILITIES)}, all)")
    groups = set(wanted) - {"compat32", "display"} | ({"graphics"} if "display" in wanted else set()) \
        | ({"compute"} if "video" in wanted else set())
    res = volumes.create(directory or obj.config.driver_volume_dir, obj.inventory(), frozenset(groups),
                         "compat32" in wanted)
    copied = f" ({res.copied} files copied: another filesystem than the driver's)" if res.copied else ""
    sys.stdout.write(f"{'created' if res.created else 'unchanged'} {res.path}{copied}\n")


@volume.command("list")
@click.argument("directory", required=False)
@click.pass_obj
def volume_list(obj: _Context, directory) -> None:
    """The volumes in DIRECTORY: version, path, number of entries."""
    from . import volume as volumes

    for v in volumes.list_volumes(directory or obj.config.driver_volume_dir):
        sys.stdout.write(f"{v.version} {v.path} {v.files}\n")


@volume.command("remove")
@click.argument("directory")
@click.argument("version")
def volume_remove(directory, version) -> None:
    """Remove DIRECTORY/nvidia_VERSION (running containers keep theirs)."""
    from . import volume as volumes

    sys.stdout.write(f"removed {volumes.remove(directory, version)}\n")


@cli.command()
@click.argument("engine", type=click.Choice(["runc", "docker", "containerd", "podman", "crio"]))
@click.option("--dry-run", is_flag=True, help="Show what would change, as unified diffs; change nothing.")
@click.option("--prefix", metavar="DIR", default="/", show_default=True, help="Install under DIR instead of /.")
@click.option("--cdi", "with_cdi", is_flag=True, help="Also generate the CDI spec (/var/run/cdi/nvidia.yaml).")
@click.option("--hook-path", metavar="PATH", help="nvcontainer-hook as engines will run it. [default: the installed one]")
@click.option("--serve", "served", is_flag=True,
              help="Also install the nvcontainer serve service, and register its fast client as the hook "
                   "(native, built with the node's C compiler, when there is one).")
@click.option("--python-client", is_flag=True, help="With --serve: register the Python client, build nothing.")
@click.pass_obj
def setup(obj: _Context, engine, dry_run, prefix, with_cdi, hook_path, served, python_client) -> None:
    """Install (or show) what ENGINE needs to run the hook or use CDI devices."""
    import os

    from . import setup as engines
    from .cdi import commands

    hook = hook_path or commands.default_hook_path()
    serve = None
    if served:
        from . import hookclient

        from . import nativeclient

        native = None if python_client or nativeclient.compiler() is None else \
            os.path.join(os.path.dirname(hook), nativeclient.NAME)
        serve = engines.Served(python=sys.executable, client=os.path.abspath(hookclient.__file__),
                               cli=os.path.join(os.path.dirname(hook), "nvcontainer"), native=native)
    spec = None
    if with_cdi:
        from .cdi import generate

        inv = obj.inventory()
        opts = generate.Options(hook_path=hook, ldconfig=obj.config.ldconfig_program(),
                                allow=obj.allow_list(inv))
        spec = commands.generate_spec(inv, opts, "yaml", None)
    steps = engines.steps(engine, hook, os.path.dirname(hook), spec, serve)
    sys.stdout.write(engines.perform(steps, prefix=prefix, dry_run=dry_run,
                                     stamp=time.strftime("%Y%m%dT%H%M%S")))


def parse_imex_channels(values) -> tuple[int, ...]:
    out: dict[int, None] = {}
    for value in values:
        for token in value.split(","):
            token = token.strip()
            if not token:
                continue
            if not (token.isascii() and token.isdigit()) or len(token) > 7 or int(token) >= 1 << 20:
                raise NvcError("input", f"unsupported IMEX channel value: {escape(token)}")
            out[int(token)] = None
    return tuple(out)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    try:
        cli.main(args=argv, prog_name=prog, standalone_mode=False)
    except NvcError as exc:
        return log.fail(exc, prog)
    except click.exceptions.Abort:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 1
    except click.ClickException as exc:
        sys.stderr.write(f"{prog}: input error: {escape(exc.format_message())}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        log.close()
    return 0


def main_nvidia_container_cli() -> int:
    """The ``nvidia-container-cli`` drop-in: the same program under upstream's name, for engines
    that run that name with upstream's argv (containerd's ``ctr --gpus``)."""
    return main(prog="nvidia-container-cli")


if __name__ == "__main__":
    sys.exit(main())
