"""The launched process's rank, world, local rank and processes on its host, read from each launcher's variables
(``autotune.execute.launch.launch_env``): what the CPU room check and the model built once a host read."""
import pytest

from autotune.execute.launch import Launch, launch_env


@pytest.mark.parametrize("env, want", [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, Launch(5, 8, 1, "RANK", 4)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, Launch(3, 4, 1, "OMPI_COMM_WORLD_RANK", 2)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, Launch(2, 4, 0, "PMI_RANK", 2)),
    # Slurm sets the tasks a node only under --ntasks-per-node; a figure that is not a whole number: the world
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": ""},
     Launch(1, 6, 1, "SLURM_PROCID", 6)),
    ({"RANK": "0", "WORLD_SIZE": "2"}, Launch(0, 2, 0, "RANK", 2)),  # no local figures: the world, on one host
    ({}, Launch(0, 1, 0, "none", 1)),
])
def test_each_launcher_gives_its_processes_on_this_host(env, want):
    assert launch_env(env) == want
