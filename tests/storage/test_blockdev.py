"""Which block device holds a path (NOTE [Block device of a path]): real paths, then a fake /sys
and mountinfo for partitions and stacked devices; metrics, sidecar and doctor agree."""

from __future__ import annotations

import os

import pytest

from tba import metrics
from tba.sidecar import endurance
from tba.storage import blockdev
from tba.storage.blockdev import block_device, disk_of, nearest_existing, physical_disks


def test_a_directory_on_the_real_disk(tmp_path):
    found = block_device(str(tmp_path))
    if found.device is None:  # a container's overlay or tmpfs: it says why
        assert "not on a block device" in found.why
        pytest.skip(f"{tmp_path} is on no block device: {found.why}")
    assert found.why == "" and found.path == str(tmp_path)
    assert found.device in os.listdir("/sys/block")  # a whole disk, never a partition
    assert found.disks and all(d in os.listdir("/sys/block") for d in found.disks)
    assert found.mount_point is not None and str(tmp_path).startswith(found.mount_point)
    assert found.label == found.device


def test_the_three_users_agree(tmp_path):
    found = block_device(str(tmp_path))
    assert metrics.spill_device(str(tmp_path)) == found.label
    disks, why = endurance.disks_for_path(str(tmp_path))
    assert disks == list(found.disks) and why == found.why
    # the sidecar charges a rank's bytes, labelled as metrics label them, to those disks
    if found.device is not None:
        assert set(endurance.charge_by_disk({found.label: 100.0})) == set(found.disks)


def test_a_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "not" / "yet"
    found = block_device(str(missing))
    assert found.device is None and found.disks == () and found.label == "unknown"
    assert found.why.startswith(f"cannot stat {missing}: No such file")
    assert nearest_existing(str(missing)) == str(tmp_path)
    assert metrics.spill_device(str(missing)) == "unknown"
    # the sidecar looks at the nearest parent, since a spill root may not be made yet
    assert endurance.disks_for_path(str(missing))[0] == list(block_device(str(tmp_path)).disks)


@pytest.mark.parametrize("path", ["/dev/shm", "/proc/self", "/sys"])
def test_anonymous_device_numbers(path):
    if not os.path.exists(path) or os.major(os.stat(path).st_dev) != 0:
        pytest.skip(f"{path} is not here or not on an anonymous device number")
    found = block_device(path)
    assert found.device is None and found.label == "unknown"
    assert "is not on a block device (tmpfs, overlay or a network filesystem?)" in found.why
    assert found.mount_point is not None and found.source  # the mount is still named


# -- a fake /sys and mountinfo ---------------------------------------------------------------------
def _link(sys_root, rel_link, rel_target):
    link = sys_root / rel_link
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(sys_root / rel_target, link)


def _node(sys_root, rel, partition=False):
    d = sys_root / rel
    d.mkdir(parents=True, exist_ok=True)
    if partition:
        (d / "partition").write_text("2\n")
    return d


@pytest.fixture
def fake_sys(tmp_path, monkeypatch):
    """tmp_path's device number pointed at a device of our choosing, in a /sys of our own."""
    root = tmp_path / "sys"
    monkeypatch.setattr(blockdev, "SYS", str(root))
    st = os.stat(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    info = tmp_path / "mountinfo"
    info.write_text(
        f"1 0 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / {work} rw - ext4 /dev/fake rw\n"
        f"2 0 0:99 / / rw - overlay overlay rw\n"
    )
    monkeypatch.setattr(blockdev, "MOUNTINFO", str(info))
    return root, f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", work


def test_a_partition_is_named_by_its_disk(fake_sys):
    root, majmin, work = fake_sys
    _node(root, "devices/pci0/nvme0n1/nvme0n1p2", partition=True)
    _link(root, f"dev/block/{majmin}", "devices/pci0/nvme0n1/nvme0n1p2")
    _link(root, "class/block/nvme0n1p2", "devices/pci0/nvme0n1/nvme0n1p2")
    found = block_device(str(work))
    assert found.device == "nvme0n1" and found.disks == ("nvme0n1",)
    assert found.source == "/dev/fake" and found.mount_point == str(work)
    assert disk_of("/dev/nvme0n1p2") == "nvme0n1" and disk_of("sdz") == "sdz"


def test_a_stacked_device_is_named_itself_and_charged_to_its_disks(fake_sys):
    root, majmin, work = fake_sys
    dm = _node(root, "devices/virtual/block/dm-0")
    (dm / "slaves").mkdir()
    for disk in ("nvme0n1", "nvme1n1"):
        part = f"devices/pci0/{disk}/{disk}p1"
        _node(root, part, partition=True)
        _link(root, f"class/block/{disk}p1", part)
        os.symlink(root / part, dm / "slaves" / f"{disk}p1")
    _link(root, f"dev/block/{majmin}", "devices/virtual/block/dm-0")
    _link(root, "class/block/dm-0", "devices/virtual/block/dm-0")
    found = block_device(str(work))
    assert found.device == "dm-0" and found.label == "dm-0"
    assert found.disks == ("nvme0n1", "nvme1n1") == tuple(physical_disks("dm-0"))
    assert metrics.spill_device(str(work)) == "dm-0"
    assert endurance.disks_for_path(str(work)) == (["nvme0n1", "nvme1n1"], "")
    charged = endurance.charge_by_disk({"dm-0": 100.0, "unknown": 5.0})
    assert charged == {"nvme0n1": 50.0, "nvme1n1": 50.0, "unknown": 5.0}


def test_no_sys_node_says_so(fake_sys, tmp_path):
    root, majmin, work = fake_sys
    if majmin.startswith("0:"):
        pytest.skip("tmp_path is on an anonymous device number: tested above")
    root.mkdir(exist_ok=True)
    found = block_device(str(work))
    assert found.device is None and found.source == "/dev/fake"
    assert found.why == f"{root}/dev/block/{majmin} does not exist (is /sys mounted?)"
