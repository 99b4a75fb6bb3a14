"""``nvcontainer setup ENGINE``: the engines' own files edited with backups, diffs, a record and an
undo; comments and unknown keys kept; versions checked; bad files refused whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nvcontainer.doctor import registrations
from nvcontainer.errors import NvcError
from nvcontainer.setup import containerd, engines, install, perform, record, tomltext

BIN = "/opt/nvc/bin"
INST = install.Install(bin_dir=BIN, python="/opt/nvc/bin/python3", client_module="/opt/nvc/lib/nvcontainer/hook/client.py",
                       client_ready=True, runtime_ready=True)
CLI = [sys.executable, "-m", "nvcontainer"]
ENV_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

DEBIAN_CONTAINERD = """\
version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""


def run(tmp, engine, *, undo=False, dry=False, stamp="T1", **opts):
    """setup (or undo) ENGINE in the tree ``tmp``, where INST is installed (so doctor can tell it is ours)."""
    if not dry:
        (tmp / BIN.lstrip("/")).mkdir(parents=True, exist_ok=True)
        (tmp / BIN.lstrip("/") / "nvcontainer").touch()
    w = engines.world(str(tmp))
    if undo:
        s = engines.undo(engine, record.load(str(tmp), engine), w)
    else:
        s = engines.steps(engines.Options(engine=engine, **opts), INST, w)
    return perform.perform(s, prefix=str(tmp), dry_run=dry, stamp=stamp)


def tree(tmp: Path) -> dict[str, str]:
    return {str(p.relative_to(tmp)): (os.readlink(p) if p.is_symlink() else p.read_bytes().decode(errors="replace"))
            for p in sorted(tmp.rglob("*")) if p.is_file() or p.is_symlink()}


def cli(*args, prefix=None):
    extra = ["--prefix", str(prefix), "--hook-path", f"{BIN}/nvcontainer-hook"] if prefix else []
    return subprocess.run([*CLI, "setup", *args, *extra], capture_output=True, text=True, timeout=120)


# --- podman and CRI-O hooks.d --------------------------------------------------------------------


@pytest.mark.parametrize("engine, opts, where", [
    ("podman", {}, "etc/containers/oci/hooks.d"), ("crio", {"hook": True}, "usr/share/containers/oci/hooks.d")])
def test_hooks_d_file_is_served_with_env_and_timeout(tmp_path, engine, opts, where):
    dry = run(tmp_path, engine, dry=True, **opts)
    assert f"would write /{where}/oci-nvcontainer-hook.json" in dry and not any(tmp_path.iterdir())
    run(tmp_path, engine, **opts)
    doc = json.loads((tmp_path / where / "oci-nvcontainer-hook.json").read_text())
    assert doc["hook"] == {"path": f"{BIN}/nvcontainer-hook-client", "args": [f"{BIN}/nvcontainer-hook-client",
                           "prestart"], "env": [ENV_PATH], "timeout": 60}
    assert doc["when"] == {"always": True} and doc["stages"] == ["prestart"]
    assert [w for _, w, _ in registrations.registrations(str(tmp_path))] == [
        f"nvcontainer hook {BIN}/nvcontainer-hook-client (client of nvcontainer serve)"]
    assert "unchanged" in run(tmp_path, engine, stamp="T2", **opts).split("\n")[0]
    run(tmp_path, engine, undo=True)
    assert not (tmp_path / where / "oci-nvcontainer-hook.json").exists()


def test_in_process_registration_and_a_longer_deadline(tmp_path):
    run(tmp_path, "podman", served=False, deadline=45.5)
    doc = json.loads((tmp_path / "etc/containers/oci/hooks.d/oci-nvcontainer-hook.json").read_text())
    assert doc["hook"] == {"path": f"{BIN}/nvcontainer-hook", "args": ["nvcontainer-hook", "prestart"],
                           "env": [ENV_PATH], "timeout": 76}
    assert not (tmp_path / "etc/systemd").exists()   # no server, no units


def test_the_shipped_hooks_d_examples_carry_env_and_timeout():
    for name in ("oci-nvcontainer-hook.json", "oci-nvcontainer-hook-served.json"):
        hook = json.loads((Path(__file__).parent.parent / "hooks" / name).read_text())["hook"]
        assert hook["env"] == [ENV_PATH] and hook["timeout"] == 60, name


def test_python_client_without_a_native_one(tmp_path):
    inst = install.Install(bin_dir=BIN, python="/opt/nvc/bin/python3", client_module="/x/client.py")
    s = engines.steps(engines.Options(engine="podman"), inst, engines.world(str(tmp_path)))
    (hooks_d,) = [c for c in s.changes if c.path.endswith(".json")]
    assert json.loads(hooks_d.content)["hook"]["args"] == ["/opt/nvc/bin/python3", "-I", "-S", "/x/client.py",
                                                           "prestart"]
    assert any("Python one" in n for n in s.notes) and not s.builds


# --- Docker ---------------------------------------------------------------------------------------


def test_docker_edits_daemon_json_keeping_keys_and_order_and_undoes_exactly(tmp_path):
    daemon = tmp_path / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    before = '{\n    "log-driver": "journald",\n    "runtimes": {"crun": {"path": "/usr/bin/crun"}},\n' \
             '    "default-runtime": "crun"\n}\n'
    daemon.write_text(before)
    report = run(tmp_path, "docker", set_as_default=True, version=(20, 10))
    doc = json.loads(daemon.read_text())
    assert list(doc) == ["log-driver", "runtimes", "default-runtime"]
    assert doc["runtimes"] == {"crun": {"path": "/usr/bin/crun"}, "nvidia": {"path": f"{BIN}/nvidia-container-runtime"}}
    assert doc["default-runtime"] == "nvidia" and daemon.read_text().startswith('{\n    "log-driver"')
    assert (tmp_path / "etc/docker/daemon.json.bak-T1").read_text() == before
    assert '-    "default-runtime": "crun"' in report and "restart: systemctl restart docker" in report
    assert os.readlink(tmp_path / "usr/local/bin/nvidia-container-runtime-hook") == \
        f"{BIN}/nvidia-container-runtime-hook"
    second = run(tmp_path, "docker", set_as_default=True, version=(20, 10), stamp="T2")
    assert "unchanged /etc/docker/daemon.json" in second and "restart:" in second
    assert not (tmp_path / "etc/docker/daemon.json.bak-T2").exists()
    run(tmp_path, "docker", undo=True, stamp="T3")
    assert daemon.read_text() == before and not (tmp_path / "usr/local/bin/nvidia-container-runtime-hook").exists()
    assert record.engines(str(tmp_path)) == []


def test_docker_undo_after_the_operator_changed_the_file_takes_back_only_our_keys(tmp_path):
    run(tmp_path, "docker", version=(20, 10))        # no daemon.json before: setup makes it
    run(tmp_path, "docker", version=(20, 10), set_as_default=True, stamp="T2")
    daemon = tmp_path / "etc/docker/daemon.json"
    doc = json.loads(daemon.read_text())
    daemon.write_text(json.dumps({"debug": True, **doc}, indent=2))
    report = run(tmp_path, "docker", undo=True, stamp="T3")
    assert json.loads(daemon.read_text()) == {"debug": True} and "restored" not in report


def test_docker_cdi_needs_docker_25(tmp_path):
    with pytest.raises(NvcError, match=r"--cdi: CDI devices in Docker \(features.cdi\) needs docker 25.0 or later; "
                                       r"this node has 20.10.24"):
        run(tmp_path, "docker", cdi=True, cdi_spec="cdiVersion: 0.5.0\n", version=(20, 10, 24))
    assert not (tmp_path / "etc").exists()
    run(tmp_path, "docker", cdi=True, cdi_spec="cdiVersion: 0.5.0\n", version=(25, 0, 3))
    assert json.loads((tmp_path / "etc/docker/daemon.json").read_text())["features"] == {"cdi": True}
    assert (tmp_path / "var/run/cdi/nvidia.yaml").read_text() == "cdiVersion: 0.5.0\n"


def test_docker_path_link_is_skipped_when_ours_is_on_path_already(tmp_path):
    (tmp_path / "opt/nvc/bin").mkdir(parents=True)
    (tmp_path / "opt/nvc/bin/nvidia-container-runtime-hook").write_text("#!/bin/sh\n")
    (tmp_path / "usr/bin").mkdir(parents=True)
    os.symlink(f"{BIN}/nvidia-container-runtime-hook", tmp_path / "usr/bin/nvidia-container-runtime-hook")
    s = engines.steps(engines.Options(engine="docker", version=(20, 10)), INST, engines.world(str(tmp_path)))
    assert not [c for c in s.changes if hasattr(c, "target")]


@pytest.mark.parametrize("text, fault", [('{"runtimes": {', "invalid JSON: Expecting"), ("[1]", "not a JSON object"),
                                         ('{"runtimes": 3}', "runtimes is not a JSON object")])
def test_a_bad_daemon_json_is_one_line_and_nothing_changes(tmp_path, text, fault):
    daemon = tmp_path / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text(text)
    res = cli("docker", "--engine-version", "20.10", prefix=tmp_path)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.startswith("nvcontainer: setup error: ") and res.stderr.count("\n") == 1
    assert "/etc/docker/daemon.json" in res.stderr and fault in res.stderr, res.stderr
    assert tree(tmp_path) == {"etc/docker/daemon.json": text}


# --- containerd -----------------------------------------------------------------------------------


def test_containerd_drop_in_keeps_the_cri_section_and_comments(tmp_path):
    main = tmp_path / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    text = "# the operator's comment\n" + DEBIAN_CONTAINERD.replace(
        '[plugins."io.containerd.grpc.v1.cri"]\n', '[plugins."io.containerd.grpc.v1.cri"]\n'
        '    sandbox_image = "example/pause:1"  # pinned\n'
        '    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
        '      SystemdCgroup = true\n')
    main.write_text(text)
    run(tmp_path, "containerd", version=(1, 6, 20))
    edited = main.read_text()
    assert edited == text.replace("version = 2\n", f'version = 2\nimports = ["{containerd.DROPIN}"]\n')
    drop = tomltext.parse((tmp_path / containerd.DROPIN.lstrip("/")).read_text(), "x")
    cri = drop["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "example/pause:1" and cri["cni"]["bin_dir"] == "/usr/lib/cni"
    assert cri["containerd"]["runtimes"]["nvidia"] == {
        "runtime_type": "io.containerd.runc.v2",
        "options": {"SystemdCgroup": True, "BinaryName": f"{BIN}/nvidia-container-runtime"}}
    assert "unchanged /etc/containerd/config.toml" in run(tmp_path, "containerd", version=(1, 6, 20), stamp="T2")
    found = registrations.registrations(str(tmp_path))
    assert ("containerd", f"nvcontainer runtime handler 'nvidia' ({BIN}/nvidia-container-runtime)",
            containerd.DROPIN) in found
    assert registrations.problems(str(tmp_path)) == []
    main.write_text(edited.replace("example/pause:1", "example/pause:2"))   # the operator changes CRI later
    assert registrations.problems(str(tmp_path)) == [
        f"{containerd.DROPIN}: its CRI section differs from /etc/containerd/config.toml's (changed since setup)"]
    main.write_text(edited)
    run(tmp_path, "containerd", undo=True, stamp="T3")
    assert main.read_text() == text and not (tmp_path / containerd.DROPIN.lstrip("/")).exists()


@pytest.mark.skipif(not shutil.which("containerd"), reason="containerd is not installed")
@pytest.mark.parametrize("default", [False, True])
def test_containerd_reads_the_result_as_intended(tmp_path, default):
    """containerd 1.6 itself is the oracle: its merged configuration (config dump) keeps the
    operator's CRI settings and the runc handler, and has ours."""
    main = tmp_path / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    main.write_text(DEBIAN_CONTAINERD)
    s = engines.steps(engines.Options(engine="containerd", version=(1, 6, 20), set_as_default=default), INST,
                      engines.world(str(tmp_path)))
    # containerd reads imports by absolute path: point the entry into the temporary tree
    real = str(tmp_path / containerd.DROPIN.lstrip("/"))
    for change in s.changes:
        path = tmp_path / change.path.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if hasattr(change, "content"):
            path.write_text(change.content.replace(f'"{containerd.DROPIN}"', f'"{real}"'))
    dump = subprocess.run(["containerd", "--config", str(main), "config", "dump"], capture_output=True, text=True,
                          timeout=60, check=True).stdout
    cri = tomltext.parse(dump, "dump")["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["cni"]["bin_dir"] == "/usr/lib/cni"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["runc"]["runtime_type"] == runtimes["nvidia"]["runtime_type"] == "io.containerd.runc.v2"
    assert runtimes["nvidia"]["options"]["BinaryName"] == f"{BIN}/nvidia-container-runtime"
    assert cri["containerd"]["default_runtime_name"] == ("nvidia" if default else "runc")


def test_containerd_cdi_needs_1_7_and_says_the_route(tmp_path):
    res = cli("containerd", "--cdi", "--engine-version", "1.6.20", prefix=tmp_path)
    assert res.returncode == 1 and res.stderr == (
        "nvcontainer: setup error: --cdi: CDI in containerd's CRI plugin (enable_cdi) needs containerd 1.7 or later; "
        "this node has 1.6.20; the runtime handler 'nvidia' (without --cdi) is the Kubernetes route here\n")
    assert not any(tmp_path.iterdir())
    main = tmp_path / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    main.write_text(DEBIAN_CONTAINERD)
    run(tmp_path, "containerd", cdi=True, cdi_spec="cdiVersion: 0.5.0\n", version=(1, 7, 2))
    cri = tomltext.parse((tmp_path / containerd.DROPIN.lstrip("/")).read_text(), "x")["plugins"][
        "io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]


def test_containerd_links_nvidia_container_cli_for_ctr_gpus(tmp_path):
    run(tmp_path, "containerd", version=(1, 6, 20))
    assert os.readlink(tmp_path / "usr/local/bin/nvidia-container-cli") == f"{BIN}/nvidia-container-cli"
    assert (tmp_path / "etc/containerd/config.toml").read_text() == \
        f'version = 2\nimports = ["{containerd.DROPIN}"]\n'


@pytest.mark.parametrize("text, fault", [("version = 2\n[plugins\n", "not valid TOML"),
                                         ("[plugins.cri]\nx = 1\n", "config version 1")])
def test_a_bad_containerd_config_is_one_line_and_nothing_changes(tmp_path, text, fault):
    main = tmp_path / "etc/containerd/config.toml"
    main.parent.mkdir(parents=True)
    main.write_text(text)
    res = cli("containerd", "--engine-version", "1.6.20", prefix=tmp_path)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and fault in res.stderr, res.stderr
    assert "/etc/containerd/config.toml" in res.stderr and tree(tmp_path) == {"etc/containerd/config.toml": text}


@pytest.mark.parametrize("text", [
    'version = 2\nimports = ["/etc/a.toml"] # mine\n[x]\n',
    'version = 2\nimports = [\n  "/etc/a.toml",  # mine\n  "/etc/b.toml",\n]\n[x]\na = 1\n',
    "# top\nversion = 2\n\n[plugins]\n"])
def test_the_imports_edit_is_one_entry_and_undoes(text):
    added = tomltext.add_import(text, containerd.DROPIN, "f")
    assert tomltext.parse(added, "f")["imports"][-1] == containerd.DROPIN
    assert tomltext.remove_import(added, containerd.DROPIN, "f") == text


# --- CRI-O ----------------------------------------------------------------------------------------


def test_crio_drop_in(tmp_path):
    run(tmp_path, "crio", set_as_default=True)
    doc = tomltext.parse((tmp_path / "etc/crio/crio.conf.d/99-nvidia.toml").read_text(), "x")
    assert doc == {"crio": {"runtime": {"default_runtime": "nvidia", "runtimes": {"nvidia": {
        "runtime_path": f"{BIN}/nvidia-container-runtime", "runtime_type": "oci"}}}}}
    assert ("CRI-O", f"nvcontainer runtime 'nvidia' ({BIN}/nvidia-container-runtime, the default runtime)",
            "/etc/crio/crio.conf.d/99-nvidia.toml") in registrations.registrations(str(tmp_path))


# --- the server's units, the record, the command line ------------------------------------------


def test_units_are_written_for_a_source_install_and_not_over_the_packages(tmp_path):
    run(tmp_path, "podman")
    socket = (tmp_path / "etc/systemd/system/nvcontainer-serve.socket").read_text()
    assert "ListenSequentialPacket=/run/nvcontainer/hook.sock\n" in socket and "SocketMode=0600\n" in socket
    service = (tmp_path / "etc/systemd/system/nvcontainer-serve.service").read_text()
    assert f"ExecStart={BIN}/nvcontainer serve --socket /run/nvcontainer/hook.sock\n" in service
    packaged = tmp_path / "pkg"
    (packaged / "usr/lib/systemd/system").mkdir(parents=True)
    (packaged / "usr/lib/systemd/system/nvcontainer-serve.socket").write_text(socket)
    report = run(packaged, "podman")
    assert not (packaged / "etc/systemd").exists()
    assert "run 'systemctl enable --now nvcontainer-serve.socket' on the node" in report


def test_a_symlink_in_place_of_a_file_is_refused(tmp_path):
    path = tmp_path / "etc/containers/oci/hooks.d/oci-nvcontainer-hook.json"
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, path)
    with pytest.raises(NvcError, match="not a regular file"):
        run(tmp_path, "podman")
    assert victim.read_text() == "keep\n"


def test_a_file_changed_between_deciding_and_writing_is_not_overwritten(tmp_path):
    s = engines.steps(engines.Options(engine="docker", version=(20, 10)), INST, engines.world(str(tmp_path)))
    daemon = tmp_path / "etc/docker/daemon.json"
    daemon.parent.mkdir(parents=True)
    daemon.write_text('{"debug": true}\n')
    with pytest.raises(NvcError, match="changed while setup ran"):
        perform.perform(s, prefix=str(tmp_path), stamp="T")
    assert daemon.read_text() == '{"debug": true}\n'


def test_cli_dry_run_changes_nothing_and_undo_all(tmp_path):
    res = cli("podman", "--dry-run", prefix=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "+++ /etc/containers/oci/hooks.d/oci-nvcontainer-hook.json" in res.stdout and not any(tmp_path.iterdir())
    for engine in ("podman", "crio"):
        assert cli(engine, prefix=tmp_path).returncode == 0
    assert record.engines(str(tmp_path)) == ["crio", "podman"]
    res = cli("all", "--undo", prefix=tmp_path)
    assert res.returncode == 0 and record.engines(str(tmp_path)) == []
    assert not [p for p in tree(tmp_path) if not p.startswith("opt/")]   # only the built programs remain
    bad = subprocess.run([*CLI, "setup", "lxc"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "'lxc' is not one of" in bad.stderr
    res = cli("podman", "--set-as-default", prefix=tmp_path)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "no default runtime" in res.stderr


def test_a_failed_build_registers_nothing(tmp_path, monkeypatch):
    from nvcontainer.native import build as nativeclient

    monkeypatch.setattr(nativeclient, "compiler", lambda: str(tmp_path / "no-cc"))
    inst = install.Install(bin_dir=BIN, python=sys.executable, client_module="c.py", can_build=True)
    s = engines.steps(engines.Options(engine="podman"), inst, engines.world(str(tmp_path)))
    with pytest.raises(NvcError, match="cannot run"):
        perform.perform(s, prefix=str(tmp_path), stamp="T")
    assert not any(tmp_path.rglob("*.json")) and not (tmp_path / "etc/systemd").exists()


@pytest.mark.skipif(not shutil.which("cc"), reason="no C compiler")
def test_cli_builds_the_native_client_once(tmp_path):
    first = cli("podman", prefix=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"built {BIN}/nvcontainer-hook-client: the native hook client (")
    program = tmp_path / BIN.lstrip("/") / "nvcontainer-hook-client"
    assert os.access(program, os.X_OK) and sys.executable.encode() in program.read_bytes()
    second = cli("podman", prefix=tmp_path)
    assert "built" not in second.stdout and "unchanged /etc/containers/oci/hooks.d" in second.stdout
