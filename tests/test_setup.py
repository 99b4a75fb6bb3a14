"""``nvcontainer setup ENGINE``: files written atomically with backups and diffs, never blindly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvcontainer.doctor import registrations
from nvcontainer.setup import engines as setup
from nvcontainer.errors import NvcError

HOOK = "/opt/nvc/bin/nvcontainer-hook"
CLI = [sys.executable, "-m", "nvcontainer"]


@pytest.mark.parametrize("engine", ["podman", "crio"])
def test_hooks_d_file_is_installed_and_doctor_sees_it(tmp_path, engine):
    s = setup.steps(engine, HOOK, "/opt/nvc/bin")
    dry = setup.perform(s, prefix=str(tmp_path), dry_run=True, stamp="T")
    assert dry.startswith("would write ") and f'+    "path": "{HOOK}",' in dry
    assert not any(tmp_path.iterdir())   # a dry run writes nothing
    report = setup.perform(s, prefix=str(tmp_path), stamp="T")
    (f,) = s.files
    written = json.loads((tmp_path / f.path.lstrip("/")).read_text())
    assert written["hook"] == {"path": HOOK, "args": ["nvcontainer-hook", "prestart"]}
    assert written["stages"] == ["prestart"] and written["when"] == {"always": True}
    assert report.startswith(f"wrote {f.path}\n")
    assert [what for _, what, _ in registrations.registrations(str(tmp_path))] == [f"nvcontainer hook {HOOK}"]
    assert setup.perform(s, prefix=str(tmp_path), stamp="U").startswith(f"unchanged {f.path}")


def test_an_operators_file_is_backed_up_and_diffed(tmp_path):
    s = setup.steps("podman", HOOK, "/opt/nvc/bin")
    (f,) = s.files
    path = tmp_path / f.path.lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text('{"mine": true}\n')
    report = setup.perform(s, prefix=str(tmp_path), stamp="20240101T000000")
    assert (tmp_path / (f.path.lstrip("/") + ".bak-20240101T000000")).read_text() == '{"mine": true}\n'
    assert '-{"mine": true}' in report and "previous contents in" in report
    assert json.loads(path.read_text())["hook"]["path"] == HOOK
    assert sorted(os.listdir(path.parent)) == [path.name, path.name + ".bak-20240101T000000"]   # no temporary


def test_a_symlink_in_place_of_the_file_is_refused(tmp_path):
    s = setup.steps("crio", HOOK, "/opt/nvc/bin")
    (f,) = s.files
    path = tmp_path / f.path.lstrip("/")
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, path)
    with pytest.raises(NvcError, match="not a regular file"):
        setup.perform(s, prefix=str(tmp_path), stamp="T")
    assert victim.read_text() == "keep\n"


def test_docker_links_the_drop_in_name_and_prints_the_daemon_fragment(tmp_path):
    s = setup.steps("docker", HOOK, "/opt/nvc/bin")
    report = setup.perform(s, prefix=str(tmp_path), stamp="T")
    link = tmp_path / "usr/local/bin/nvidia-container-runtime-hook"
    assert os.readlink(link) == "/opt/nvc/bin/nvidia-container-runtime-hook"
    assert "merge into /etc/docker/daemon.json:" in report and '"cdi": true' in report
    assert not (tmp_path / "etc/docker/daemon.json").exists()   # the operator's file is left alone
    assert "unchanged" in setup.perform(s, prefix=str(tmp_path), stamp="T2")
    # someone else's program under that name is kept as a backup, not overwritten
    os.unlink(link)
    link.write_text("#!/bin/sh\n")
    report = setup.perform(s, prefix=str(tmp_path), stamp="T3")
    assert "kept as /usr/local/bin/nvidia-container-runtime-hook.bak-T3" in report
    assert (tmp_path / "usr/local/bin/nvidia-container-runtime-hook.bak-T3").read_text() == "#!/bin/sh\n"


def test_containerd_and_runc_print_fragments_only(tmp_path):
    for engine, needle in (("containerd", "enable_cdi = true"), ("runc", f'"path": "{HOOK}"')):
        report = setup.perform(setup.steps(engine, HOOK, "/opt/nvc/bin"), prefix=str(tmp_path), stamp="T")
        assert needle in report
    assert not any(tmp_path.iterdir())


def test_cdi_spec_is_one_more_file():
    s = setup.steps("containerd", HOOK, "/opt/nvc/bin", cdi_spec="cdiVersion: 0.5.0\n")
    assert [f.path for f in s.files] == [setup.CDI_SPEC]
    assert not any("--cdi" in n for n in s.notes)


def test_cli_dry_run(tmp_path):
    res = subprocess.run([*CLI, "setup", "podman", "--dry-run", "--prefix", str(tmp_path), "--hook-path", HOOK],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "+++ /etc/containers/oci/hooks.d/oci-nvcontainer-hook.json" in res.stdout
    assert not any(tmp_path.iterdir())
    bad = subprocess.run([*CLI, "setup", "lxc"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1


def test_serve_installs_the_service_and_registers_the_client(tmp_path):
    served = setup.Served(python="/opt/nvc/bin/python", client="/opt/nvc/lib/nvcontainer/hook/client.py",
                          cli="/opt/nvc/bin/nvcontainer")
    s = setup.steps("podman", HOOK, "/opt/nvc/bin", served=served)
    setup.perform(s, prefix=str(tmp_path), stamp="T")
    hooks_d = json.loads((tmp_path / "etc/containers/oci/hooks.d/oci-nvcontainer-hook.json").read_text())
    assert hooks_d["hook"] == {"path": "/opt/nvc/bin/python",
                               "args": ["/opt/nvc/bin/python", "-I", "-S", served.client, "prestart"]}
    unit = (tmp_path / "etc/systemd/system/nvcontainer-serve.service").read_text()
    assert "ExecStart=/opt/nvc/bin/nvcontainer serve --socket /run/nvcontainer/hook.sock\n" in unit
    assert any("systemctl enable --now nvcontainer-serve.service" in n for n in s.notes)
    assert [what for _, what, _ in registrations.registrations(str(tmp_path))] == [
        "nvcontainer hook /opt/nvc/bin/python (client of nvcontainer serve)"]
    for engine in ("runc", "docker", "containerd", "crio"):
        assert setup.UNIT_PATH in [f.path for f in setup.steps(engine, HOOK, "/opt/nvc/bin", served=served).files]
    runc = setup.steps("runc", HOOK, "/opt/nvc/bin", served=served)
    assert json.loads(runc.fragments[0][1])["hooks"]["prestart"] == [served.entry()]
    assert any("no C compiler" in n for n in s.notes) and not s.builds


def test_serve_builds_the_native_client_before_registering_it(tmp_path):
    native = "/opt/nvc/bin/nvcontainer-hook-client"
    served = setup.Served(python=sys.executable, client="/opt/nvc/lib/nvcontainer/hook/client.py",
                          cli="/opt/nvc/bin/nvcontainer", native=native)
    s = setup.steps("podman", HOOK, "/opt/nvc/bin", served=served)
    assert s.builds == (setup.BuildClient(native, sys.executable),)
    report = setup.perform(s, prefix=str(tmp_path), stamp="T")
    assert report.startswith(f"built {native}: the native hook client (")
    program = tmp_path / native.lstrip("/")
    assert os.access(program, os.X_OK) and sys.executable.encode() in program.read_bytes()
    hooks_d = json.loads((tmp_path / "etc/containers/oci/hooks.d/oci-nvcontainer-hook.json").read_text())
    assert hooks_d["hook"] == {"path": native, "args": [native, "prestart"]}
    assert [what for _, what, _ in registrations.registrations(str(tmp_path))] == [
        f"nvcontainer hook {native} (client of nvcontainer serve)"]


def test_a_failed_build_registers_nothing(tmp_path, monkeypatch):
    from nvcontainer.native import build as nativeclient

    monkeypatch.setattr(nativeclient, "compiler", lambda: str(tmp_path / "no-cc"))
    served = setup.Served(python=sys.executable, client="c.py", cli="nvcontainer", native="/opt/nvc/bin/client")
    with pytest.raises(NvcError, match="cannot run"):
        setup.perform(setup.steps("podman", HOOK, "/opt/nvc/bin", served=served), prefix=str(tmp_path), stamp="T")
    assert not any(tmp_path.rglob("*.json")) and not (tmp_path / "etc/systemd").exists()


@pytest.mark.parametrize("extra, native", [((), True), (("--python-client",), False)])
def test_cli_serve_names_this_installation(tmp_path, extra, native):
    res = subprocess.run([*CLI, "setup", "crio", "--serve", *extra, "--dry-run", "--prefix", str(tmp_path),
                          "--hook-path", HOOK], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    import nvcontainer.hook.client

    client = f'"{os.path.abspath(nvcontainer.hook.client.__file__)}",'
    if native:   # this machine has a C compiler (the tests build the mock NVML with it)
        assert res.stdout.startswith("would build /opt/nvc/bin/nvcontainer-hook-client: the native hook client")
        assert '"path": "/opt/nvc/bin/nvcontainer-hook-client"' in res.stdout and client not in res.stdout
    else:
        assert client in res.stdout and "would build" not in res.stdout
    assert "ExecStart=/opt/nvc/bin/nvcontainer serve" in res.stdout
    assert not any(tmp_path.iterdir())
