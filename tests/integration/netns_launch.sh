#!/bin/sh
# MPICH hydra's launcher into the test cluster's namespaces (netns_cluster.py):
#   mpiexec -launcher ssh -launcher-exec tests/integration/netns_launch.sh -hosts node0,node1 ...
# hydra calls it as ssh: [options] HOST COMMAND...; HOST nodeK runs COMMAND in the
# namespace ${COMMTUNE_NETNS}nK under the hostname nodeK (a fresh UTS namespace),
# as NetnsCluster.enter does.
set -eu
while [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
: "${COMMTUNE_NETNS:?set COMMTUNE_NETNS to the cluster name (netns_cluster.NetnsCluster.name)}"
case "$host" in
    node[0-9]|node[0-9][0-9]) ;;
    *) echo "netns_launch.sh: unknown host $host (expected nodeK)" >&2; exit 2 ;;
esac
ns=${COMMTUNE_NETNS}n${host#node}
# as NetnsCluster.enter: the node's network, hostname and /etc/hosts
exec nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
    "mount --bind /etc/netns/$ns/hosts /etc/hosts && hostname $host && exec $*"
