import sys

import pytest

pytest_plugins = ["tests.fixtures.fakegpu.plugin"]


@pytest.fixture(scope="session")
def native_client(tmp_path_factory) -> str:
    """The native hook client, built as ``nvcontainer setup --serve`` builds it, for this
    interpreter (its fallback)."""
    from nvcontainer.native import build as nativeclient

    path = str(tmp_path_factory.mktemp("native") / nativeclient.NAME)
    nativeclient.build(path, sys.executable)
    return path
