"""Several MPI hosts on one machine: network namespaces with their own hostnames.

    python tools/multihost.py up DIR [--hosts 2] [--slots 2]   make them; DIR gets the files
    python tools/multihost.py down DIR                         tear them down
    python tools/multihost.py run [--hosts 2] -- CMD...        up, run CMD, down (always)
    python tools/multihost.py can                              exit 0 if they can be made

Each host is a network namespace joined to the others by a bridge (a veth pair
per host) with an address in a private /24 and a hostname of its own (a UTS
namespace per process, set by the launcher agent), named in /etc/hosts while
it exists. They share the machine's memory but not a network or a hostname,
so Open MPI treats them as separate nodes: TCP between them, no shared-memory
transport across them. Each host needs its own hostname (with one shared
hostname Open MPI mis-groups the nodes) and traffic kept on the bridge.

DIR receives:
  mpirun     a launcher to use in place of mpirun: it starts mpirun on the first
             host with the hostfile, the agent and traffic kept on the bridge
             (``--mca btl tcp,self``, ``btl_tcp_if_include``/``oob_tcp_if_include``
             the subnet); the rest of its arguments go to mpirun
  agent      the rsh agent Open MPI calls as ``agent HOST command...``
  hostfile   ``HOST slots=N`` per host
  state.json what to tear down

`run` exports DPMINI_MULTIHOST_MPIRUN=DIR/mpirun to CMD (tests/test_distributed_multihost.py
uses it). Where namespaces cannot be made (not root, no ``ip``/``unshare``, a
kernel or sandbox without network namespaces), `up` and `can` say why and exit
2, and `run` prints that and runs CMD without the variable (the tests then
skip, saying why).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HOSTS_MARK = "# dpmini multihost"


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def why_not():
    """None when namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "not root (network namespaces need CAP_SYS_ADMIN)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    if shutil.which("mpirun") is None:
        return "no mpirun"
    name = f"dpmprobe{os.getpid() % 100000}"
    got = sh("ip", "netns", "add", name, check=False)
    if got.returncode != 0:
        return f"`ip netns add` failed: {got.stderr.strip()}"
    try:
        got = sh("ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c",
                 "hostname dpmprobe && hostname", check=False)
        if got.returncode != 0 or got.stdout.strip() != "dpmprobe":
            return f"`unshare --uts` with a hostname failed: {got.stderr.strip()}"
    finally:
        sh("ip", "netns", "del", name, check=False)
    return None


def plan(nhosts, slots):
    tag = f"{os.getpid() % 10000:04d}"
    net = 200 + os.getpid() % 50
    sub = f"10.{net}.{int(tag) % 250}"
    hosts = [{"name": f"dpm{tag}-h{i + 1}", "ns": f"dpm{tag}h{i + 1}",
              "veth": f"dpmv{tag}h{i + 1}", "peer": f"dpmp{tag}h{i + 1}",
              "addr": f"{sub}.{i + 1}"} for i in range(nhosts)]
    return {"tag": tag, "bridge": f"dpmb{tag}", "subnet": f"{sub}.0/24", "hosts": hosts,
            "slots": slots}


def up(d, nhosts=2, slots=2):
    reason = why_not()
    if reason:
        print(f"multihost: cannot make network namespaces here: {reason}", file=sys.stderr)
        return 2
    os.makedirs(d, exist_ok=True)
    st = plan(nhosts, slots)
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump(st, f)   # written first: down() undoes whatever part was made
    try:
        make(st)
        write_files(d, st)
    except subprocess.CalledProcessError as exc:
        print(f"multihost: {' '.join(exc.cmd)} failed: {exc.stderr.strip()}", file=sys.stderr)
        down(d)
        return 2
    return 0


def make(st):
    sh("ip", "link", "add", st["bridge"], "type", "bridge")
    sh("ip", "link", "set", st["bridge"], "up")
    for h in st["hosts"]:
        sh("ip", "netns", "add", h["ns"])
        sh("ip", "link", "add", h["veth"], "type", "veth", "peer", "name", h["peer"])
        sh("ip", "link", "set", h["veth"], "master", st["bridge"])
        sh("ip", "link", "set", h["veth"], "up")
        sh("ip", "link", "set", h["peer"], "netns", h["ns"])
        sh("ip", "-n", h["ns"], "addr", "add", f"{h['addr']}/24", "dev", h["peer"])
        sh("ip", "-n", h["ns"], "link", "set", h["peer"], "up")
        sh("ip", "-n", h["ns"], "link", "set", "lo", "up")
    with open("/etc/hosts", "a") as f:
        for h in st["hosts"]:
            f.write(f"{h['addr']} {h['name']} {HOSTS_MARK} {st['tag']}\n")


def write_files(d, st):
    cases = "\n".join(f"  {h['name']}) ns={h['ns']} ;;" for h in st["hosts"])
    agent = os.path.join(d, "agent")
    with open(agent, "w") as f:
        f.write(f"""#!/bin/sh
# Open MPI's rsh agent: agent HOST command... runs the command "on" HOST.
host=$1; shift
case $host in
{cases}
  *) echo "multihost agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $host; $*"
""")
    hostfile = os.path.join(d, "hostfile")
    with open(hostfile, "w") as f:
        for h in st["hosts"]:
            f.write(f"{h['name']} slots={st['slots']}\n")
    first = st["hosts"][0]
    launcher = os.path.join(d, "mpirun")
    mpirun = shutil.which("mpirun")
    with open(launcher, "w") as f:
        f.write(f"""#!/bin/sh
# mpirun across the namespaced hosts, started on {first['name']}.
exec ip netns exec {first['ns']} unshare --uts sh -c 'hostname {first['name']}; exec "$0" "$@"' \\
  {mpirun} --hostfile {hostfile} --mca plm_rsh_agent {agent} \\
  --mca btl tcp,self --mca btl_tcp_if_include {st['subnet']} \\
  --mca oob_tcp_if_include {st['subnet']} "$@"
""")
    for p in (agent, launcher):
        os.chmod(p, 0o755)


def down(d):
    path = os.path.join(d, "state.json")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        st = json.load(f)
    for h in st["hosts"]:
        # Whatever still runs in a host (a hung rank) goes first.
        pids = sh("ip", "netns", "pids", h["ns"], check=False).stdout.split()
        for pid in pids:
            sh("kill", "-9", pid, check=False)
        sh("ip", "netns", "del", h["ns"], check=False)
        sh("ip", "link", "del", h["veth"], check=False)
    sh("ip", "link", "del", st["bridge"], check=False)
    mark = f"{HOSTS_MARK} {st['tag']}"
    with open("/etc/hosts") as f:
        keep = [line for line in f if not line.rstrip().endswith(mark)]
    with open("/etc/hosts", "w") as f:
        f.writelines(keep)
    os.remove(path)
    return 0


def run(cmd, nhosts, slots):
    d = tempfile.mkdtemp(prefix="dpmini-hosts-")
    env = dict(os.environ)
    # An outer `timeout` (SIGTERM) still tears the hosts down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if up(d, nhosts, slots) == 0:
            env["DPMINI_MULTIHOST_MPIRUN"] = os.path.join(d, "mpirun")
            print(f"multihost: {nhosts} hosts up ({d})", file=sys.stderr)
        return subprocess.call(cmd, env=env)
    finally:
        down(d)
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("up", "down"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("--hosts", type=int, default=2)
        p.add_argument("--slots", type=int, default=2)
    p = sub.add_parser("run")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("can")
    a = ap.parse_args()
    if a.what == "up":
        return up(a.dir, a.hosts, a.slots)
    if a.what == "down":
        return down(a.dir)
    if a.what == "can":
        reason = why_not()
        print(reason or "yes")
        return 2 if reason else 0
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    return run(cmd, a.hosts, a.slots)


if __name__ == "__main__":
    sys.exit(main())
