"""The per-communicator channel configuration: ncclConfig_t's head laid out as NCCL 2.28's
nccl.h declares it (offsets on x86-64/aarch64 LP64), with the values NCCL accepts."""
import ctypes

import pytest

from calibrate.device import nccl_config as nc
from calibrate.errors import UserError


def test_config_layout_matches_nccl_h():
    offsets = {name: getattr(nc.Config, name).offset for name, _ in nc.Config._fields_}
    assert offsets == {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20, "minCTAs": 24,
                       "maxCTAs": 28, "netName": 32, "splitShare": 40}
    assert ctypes.sizeof(nc.UniqueId) == 128  # NCCL_UNIQUE_ID_BYTES


def test_config_values():
    c = nc.make_config(64)
    assert (c.size, c.magic, c.version) == (ctypes.sizeof(nc.Config), 0xCAFEBEEF, 21700)
    assert (c.minCTAs, c.maxCTAs) == (64, 64)   # NCCL refuses minCTAs > maxCTAs
    assert c.blocking == c.cgaClusterSize == c.splitShare == -(1 << 31) and c.netName is None
    for bad in (0, 65):
        with pytest.raises(UserError, match="1..64"):
            nc.make_config(bad)


def test_loaded_library_path_from_the_process_maps():
    path = nc.loaded_path("libc.so") or nc.loaded_path("libc-")
    assert path and path.startswith("/")
    assert nc.loaded_path("no-such-library-here.so") is None
