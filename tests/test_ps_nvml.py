"""The inventory's NVML child answers ``ps``'s question (running processes, utilisation) from
the mock NVML's per-process usage."""

from __future__ import annotations

import pytest

from nvcontainer.errors import NvcError
from nvcontainer.inventory import nvml
from tests.fixtures.fakegpu.build import set_activity
from tests.fixtures.fakegpu.spec import FakeSpec


@pytest.fixture(scope="module")
def machine(private_machine):
    return private_machine(FakeSpec(gpus=3))


def test_activity_reports_processes_and_rates(machine):
    quiet = nvml.activity(str(machine.nvml_library), None)
    assert [g["processes"] for g in quiet["gpus"]] == [[], [], []]
    assert {g["utilization"] for g in quiet["gpus"]} == {None}
    busy = set_activity(machine, processes=((2, 4242, 5 << 30, "compute", 70), (2, 4243, 0, "graphics", 0),
                                            (0, 4242, 1024, "compute", 1), (2, 4242, 6 << 30, "graphics", 0)),
                        utilization=((1, 2), (3, 4)))
    try:
        got = nvml.activity(str(busy.nvml_library), None)
        g0, g1, g2 = got["gpus"]
        assert g2["uuid"] == machine.description()["gpus"][2]["uuid"]
        assert g0["processes"] == [{"pid": 4242, "memory": 1024, "kinds": ["compute"], "sm": 1}]
        assert g1["processes"] == [] and (g1["utilization"], g1["memory_utilization"]) == (3, 4)
        # one pid with a compute and a graphics context: one process, the larger memory
        assert g2["processes"] == [{"pid": 4242, "memory": 6 << 30, "kinds": ["compute", "graphics"], "sm": 70},
                                   {"pid": 4243, "memory": 0, "kinds": ["graphics"], "sm": 0}]
        assert g2["utilization"] is None
        machine.nvml_state.write_text("fail=999\n")
        with pytest.raises(NvcError):
            nvml.activity(str(busy.nvml_library), None)
    finally:
        machine.nvml_state.unlink(missing_ok=True)
        set_activity(machine)
