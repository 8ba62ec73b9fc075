"""Where the msccl-tools reference XML files live (../shared/interop/msccl, or $COMMTUNE_MSCCL_DIR):
for tests that COMPARE the project's compiler and executor with them only, which skip when the folder
is absent. Nothing the project runs needs it: its programs come from kernels.gc3.compiler."""
from __future__ import annotations

import os
from pathlib import Path


def msccl_dir() -> Path:
    default = Path(__file__).resolve().parents[3] / "shared" / "interop" / "msccl"
    return Path(os.environ.get("COMMTUNE_MSCCL_DIR", default))


def reference_xml_files() -> list[Path]:
    return sorted(msccl_dir().glob("*.xml"))
