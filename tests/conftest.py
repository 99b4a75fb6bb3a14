import os
import sys
from pathlib import Path

import pytest

# The device plugin's tests run a fake kubelet and gRPC clients in this process, and most other
# tests fork workers that enter a container's mount namespace. With gRPC's fork support on (its
# default), gRPC's fork handler starts a thread in every forked child, and setns(CLONE_NEWNS)
# refuses a multi-threaded caller (EINVAL): the mount-worker tests that ran after the device
# plugin's failed whenever no standby worker from before was left. The product never mixes the
# two (the hook's path never imports gRPC; the plugin forks only to exec its watcher), so only
# this process turns it off; the plugin it starts gets the environment without it.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

pytest_plugins = ["tests.fixtures.fakegpu.plugin", "tests.fixtures.nodeharness.plugin"]


@pytest.fixture(scope="session")
def native_client(tmp_path_factory) -> str:
    """The native hook client, built as ``nvcontainer setup --serve`` builds it, for this
    interpreter (its fallback)."""
    from nvcontainer.native import build as nativeclient

    path = str(tmp_path_factory.mktemp("native") / nativeclient.NAME)
    nativeclient.build(path, sys.executable)
    return path


# The fast tier (`pytest -m fast`, docs/testing.md): the modules that test pure code (parsing,
# deciding, bounded readers, the benchmarks' arithmetic) with neither root, nor the fake GPU
# machine, nor a runtime or engine; under a minute, so a change to pure code gets its answer at
# once. A module joins when all of its tests do; one that needs root or the machine stays out.
FAST = frozenset({
    "test_benchmarks_dockertrace.py", "test_benchmarks_judging.py", "test_benchmarks_targets.py", "test_bounded.py",
    "test_cli_argp.py", "test_config.py", "test_deviceplugin_core.py", "test_dra_execplugin.py", "test_dra_kubeapi.py", "test_dra_opaque.py",
    "test_dra_prepared.py", "test_elfinfo.py", "test_ldcache.py", "test_leases_bounds.py", "test_leases_grant.py",
    "test_oci.py", "test_realgpu_engines.py", "test_records.py", "test_request.py", "test_require.py",
    "test_visible_devices.py",
})


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """With ``-m fast`` alone, the other modules are not even imported (their imports, gRPC's
    among them, would cost the tier seconds)."""
    if (config.getoption("markexpr") == "fast" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and collection_path.name not in FAST):
        return True
    return None


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in FAST and item.path.parent.name == "tests":
            item.add_marker(pytest.mark.fast)
