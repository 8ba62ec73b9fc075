"""A real Slurm cluster of several nodes on one machine, for tests: one slurmd
per node of a ``NetnsCluster`` (each in its node's network namespace, under its
hostname, at its own address), slurmctld on node0, munged on the host (its
socket is a file, shared by every namespace). State, logs, spool and pid files
under one private directory (``%n``: one per node), two free ports of the
private subnet. Client commands run on node0 (``run``), where the controller
is reachable.
"""
from __future__ import annotations

import os
import pwd
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns_cluster import NetnsCluster
from slurm_local import _which, node_line

CTLD_PORT, SLURMD_PORT = 6917, 6918  # inside the cluster's own namespaces: nothing else listens there


def slurm_conf(root: Path, user: str, cluster: NetnsCluster) -> str:
    _, hardware = node_line()
    hw = " ".join(f for f in hardware.split()[1:] if not f.startswith("UpTime"))
    names = [cluster.hostname(i) for i in range(cluster.nodes)]
    return "\n".join([
        "ClusterName=commtunemulti",
        f"SlurmctldHost={names[0]}({cluster.addr(0)})",
        f"SlurmctldPort={CTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.sock'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool-%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        "MinJobAge=4",
        # a node whose slurmd dies is declared down after 20 s, and its job fails (not requeued: the
        # user resubmits with the same RESULTS)
        "JobRequeue=0",
        "SlurmdTimeout=20",
        "MessageTimeout=5",
        "KillWait=5",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        *(f"NodeName={n} NodeAddr={cluster.addr(i)} {hw} State=UNKNOWN" for i, n in enumerate(names)),
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@dataclass
class MultiNodeSlurm:
    root: Path
    cluster: NetnsCluster
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, timeout: float = 60.0) -> "MultiNodeSlurm":
        root = self.root
        for i in range(self.cluster.nodes):
            (root / f"spool-{self.cluster.hostname(i)}").mkdir(parents=True, exist_ok=True)
        (root / "state").mkdir(parents=True, exist_ok=True)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        user = pwd.getpwuid(os.getuid()).pw_name
        conf = root / "slurm.conf"
        conf.write_text(slurm_conf(root, user, self.cluster))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env["SLURM_CONF"] = str(conf)
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}",
                               f"--socket={root / 'munge.sock'}", f"--pid-file={root / 'munged.pid'}",
                               f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"])
        self._wait(lambda: subprocess.run([_which("munge"), "-n", "-S", str(root / "munge.sock")],
                                          capture_output=True).returncode == 0, "munged", timeout)
        self._spawn("slurmctld", self.cluster.enter(0) + [_which("slurmctld"), "-D", "-i", "-f", str(conf)])
        for i in range(self.cluster.nodes):
            self.start_slurmd(i)
        self.wait_idle(timeout)
        return self

    def wait_idle(self, timeout: float = 60.0) -> None:
        self._wait(self.all_idle, "every node idle", timeout)

    def start_slurmd(self, i: int) -> None:
        self._spawn(f"slurmd-{i}", self.cluster.enter(i) + [_which("slurmd"), "-D", "-f", str(self.root / "slurm.conf")])

    def kill_slurmd(self, i: int) -> None:
        """SIGKILL node i's slurmd (a node that dies), and the job steps it started on that node."""
        proc = self.procs.pop(f"slurmd-{i}")
        proc.kill()
        proc.wait()

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / f"{name}.stdout", "wb") as out:
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env)

    def states(self) -> list[str]:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
        return r.stdout.split("\n") if r.returncode == 0 else []

    def all_idle(self) -> bool:
        rows = [ln.split() for ln in self.states() if ln.strip()]
        return len(rows) == self.cluster.nodes and all(s == "idle" for _, s in rows)

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"no {what} after {timeout:.0f} s:\n{self.logs()}")

    def logs(self, tail: int = 30) -> str:
        parts = []
        for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.stdout")):
            lines = p.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"--- {p.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def run(self, argv: list[str], timeout: float, extra_env: dict[str, str] | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """A client command (sbatch, sinfo, ...) on node0."""
        return subprocess.run(self.cluster.enter(0) + argv, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env={**self.env, **(extra_env or {})}, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            try:
                self.run(["scancel", "--user", pwd.getpwuid(os.getuid()).pw_name], timeout=30)
            except subprocess.TimeoutExpired:
                pass
        names = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in names:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
