#!/usr/bin/env python3
"""Test hosts: several "machines" on one Linux host, made of namespaces.

    with TestHosts(2) as hosts:            # or TestHosts.unavailable() -> reason to skip
        p = hosts.popen(0, ["shardline-launch", ...], env={...})
        hosts.rx_bytes(1); hosts.set_link(1, up=False)

Each host is
  - a network namespace with its own loopback and one veth interface `eth0` (address
    10.47.0.<i+1>/24), whose other end sits in a separate "switch" namespace on a bridge: traffic
    between hosts crosses two veth pairs and the bridge, and only these addresses exist there;
  - for every command started on it (`popen`): new UTS (hostname `node<i>`), IPC, PID and mount
    namespaces with a private tmpfs on /dev/shm, so that UCX and shardline's peer-memory paths
    see separate machines (other hostname, PID namespace and shared memory). Processes started
    by one command (a launcher and its ranks) share that host's namespaces.

Nothing is created in the caller's network namespace. Names carry the creator's pid
(`slmh<pid>-h<i>`, `slmh<pid>-sw`); `close()` (also on exit: `with`, atexit, SIGTERM) kills every
command started here and deletes the namespaces, and a new TestHosts first deletes namespaces
left by creators that no longer run (a test killed with SIGKILL). Every `ip` call is bounded in
time. Processes cannot outlive their host command: the command runs under `unshare --fork
--kill-child` with PR_SET_PDEATHSIG, and the PID namespace's init takes everything in it along.
Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), `ip` (iproute2) and `unshare` (util-linux).
"""

import atexit
import ctypes
import json
import os
import shutil
import signal
import subprocess

PREFIX = "slmh"
SUBNET = "10.47.0"
IP_TIMEOUT = 10  # seconds for any one `ip` command
_PR_SET_PDEATHSIG = 1

# Runs inside the host's new namespaces: hostname, private /dev/shm, then the command.
_INIT = ('hostname "$SL_TESTHOST_NAME" && mount -t tmpfs -o size=2g,mode=1777 tmpfs /dev/shm '
         '&& exec "$@"')


def _ip(*args, check=True):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _die_with_parent():
    # Between fork and exec: SIGKILL when the test process dies; own process group.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    os.setpgid(0, 0)


def _sweep_stale():
    """Deletes namespaces of creators that no longer run."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)


class Host:
    def __init__(self, index, pid):
        self.index = index
        self.name = f"node{index}"            # its hostname
        self.netns = f"{PREFIX}{pid}-h{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.ifname = "eth0"                  # in the host's namespace
        self.port = f"p{index}"               # the other end, on the bridge

    def __repr__(self):
        return f"Host({self.name}, {self.addr}, netns {self.netns})"


class TestHosts:
    @staticmethod
    def unavailable():
        """None where hosts can be created here, else the reason (for a skip message)."""
        if os.geteuid() != 0:
            return "test hosts need root (network, UTS, IPC, PID and mount namespaces)"
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                return f"test hosts need `{tool}`, which is not installed"
        probe = f"{PREFIX}{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        try:
            veth = _ip("-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name",
                       "vb", check=False)
            if veth.returncode != 0:
                return f"cannot create a veth pair: {veth.stderr.strip()}"
            run = subprocess.run(
                ["ip", "netns", "exec", probe, "unshare", "--uts", "--ipc", "--pid", "--fork",
                 "--mount", "--mount-proc", "--kill-child", "--", "sh", "-c", _INIT, "sh",
                 "true"],
                capture_output=True, text=True, timeout=IP_TIMEOUT,
                env=dict(os.environ, SL_TESTHOST_NAME="probe"))
            if run.returncode != 0:
                return ("cannot create UTS/IPC/PID/mount namespaces with a private /dev/shm: "
                        f"{run.stderr.strip()}")
        finally:
            _ip("netns", "del", probe, check=False)
        return None

    def __init__(self, count):
        if count < 1 or count > 200:
            raise ValueError(f"TestHosts: count {count} is not in [1, 200]")
        _sweep_stale()
        pid = os.getpid()
        self.hosts = [Host(i, pid) for i in range(count)]
        self.switch = f"{PREFIX}{pid}-sw"
        self._procs = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: atexit and PR_SET_PDEATHSIG still apply
            self._old_term = None
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _on_term(self, signum, frame):
        self.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _create(self):
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            _ip("link", "add", "name", h.ifname, "netns", h.netns, "type", "veth", "peer", "name",
                h.port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", h.port, "master", "br0")
            _ip("-n", self.switch, "link", "set", h.port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __len__(self):
        return len(self.hosts)

    def __getitem__(self, i):
        return self.hosts[i]

    def command(self, i, argv):
        """The argv that runs `argv` on host i (in fresh UTS/IPC/PID/mount namespaces)."""
        h = self.hosts[i]
        return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "--ipc", "--pid", "--fork",
                "--mount", "--mount-proc", "--kill-child", "--", "sh", "-c", _INIT, "sh", *argv]

    def popen(self, i, argv, env=None, **kwargs):
        """Starts `argv` on host i; the process is killed by close() if still running."""
        full_env = dict(os.environ if env is None else env)
        full_env["SL_TESTHOST_NAME"] = self.hosts[i].name
        proc = subprocess.Popen(self.command(i, argv), env=full_env, preexec_fn=_die_with_parent,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def rsh_agent_env(self):
        """Environment for `mpirun --mca plm_rsh_agent "<python> testhosts.py rsh"`: the
        agent maps a host's address to its namespaces."""
        return {"SL_TESTHOSTS": ",".join(f"{h.addr}={h.netns}={h.name}" for h in self.hosts)}

    def stats(self, i, ifname=None):
        """(rx_bytes, tx_bytes) of host i's interface (`eth0`, or `ifname`: `lo`)."""
        h = self.hosts[i]
        out = _ip("-n", h.netns, "-s", "-j", "link", "show", "dev", ifname or h.ifname).stdout
        s = json.loads(out)[0]["stats64"]
        return s["rx"]["bytes"], s["tx"]["bytes"]

    def rx_bytes(self, i):
        return self.stats(i)[0]

    def set_link(self, i, up):
        """Cuts (up=False) or restores host i's link."""
        h = self.hosts[i]
        _ip("-n", h.netns, "link", "set", h.ifname, "up" if up else "down")

    def close(self):
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)
        _ip("netns", "del", self.switch, check=False)
        if self._old_term is not None:
            try:
                signal.signal(signal.SIGTERM, self._old_term)
            except (ValueError, TypeError):
                pass
        atexit.unregister(self.close)

    def leftover_processes(self):
        """Processes started here that still run (after close(): none)."""
        return [p.pid for p in self._procs if p.poll() is None]


def rsh(argv):
    """mpirun's remote shell across test hosts: `testhosts.py rsh ADDR COMMAND...` runs COMMAND
    (joined and given to sh, as ssh does) on the host with that address (SL_TESTHOSTS)."""
    table = dict((f.split("=")[0], f.split("=")[1:]) for f in
                 os.environ.get("SL_TESTHOSTS", "").split(",") if f)
    args = list(argv)
    while args and args[0].startswith("-"):  # ssh-style options before the host: none apply
        args.pop(0)
    if len(args) < 2 or args[0] not in table:
        raise SystemExit(f"testhosts.py rsh: unknown host in {argv!r} (known: {sorted(table)})")
    netns, name = table[args[0]]
    os.environ["SL_TESTHOST_NAME"] = name
    os.execvp("ip", ["ip", "netns", "exec", netns, "unshare", "--uts", "--ipc", "--pid", "--fork",
                     "--mount", "--mount-proc", "--kill-child", "--", "sh", "-c", _INIT, "sh",
                     "sh", "-c", " ".join(args[1:])])


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["rsh"]:
        rsh(sys.argv[2:])
    reason = TestHosts.unavailable()
    if reason:
        print(f"test hosts unavailable: {reason}")
        raise SystemExit(1)
    with TestHosts(2) as hosts:
        for i in range(len(hosts)):
            p = hosts.popen(i, ["sh", "-c", "hostname; ip -br addr show eth0; ls /dev/shm | wc -l"],
                            stdout=subprocess.PIPE, text=True)
            print(p.communicate(timeout=10)[0].strip().replace("\n", " | "))
        print("stats", [hosts.stats(i) for i in range(len(hosts))])
    print("namespaces left:", [n for n in _ip("netns", "list").stdout.split()
                               if n.startswith(f"{PREFIX}{os.getpid()}")])
