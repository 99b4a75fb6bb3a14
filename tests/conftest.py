pytest_plugins = ["tests.fixtures.fakegpu.plugin"]
