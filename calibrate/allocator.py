"""The settings of torch's GPU memory allocator a plan is searched for (``ALLOCATORS``): its default, or its
expandable segments (``EXPANDABLE_ENV``: the environment variable and its value, set before torch starts on the
GPU; torchtitan's launcher sets it), which leave less of the memory reserved but unallocated at a step's peak
(``calibrate.profile``'s ``memory_fragmentation``)."""

ALLOCATORS = ("default", "expandable_segments")
EXPANDABLE_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def allocator_of(environ) -> str:
    """The allocator (``ALLOCATORS``) a process started with ``environ`` runs torch's GPU memory under."""
    name, setting = EXPANDABLE_ENV
    return "expandable_segments" if setting in (s.strip() for s in environ.get(name, "").split(",")) else "default"
