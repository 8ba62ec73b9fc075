"""The CUDA sources the runtime compiles through NVRTC (CuPy's RawModule on the GPU machine)
compile with NVRTC here too, with the runtime's own options: nvcc accepts things NVRTC does not
(2026-11-22: `__builtin_offsetof` passed nvcc and broke the GPU run). NVRTC needs no GPU; it comes
from the pip package nvidia-cuda-nvrtc (the `test` extra)."""
import ctypes
from pathlib import Path

import pytest

from kernels.interp.runtime import SOURCE, _include_dirs

CEILINGS = Path(__file__).parents[2] / "kernels" / "interp" / "ceilings.cu"


def _nvrtc():
    nvidia = pytest.importorskip("nvidia", reason="nvidia-cuda-nvrtc is not installed")
    for root in map(Path, nvidia.__path__):
        for lib in sorted(root.glob("cu*/lib/libnvrtc.so.*")) + sorted(root.glob("cuda_nvrtc/lib/libnvrtc.so.*")):
            builtins = sorted(lib.parent.glob("libnvrtc-builtins.so.*"))
            for b in builtins:  # loaded first, so that libnvrtc finds it by its soname
                ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(lib))
    pytest.skip("libnvrtc not found in the nvidia package")


def _compile(nvrtc, source: Path, opts: list[str]) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None)
    if rc:
        return rc, "nvrtcCreateProgram failed"
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


@pytest.mark.parametrize("source", [SOURCE, CEILINGS], ids=["interp", "ceilings"])
def test_runtime_compiled_sources_build_with_nvrtc(source):
    nvrtc = _nvrtc()
    inc = _include_dirs() or [str(p) for p in (Path("/usr/local/cuda/include"),) if p.is_dir()]
    if not inc:
        pytest.skip("no CUDA headers (cuda_bf16.h) on this machine")
    rc, log = _compile(nvrtc, source, ["-std=c++17", "--gpu-architecture=sm_90"] + [f"-I{d}" for d in inc])
    assert rc == 0, log
