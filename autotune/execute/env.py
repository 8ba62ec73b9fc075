"""The process group of one process per device (NCCL on GPUs, gloo on CPUs),
the fine-axis DeviceMesh and the groups that gradient synchronisation needs."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from calibrate.errors import OptionError, UserError
from calibrate.run_limits import host_available_bytes

from autotune.execute.launch import Launch, launch_env, rendezvous
from calibrate.optional import require_torch

torch = require_torch()

dist = torch.distributed

@dataclass
class Dist:
    launch: Launch
    device: object
    mesh: object = None
    axis_sizes: tuple[int, ...] = ()
    coords: tuple[int, ...] = ()
    _groups: dict = field(default_factory=dict)

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    def peak_bytes(self, reset: bool = True) -> int:
        """The device's peak allocated bytes since the last reset (0 on a CPU); ``reset`` starts a new peak."""
        if not self.is_gpu:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device)
        if reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def check_cpu_room(self, need_bytes: float | None) -> None:
        """On the CPU, ``need_bytes`` a process (the plan's predicted peak) times this host's processes against its
        available memory, before anything is built: a plan priced for GPUs would otherwise be killed by the
        kernel part-way, with no line. Nothing on a GPU (its plans are priced against the profile's device)."""
        if self.is_gpu or not need_bytes:
            return
        avail = host_available_bytes()
        local = self.launch.local_world
        if avail is None or need_bytes * local <= avail:
            return
        raise UserError(f"the plan's predicted {need_bytes / 2**30:.4g} GiB a process x {local} process(es) on the "
                        f"CPU is more than this host's available {avail / 2**30:.4g} GiB: run it on the GPUs its "
                        f"profile describes, or search for a smaller model")

    def set_mesh(self, axis_sizes: tuple[int, ...]) -> None:
        """The DeviceMesh over the cluster's fine axes (rank = mixed-radix coordinates)."""
        from torch.distributed.device_mesh import init_device_mesh

        if axis_sizes == self.axis_sizes and self.mesh is not None:
            return
        self.axis_sizes = tuple(axis_sizes) or (1,)
        names = tuple(f"a{i}" for i in range(len(self.axis_sizes)))
        self.mesh = init_device_mesh(self.device.type, self.axis_sizes, mesh_dim_names=names)
        self.coords = tuple(int(c) for c in self.mesh.get_coordinate())
        self._groups = {}

    def group(self, axes: tuple[int, ...]):
        """The process group of the devices that differ only along fine ``axes`` (created
        on first use; every rank asks for the same axes in the same order)."""
        axes = tuple(sorted(axes))
        if axes not in self._groups:
            if len(axes) == 1:
                self._groups[axes] = self.mesh.get_group(axes[0])
            elif len(axes) == len(self.axis_sizes):
                self._groups[axes] = dist.group.WORLD
            else:
                grid = torch.arange(self.launch.world).reshape(self.axis_sizes)
                rest = [a for a in range(len(self.axis_sizes)) if a not in axes]
                lists = []
                for fixed in itertools.product(*(range(self.axis_sizes[a]) for a in rest)):
                    index = [slice(None)] * len(self.axis_sizes)
                    for a, c in zip(rest, fixed):
                        index[a] = c
                    lists.append(grid[tuple(index)].flatten().tolist())
                self._groups[axes], _ = dist.new_subgroups_by_enumeration(lists)
        return self._groups[axes]


def quiet() -> None:
    """DTensor's advice on nested meshes and gloo's all-to-all fallback would print once per rank and plan."""
    for name in ("torch.distributed.tensor._redistribute", "torch._logging._internal"):
        logging.getLogger(name).setLevel(logging.ERROR)


def start(device: str = "auto") -> Dist:
    quiet()
    launch = launch_env()
    use_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_gpu:
        if not torch.cuda.is_available():
            raise OptionError("device", "cuda, but torch sees no GPU: use cpu or run on a GPU machine")
        n = torch.cuda.device_count()
        dev = torch.device("cuda", launch.local_rank % n)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        addr, port = rendezvous(launch)  # passed to the group, not left in the process's environment
        kw = {"device_id": dev} if use_gpu else {}
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://{addr}:{port}", rank=launch.rank,
                                world_size=launch.world, **kw)
    return Dist(launch, dev)


def stop(d: Dist | None) -> None:
    """Destroy every communicator (NCCL ones explicitly, on every rank)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
