# shellcheck shell=bash
# Sourced by the GPU scripts: the MPI launcher of this machine with the flags its flavour takes.
#   source tests/gpu/mpi.sh; MPIRUN="$(mpi_cmd 2 NCCL_NVLS_ENABLE PYTHONPATH)"; timeout 300 $MPIRUN python3 ...
# Open MPI's mpirun takes --allow-run-as-root, --bind-to none and -x VAR per variable passed;
# MPICH's (Hydra, what pip's mpich wheel installs) refuses those and passes the whole environment
# by itself, -bind-to none being its spelling. MPI_LAUNCHER names another launcher.
mpi_flavour() {
  local launcher=$1
  case "$("$launcher" --version 2>&1)" in
    *"Open MPI"*|*"OpenRTE"*|*"open-mpi"*) echo openmpi ;;
    *HYDRA*|*Hydra*|*MPICH*|*mpich*) echo mpich ;;
    *) echo unknown ;;
  esac
}

# mpi_cmd NP [VAR...]: the launcher and its flags for NP ranks, passing the variables VAR
mpi_cmd() {
  local np=$1; shift
  local launcher=${MPI_LAUNCHER:-$(command -v mpirun || command -v mpiexec || echo mpirun)}
  case "$(mpi_flavour "$launcher")" in
    openmpi)
      local flags="--allow-run-as-root --bind-to none -np $np" v
      for v in "$@"; do flags="$flags -x $v"; done
      echo "$launcher $flags" ;;
    mpich) echo "$launcher -n $np -bind-to none" ;;
    *) echo "$launcher -n $np" ;;
  esac
}
