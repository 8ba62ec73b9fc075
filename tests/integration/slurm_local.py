"""A real one-node Slurm cluster on localhost, for tests.

Starts munged with a fresh key, then slurmctld and slurmd in the foreground
(``-D``) as the current user (root in CI), all state, logs, sockets and pid files
under one private directory and on two free TCP ports, so that it neither needs
nor disturbs a system-wide installation. The node is described by
``slurmd -C`` (the machine's real hostname, CPUs and memory) with
NodeAddr=127.0.0.1. Client commands find the cluster through ``SLURM_CONF``
in ``env``.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise FileNotFoundError(name)
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_line() -> tuple[str, str]:
    """(node name, ``NodeName=... CPUs=... RealMemory=...`` line) from ``slurmd -C``."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("NodeName="))
    name = line.split()[0].split("=", 1)[1]
    return name, line


def slurm_conf(root: Path, user: str, ctld_port: int, slurmd_port: int, node: tuple[str, str]) -> str:
    name, hardware = node
    return "\n".join([
        "ClusterName=commtunetest",
        f"SlurmctldHost={name}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.sock'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # no cgroups: works in containers without a delegated cgroup tree
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "ReturnToService=2",
        # sbatch --wait polls every 2 s, and multiplies the interval by 4 (up to 32 s)
        # while it is below MinJobAge/2: with 4 it stays at 2 s instead of adding
        # up to half a minute to each short test job
        "MinJobAge=4",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        f"{hardware} NodeAddr=127.0.0.1 State=UNKNOWN",
        f"PartitionName=debug Nodes={name} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@dataclass
class SlurmCluster:
    root: Path
    node_name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        root = self.root
        for sub in ("state", "spool"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        user = pwd.getpwuid(os.getuid()).pw_name
        ctld_port, slurmd_port = _free_ports(2)
        conf = root / "slurm.conf"
        node = node_line()
        self.node_name = node[0]
        conf.write_text(slurm_conf(root, user, ctld_port, slurmd_port, node))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":
                del self.env[var]  # an outer allocation must not leak into this cluster

        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}",
                               f"--socket={root / 'munge.sock'}", f"--pid-file={root / 'munged.pid'}",
                               f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"])
        self._wait(lambda: subprocess.run([_which("munge"), "-n", "-S", str(root / "munge.sock")],
                                          capture_output=True).returncode == 0, "munged", timeout)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(conf)])
        self._wait(self._node_idle, "an idle node", timeout)
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.root / f"{name}.stdout", "wb") as out:
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env)

    def _node_idle(self) -> bool:
        r = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
        return r.returncode == 0 and r.stdout.strip() == "idle"

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

    def logs(self, tail: int = 40) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.stdout", "slurmd.stdout"):
            p = self.root / name
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def run(self, argv: list[str], timeout: float, extra_env: dict[str, str] | None = None,
            cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**self.env, **(extra_env or {})}, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged (in that order)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_which("scancel"), "--user", pwd.getpwuid(os.getuid()).pw_name],
                           capture_output=True, env=self.env, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
