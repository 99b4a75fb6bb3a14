"""The prepared claims' records (dra/node/prepared.py): a checkpoint written before they were
records (the literal below is what the dict-based code wrote for an MPS + time-sliced claim, an
adminAccess MIG share and a claim of no device here) loads into them and is written back byte
for byte, and a damaged entry is refused with one line. Pure: no machine needed."""

from __future__ import annotations

import json

import pytest

from nvcontainer.cdi.spec import Spec
from nvcontainer.dra import opaque
from nvcontainer.dra.node import checkpoint, claims, claimspec
from nvcontainer.dra.node.prepared import PreparedClaim
from nvcontainer.errors import NvcError
from nvcontainer.inventory.model import Gpu, MigDevice

UID1 = "3f1c8f36-0000-4000-8000-000000000001"
UID2 = "3f1c8f36-0000-4000-8000-000000000002"
UID3 = "3f1c8f36-0000-4000-8000-000000000003"
GPU0 = Gpu(index=0, minor=0, model="A100", brand="Nvidia", uuid="GPU-00000000-0000-0000-0000-000000000000",
           bus_id="00000000:07:00.0", arch="8.0")
GPU1 = Gpu(index=1, minor=1, model="A100", brand="Nvidia", uuid="GPU-11111111-1111-1111-1111-111111111111",
           bus_id="00000000:08:00.0", arch="8.0")
MIG = MigDevice(parent=1, index=0, uuid="MIG-22222222-2222-2222-2222-222222222222", gi=1, ci=0, gi_access="",
                ci_access="")
WRITTEN = (  # what the dict-based code wrote (checkpoint.save, sort_keys, compact), one claim after another
    '{"claims":{"3f1c8f36-0000-4000-8000-000000000001":{"devices":[{"cdi":["k8s.gpu.nvidia.com/claim=3f1c'
    '8f36-0000-4000-8000-000000000001-gpu-0"],"device":"gpu-0","pool":"node-a","request":"gpu","shareID":'
    '"","sharing":{"activeThreads":50,"group":"config[1]","interval":"","kind":"gpu","perDeviceLimits":[['
    '"0",2147483648]],"pinnedLimit":1073741824,"strategy":"MPS"},"uuid":"GPU-00000000-0000-0000-0000-0000'
    '00000000"},{"cdi":["k8s.gpu.nvidia.com/claim=3f1c8f36-0000-4000-8000-000000000001-gpu-1"],"device":"'
    'gpu-1","pool":"node-a","request":"gpu","shareID":"","sharing":{"activeThreads":null,"group":"config['
    '0]","interval":"Long","kind":"gpu","perDeviceLimits":[],"pinnedLimit":null,"strategy":"TimeSlicing"}'
    ',"uuid":"GPU-11111111-1111-1111-1111-111111111111"}],"name":"a","namespace":"ns","spec":"k8s.gpu.nvi'
    'dia.com-claim_3f1c8f36-0000-4000-8000-000000000001.yaml","uid":"3f1c8f36-0000-4000-8000-000000000001'
    '"},"3f1c8f36-0000-4000-8000-000000000002":{"devices":[{"adminAccess":true,"cdi":["k8s.gpu.nvidia.com'
    '/claim=3f1c8f36-0000-4000-8000-000000000002-gpu-1-mig-1g10gb-0"],"device":"gpu-1-mig-1g10gb-0","pool'
    '":"node-a","request":"mig/0","shareID":"share-7","sharing":{"activeThreads":null,"group":"","interva'
    'l":"","kind":"mig","perDeviceLimits":[],"pinnedLimit":null,"strategy":""},"uuid":"MIG-22222222-2222-'
    '2222-2222-222222222222"}],"name":"watch","namespace":"ns","spec":"k8s.gpu.nvidia.com-claim_3f1c8f36-'
    '0000-4000-8000-000000000002.yaml","uid":"3f1c8f36-0000-4000-8000-000000000002"},"3f1c8f36-0000-4000-'
    '8000-000000000003":{"devices":[],"name":"none","namespace":"other","spec":"k8s.gpu.nvidia.com-claim_'
    '3f1c8f36-0000-4000-8000-000000000003.yaml","uid":"3f1c8f36-0000-4000-8000-000000000003"}},"version":'
    '1}'
    '\n')


def test_a_checkpoint_of_before_the_records_loads_and_is_written_back_byte_for_byte(tmp_path):
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / checkpoint.NAME).write_text(WRITTEN)
    lines: list[str] = []
    claims = checkpoint.load(str(tmp_path / "plugin"), str(tmp_path / "cdi"), lines.append)
    assert lines == [] and len(claims) == 3
    mps, ts = claims[UID1].devices
    assert claims[UID1].label == "ns/a" and mps.cdi == (claimspec.cdi_name(UID1, "gpu-0"),)
    assert mps.sharing == opaque.Sharing(kind="gpu", strategy="MPS", active_threads=50, pinned_limit=1 << 30,
                                         per_device_limits=(("0", 2 << 30),)) and mps.group == "config[1]"
    assert ts.sharing.interval == "Long" and not ts.admin
    (watch,) = claims[UID2].devices
    assert watch.admin and watch.share_id == "share-7" and watch.sharing.kind == "mig"
    checkpoint.save(str(tmp_path), claims)
    assert (tmp_path / checkpoint.NAME).read_text() == WRITTEN
    # the spec's comment carries the same record, and reads back the same
    text = claimspec.render(Spec(claimspec.KIND, ()), claims[UID2].to_json(), "580.0")
    assert PreparedClaim.from_json(UID2, claimspec.record_of(text)) == claims[UID2]


def test_an_entry_of_before_configuration_groups_reads_as_no_group():
    entry = json.loads(WRITTEN)["claims"][UID1]
    for device in entry["devices"]:
        del device["sharing"]["group"]
    assert [d.group for d in PreparedClaim.from_json(UID1, entry).devices] == ["", ""]


@pytest.mark.parametrize("damage, problem", [
    (lambda e: e.update(uid="x"), "its UID and spec file disagree"),
    (lambda e: e.update(spec=5), "its UID and spec file disagree"),
    (lambda e: e["devices"][0].update(adminAccess=False), "a device record of another shape"),
    (lambda e: e["devices"][0].update(cdi="k8s.gpu.nvidia.com/claim=x"), "a device's CDI names are not text"),
    (lambda e: e["devices"][0]["sharing"].update(strategy=1), "a device's sharing settings are of another shape"),
    (lambda e: e["devices"][0]["sharing"].update(extra=1), "a device's sharing settings are of another shape"),
    (lambda e: e["devices"][0]["sharing"].update(pinnedLimit="1Gi"), "a device's MPS settings are of another shape"),
    (lambda e: e["devices"][0]["sharing"].update(activeThreads=101), "a device's MPS settings are of another shape"),
    (lambda e: e["devices"][0]["sharing"].update(perDeviceLimits=[["0"]]), "a device's MPS settings are of another"),
])
def test_a_damaged_entry_is_refused_with_one_line(damage, problem):
    entry = json.loads(WRITTEN)["claims"][UID1]
    damage(entry)
    with pytest.raises(NvcError, match=problem):
        PreparedClaim.from_json(UID1, entry)


def test_a_claim_prepared_now_is_written_as_before(tmp_path):
    """The same three claims, resolved now: the same bytes as the literal."""
    mps = opaque.Sharing(strategy="MPS", active_threads=50, pinned_limit=1 << 30, per_device_limits=(("0", 2 << 30),))
    resolved = [
        claims.Claim("ns", "a", UID1, "node-a", (
            claims.Unit("gpu", "gpu-0", GPU0, None, mps, group="config[1]"),
            claims.Unit("gpu", "gpu-1", GPU1, None, opaque.Sharing(strategy="TimeSlicing", interval="Long"),
                        group="config[0]"))),
        claims.Claim("ns", "watch", UID2, "node-a", (
            claims.Unit("mig/0", "gpu-1-mig-1g10gb-0", GPU1, MIG, opaque.Sharing(kind="mig"), "share-7", True),)),
        claims.Claim("other", "none", UID3, "node-a", ())]
    checkpoint.save(str(tmp_path), {c.uid: PreparedClaim.of(c) for c in resolved})
    assert (tmp_path / checkpoint.NAME).read_text() == WRITTEN
