import os
import sys

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
