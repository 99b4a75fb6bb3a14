"""The installer's pod from the built image, run by the node harness as a kubelet would
(tests/fixtures/nodeharness: podman, the manifest's command, env, securityContext, hostPID and
volumes, the host's / being the node root that holds the fake GPU machine): it installs into the
node's /usr/local, registers with the node's containerd configuration, writes the CDI spec and the
ready file, the device plugin's pod then gets past its wait, and SIGTERM puts the node's files
back byte for byte. Skipped where the harness is not in the tree."""

from __future__ import annotations

import os
import time
import tomllib

import pytest

from nvcontainer.setup import containerd as containerd_setup
from tests.fixtures.fakegpu import FakeSpec

nodeharness = pytest.importorskip("tests.fixtures.nodeharness")
MAIN = "version = 2\n# the node's own file\n"


def test_the_installer_pod_installs_registers_and_puts_the_node_back(harness_node_factory):
    from tests.fixtures.nodeharness import manifests

    node = harness_node_factory(FakeSpec(gpus=2))
    objects = manifests.render("base")
    main = node.host("/etc/containerd/config.toml")
    main.parent.mkdir(parents=True, exist_ok=True)
    main.write_text(MAIN)
    run = node.run_pod(manifests.daemonsets(objects)["nvcontainer-installer"], objects)
    try:
        run.wait_for("ready: /run/nvcontainer/validations/toolkit-ready", timeout=180)
        dropin = tomllib.loads(node.host(containerd_setup.DROPIN).read_text())
        handler = dropin["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["nvidia"]
        assert handler["options"]["BinaryName"] == "/usr/local/nvcontainer/current/bin/nvidia-container-runtime"
        assert os.access(node.host("/usr/local/nvcontainer/current/bin/nvidia-container-runtime"), os.X_OK)
        assert node.host("/var/run/cdi/nvidia.yaml").exists(), run.wait_for("CDI", timeout=1)
        # the device plugin's init container now gets past its wait
        plugin = node.run_pod(manifests.daemonsets(objects)["nvcontainer-device-plugin"], objects)
        plugin.stop()
    finally:
        codes = run.stop()
    log = run.logs["installer"].read_text()
    assert codes == {"installer": 0}, log
    assert "wrote the CDI spec /var/run/cdi/nvidia.yaml" in log and "putting the node back" in log, log
    assert main.read_text() == MAIN
    assert not node.host(containerd_setup.DROPIN).exists()
    assert not os.path.lexists(node.host("/usr/local/nvcontainer/current"))
    assert not node.host("/run/nvcontainer/validations/toolkit-ready").exists()


def test_a_bad_setting_is_one_line_in_the_log_and_the_pod_s_termination_message(harness_node_factory):
    """The installer's pod with a setting it refuses (the manifest's env, one value changed):
    it ends non-zero at once, and its one line is in the log and in the file the kubelet reads
    for the pod's status (terminationMessagePath); the node's files are not touched."""
    import copy

    from tests.fixtures.nodeharness import manifests

    node = harness_node_factory(FakeSpec(gpus=2))
    objects = manifests.render("base")
    ds = copy.deepcopy(manifests.daemonsets(objects)["nvcontainer-installer"])
    (installer,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "installer"]
    installer["env"] = [e for e in installer.get("env", []) if e["name"] != "RUNTIME_RESTART_MODE"]
    installer["env"].append({"name": "RUNTIME_RESTART_MODE", "value": "kill"})
    main = node.host("/etc/containerd/config.toml")
    main.parent.mkdir(parents=True, exist_ok=True)
    main.write_text(MAIN)
    run = node.run_pod(ds, objects)
    try:
        codes = run.wait(120)
    finally:
        run.stop()
    message = run.termination("installer")
    assert codes["installer"] != 0 and message.count("\n") == 1 and "RUNTIME_RESTART_MODE=" in message, message
    assert message.strip() in run.log("installer") and "Traceback" not in run.log("installer")
    assert main.read_text() == MAIN and not node.host(containerd_setup.DROPIN).exists()
    assert not os.path.lexists(node.host("/usr/local/nvcontainer/current"))
