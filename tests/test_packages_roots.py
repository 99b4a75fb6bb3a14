"""The self-contained packages (scripts/bundle, scripts/package) on other systems: Debian 11
(glibc 2.31, Python 3.9), 12 and 13 (glibc 2.41, Python 3.13) roots made with mmdebstrap.

In each root the .deb is installed with the root's own dpkg (in a chroot, the way a node installs
it); then ``nvcontainer info`` and ``nvidia-container-cli list``, run in the chroot against the
fake GPU machine, give the same output in all three; a container started by runc with that
root's installed hook (run in the chroot) gets GPU 0 (ENXIO on its /dev/nvidia0); and purging
leaves the root as it was. The .rpm installed with ``rpm --root`` holds exactly the .deb's files.
Faults: a read-only /usr and a second install from the tarball, each one line, nothing left.

The roots are cached in /var/cache/nvcontainer-roots/SUITE (NVC_ROOTS_CACHE), one per suite, so
a second run costs a copy; the packages are dist/'s when they are newer than the tree (as
scripts/image decides), else built here. Root only, with mmdebstrap and network to Debian's
mirror for the first run (.ci/run runs it: scripts/install installs mmdebstrap and rpm).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import runtime
from tests.fixtures.fakegpu import FakeSpec
from tests.fixtures.fakegpu.runner import fake_proc_command

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("NVC_ROOTS_CACHE", "/var/cache/nvcontainer-roots"))
MIRROR = "http://deb.debian.org/debian"
SUITES = ("bullseye", "bookworm", "trixie")
ENXIO = "No such device or address"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mmdebstrap") or not shutil.which("rpm"),
                                reason="needs root, mmdebstrap and rpm (scripts/install)")


def sh(*argv, check=True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=kw.pop("timeout", 600), **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"{argv}: {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture(scope="module")
def packages() -> dict[str, Path]:
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dist = REPO / "dist"
    found = {"deb": dist / f"nvcontainer_{version}_amd64.deb", "rpm": dist / f"nvcontainer-{version}-1.x86_64.rpm",
             "tar": dist / f"nvcontainer_{version}_amd64.tar.gz"}
    sources = ["nvcontainer", "packaging", "man", "pyproject.toml", "setup.py", "README.md", "scripts/package",
               "scripts/bundle"]
    oldest = min((p.stat().st_mtime for p in found.values() if p.exists()), default=0)
    stale = len([p for p in found.values() if p.exists()]) < 3 or any(
        f.stat().st_mtime > oldest for s in sources for f in ([REPO / s] if (REPO / s).is_file() else (REPO / s).rglob("*"))
        if f.is_file() and f.suffix != ".pyc")
    if stale:
        sh(REPO / "scripts/package", timeout=1800)
    return found


def cached_root(suite: str) -> Path:
    root = CACHE / suite
    if not (root / "usr/bin/dpkg").exists():
        part = CACHE / f"{suite}.part"
        shutil.rmtree(part, ignore_errors=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        sh("mmdebstrap", "--quiet", "--variant=minbase", "--format=directory", suite, part, MIRROR, timeout=900)
        shutil.rmtree(root, ignore_errors=True)
        part.rename(root)
    return root


def scratch(suite: str, dest: Path) -> Path:
    sh("cp", "-a", cached_root(suite), dest)
    return dest


def manifest(root: Path) -> dict[str, str]:
    """Every path of the root but dpkg's own records and logs: type, mode, size, link target."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel.startswith(("var/lib/dpkg", "var/log", "var/cache", "tmp", "proc")):
            dirs[:] = []
            continue
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.join(rel, name)] = (f"{st.st_mode:o} {st.st_size if not os.path.isdir(p) else 0} "
                                            f"{os.readlink(p) if os.path.islink(p) else ''}")
    return out


def dpkg_install(root: Path, deb: Path, *wrap: str) -> subprocess.CompletedProcess:
    shutil.copy2(deb, root / "tmp/nvcontainer.deb")
    try:
        return sh(*wrap, "chroot", root, "dpkg", "-i", "/tmp/nvcontainer.deb", check=False,
                  env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"})
    finally:
        (root / "tmp/nvcontainer.deb").unlink()


@pytest.fixture(scope="module")
def roots(packages, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each suite's scratch root with the .deb installed by its dpkg, and its manifest before."""
    out = {}
    for suite in SUITES:
        root = scratch(suite, tmp_path_factory.mktemp(suite) / "root")
        before = manifest(root)
        res = dpkg_install(root, packages["deb"])
        assert res.returncode == 0, f"{suite}: {res.stdout}\n{res.stderr}"
        out[suite] = (root, before)
    return out


# in the fake machine's /proc view: the root's /proc is that view, the fake machine (its mock
# NVML reads its description there) and the test's directory at their own paths; then the
# command (in the chroot, or runc beside it)
IN_ROOT = r"""
set -e
root=$1
shift
mount --rbind /proc "$root/proc"
mount --rbind /sys "$root/sys"
for dir in "$1" "$2"; do
    mkdir -p "$root$dir"
    mount --bind "$dir" "$root$dir"
done
shift 2
exec "$@"
"""


def in_root(machine, root: Path, shared: Path, argv: list) -> subprocess.CompletedProcess:
    return sh(*fake_proc_command(machine, ["sh", "-c", IN_ROOT, "in-root", str(root), str(machine.base),
                                           str(shared), *map(str, argv)]), check=False)


@pytest.fixture(scope="module")
def machine(fake_machine_factory):
    return fake_machine_factory(FakeSpec(gpus=2))


def test_info_and_list_are_the_same_on_debian_11_12_and_13(roots, machine, tmp_path):
    outputs = {}
    for suite, (root, _) in roots.items():
        got = []
        for argv in (["/usr/bin/nvcontainer", "--root", machine.root, "info"],
                     ["/usr/bin/nvidia-container-cli", "--root", machine.root, "list"]):
            res = in_root(machine, root, tmp_path, ["chroot", root, *argv])
            assert res.returncode == 0 and res.stderr == "", f"{suite} {argv}: {res.stderr}"
            got.append(res.stdout)
        outputs[suite] = got
    info, listing = outputs["bookworm"]
    assert "NVRM version:" in info and "/dev/nvidia0" in listing and "libcuda.so" in listing
    assert outputs["bullseye"] == outputs["bookworm"] == outputs["trixie"]
    # nothing of the root's userland is ours: no Python at all (minbase), and its own glibc
    for suite, glibc in (("bullseye", "2.31"), ("bookworm", "2.36"), ("trixie", "2.41")):
        root = roots[suite][0]
        assert not (root / "usr/bin/python3").exists()
        assert sh("chroot", root, "dpkg-query", "-W", "-f=${Version}", "libc6").stdout.startswith(glibc)


@pytest.mark.parametrize("suite", SUITES)
def test_a_runc_container_gets_its_gpu_from_each_roots_hook(roots, machine, tmp_path, suite):
    root, _ = roots[suite]
    bundle = runtime.make_bundle(tmp_path, machine, ["NVIDIA_VISIBLE_DEVICES=0"],
                                 'echo "OPEN0:$(cat /dev/nvidia0 2>&1 | head -1)"; '
                                 'echo "NODES:$(ls /dev | grep nvidia | sort | tr \'\\n\' \' \')"')
    spec = json.loads((bundle / "config.json").read_text())
    hooks = spec["hooks"]["prestart"]
    hooks[1] = {"path": "/usr/sbin/chroot", "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "timeout": 120,
                "args": ["chroot", str(root), "/usr/bin/nvcontainer-hook", "--root", str(machine.root), "prestart"]}
    (bundle / "config.json").write_text(json.dumps(spec))
    wrap = ["sh", "-c", IN_ROOT, "in-root", str(root), str(machine.base), str(tmp_path)]
    res = runtime.run_container(machine, bundle, wrap=wrap)
    assert res.returncode == 0, res.stderr
    got = runtime.parse_facts(res.stdout)
    assert got["OPEN0"] == [f"cat: can't open '/dev/nvidia0': {ENXIO}"], res.stdout
    nodes = got["NODES"][0].split()
    assert "nvidia0" in nodes and "nvidia1" not in nodes


def test_a_second_install_from_the_tarball_is_one_line(roots, packages, tmp_path):
    root, _ = roots["bookworm"]
    before = manifest(root)
    sh("tar", "-C", root / "tmp", "-xzf", packages["tar"])
    (top,) = [p for p in (root / "tmp").iterdir() if p.name.startswith("nvcontainer-")]
    res = sh("chroot", root, f"/tmp/{top.name}/install.sh", check=False)
    shutil.rmtree(top)
    assert res.returncode != 0
    assert res.stderr.splitlines() == ["nvcontainer: already installed from the .deb (dpkg -P nvcontainer): "
                                       "remove that one first"]
    assert manifest(root) == before


def test_a_read_only_usr_is_one_line_and_nothing_installed(packages, tmp_path):
    root = scratch("bullseye", tmp_path / "root")
    before = manifest(root)
    res = dpkg_install(root, packages["deb"], "unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                       'mount --bind "$1/usr" "$1/usr" && mount -o remount,bind,ro "$1/usr" && shift && exec "$@"',
                       "ro-usr", str(root))
    assert res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if line.startswith("nvcontainer:")]
    assert ours == ["nvcontainer: /usr/lib cannot be written (read-only /usr?): nothing installed"], res.stderr
    status = sh("chroot", root, "dpkg-query", "-W", "-f=${Status}", "nvcontainer", check=False).stdout
    assert "installed" not in status.replace("not-installed", "")
    assert manifest(root) == before


PROC = 'mount -t proc proc "$1/proc" && shift && exec "$@"'


def test_the_tarball_installs_runs_and_uninstalls_to_the_root_as_it_was(packages, tmp_path):
    root = scratch("trixie", tmp_path / "root")
    before = manifest(root)
    sh("tar", "-C", root / "tmp", "-xzf", packages["tar"])
    (top,) = [p for p in (root / "tmp").iterdir() if p.name.startswith("nvcontainer-")]
    ns = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", PROC, "proc", str(root), "chroot", str(root)]
    sh(*ns, f"/tmp/{top.name}/install.sh")
    assert sh(*ns, "/usr/bin/nvidia-container-cli", "--version").stdout.startswith("nvcontainer ")
    assert (root / "etc/nvcontainer/config.toml").is_file()
    sh(*ns, "/usr/share/nvcontainer/install.sh", "--uninstall")
    shutil.rmtree(top)
    assert manifest(root) == before


def test_the_rpm_holds_exactly_the_debs_files(packages, tmp_path):
    root = tmp_path / "rpmroot"
    root.mkdir()
    sh("rpm", "--root", root, "--initdb")
    sh("rpm", "--root", root, "-i", "--nodeps", "--noscripts", "--ignorearch", packages["rpm"])
    rpm_files = {"/" + str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}
    rpm_files = {p for p in rpm_files if not p.startswith(("/var/lib/rpm", "/usr/lib/sysimage/rpm", "/root/.rpmdb"))}  # its database
    listing = sh("sh", "-c", f"dpkg-deb --fsys-tarfile {packages['deb']} | tar -t").stdout.splitlines()
    deb_files = {p[1:].rstrip("/") for p in listing if not p.endswith("/")}
    assert rpm_files == deb_files
    assert len(deb_files) > 1000


def test_purge_leaves_each_root_as_it_was(roots):
    for suite, (root, before) in roots.items():
        res = sh("chroot", root, "dpkg", "-P", "nvcontainer", check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        assert res.returncode == 0, f"{suite}: {res.stderr}"
        after = manifest(root)
        assert after == before, f"{suite}: {set(after.items()) ^ set(before.items())}"


if __name__ == "__main__":   # python -m tests.test_packages_roots: make the cached roots
    for s in SUITES:
        print(cached_root(s), file=sys.stderr)
