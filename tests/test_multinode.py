"""Multi-node for real, on one machine: chapter 05's DDP recipe run as two "nodes", two `torchrun` agents
(`--nnodes=2`), once with the c10d rendezvous chapter 05 prints and once with the static one (`--node-rank`,
`--master-addr`) docker/README.md prints.

Where the machine allows it (root, `ip netns`, `unshare`), each node gets a network namespace of its own, with
its own address and hostname, the two joined by a veth pair: the ranks can reach each other only over that
link, so a finished run proves the commands work across machines. Traffic goes only to the addresses of the
namespaces this test makes. Elsewhere both agents share the loopback (still two agents, one rendezvous); under CI
that fallback is a failure.
Either way no process may outlive the test, and the namespaces are removed.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import under_ci

from course_lib.parallel.dist import LAUNCH_ID_VAR, PARENT_PID_VAR, RESULTS_VAR, read_results
from course_lib.workbook.launch import free_port, run_processes
from course_lib.paths import REPO_ROOT

NODES = {"node-a": "10.213.7.1", "node-b": "10.213.7.2"}  # a private /24, inside namespaces made here
RECIPE = str(REPO_ROOT / "course_lib" / "recipes" / "ddp.py")
SMALL = ["--steps", "1", "--accum", "1", "--repeat", "1", "--comm-repeat", "1", "--comm-buckets", "25",
         "--sweep-sizes", "1024", "4096", "--sweep-repeat", "1", "--hidden-size", "32", "--intermediate-size", "64",
         "--num-hidden-layers", "2", "--vocab-size", "64", "--seq-len", "16", "--num-attention-heads", "4",
         "--num-key-value-heads", "2", "--micro-batch", "4", "--bucket-mb", "0.25"]


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def namespaces_possible() -> str | None:
    """None if this machine can give each node a network namespace, else why not."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "not root on Linux"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "no `ip` or `unshare` command"
    probe = f"clprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', e)}"
    _run("ip", "netns", "del", probe)
    return None


@contextmanager
def two_nodes():
    """{hostname: command prefix that runs inside that node}; network namespaces joined by a veth pair where
    possible (each with its hostname in a UTS namespace and an /etc/netns/<ns>/hosts naming both), else
    loopback. Removes whatever it made."""
    why = namespaces_possible()
    if why and under_ci():  # CI runs as root: there, a fallback would hide a broken network set-up
        pytest.fail(f"no network namespaces under CI ({why})")
    if why:
        print(f"no network namespaces ({why}): both nodes on the loopback")
        yield {"127.0.0.1": [], "127.0.0.2": []}, []
        return
    tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"
    ns = {host: f"cl{tag}{host[-1]}" for host in NODES}
    made = []
    try:
        for host, name in ns.items():
            _run("ip", "netns", "add", name)
            made.append(name)
        veth = {host: f"v{name}" for host, name in ns.items()}
        _run("ip", "link", "add", veth["node-a"], "type", "veth", "peer", "name", veth["node-b"])
        for host, name in ns.items():
            _run("ip", "link", "set", veth[host], "netns", name)
            _run("ip", "-n", name, "addr", "add", f"{NODES[host]}/24", "dev", veth[host])
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", veth[host], "up")
            etc = Path("/etc/netns") / name  # `ip netns exec` mounts these over /etc: the nodes' own hosts file
            etc.mkdir(parents=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for h, a in NODES.items()))
        yield {host: ["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$0" "$@"']
               for host, name in ns.items()}, made
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)  # takes its veth end along
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def torchrun(form: str, node_rank: int, head: str, port: int) -> list[str]:
    """The launch command as chapter 05 (`c10d`) or docker/README.md (`static`) prints it, one rank per node."""
    run = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    if form == "c10d":
        run += ["--rdzv-id=job42", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}"]
    else:
        run += [f"--node-rank={node_rank}", f"--master-addr={head}", f"--master-port={port}"]
    return run + [RECIPE, *SMALL]


def kill_all(procs, marker: str) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in run_processes(marker):
        p.kill()


@pytest.mark.parametrize("form", ["c10d", "static"])
def test_ddp_recipe_on_two_nodes_leaves_nothing_behind(form, tmp_path):
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COURSE_BACKEND": "gloo", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", LAUNCH_ID_VAR: marker, PARENT_PID_VAR: str(os.getpid()),
           RESULTS_VAR: str(tmp_path / "results")}
    (tmp_path / "results").mkdir()
    with two_nodes() as (nodes, namespaces):
        isolated = bool(namespaces)
        hosts = list(nodes)
        head = hosts[0] if isolated else "127.0.0.1"
        port = 29500 if isolated else free_port()  # an isolated node has every port to itself
        procs, logs = [], []
        try:
            for rank, host in enumerate(hosts):
                logs.append(open(tmp_path / f"{host}.log", "w+"))
                procs.append(subprocess.Popen(nodes[host] + torchrun(form, rank, head, port), stdout=logs[-1],
                                              stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO_ROOT))
            deadline = time.monotonic() + 400
            codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = "timed out after 400 s"
        finally:
            kill_all(procs, marker)
        output = []
        for log in logs:
            log.seek(0)
            output.append(log.read())
            log.close()
        assert codes == [0, 0], "\n\n".join(o[-3000:] for o in output)
        results = read_results(tmp_path / "results")
        assert len(results) == 1, "exactly one rank (global rank 0) reports"
        r = results[0]
        assert r["world_size"] == 2
        assert max(d["ddp"] for d in r["one_step_diff"]) < 1e-6  # DDP across the two nodes = one process
        assert r["sgd_steps"]["sync_gap"] == 0.0
        assert r["comm"]["bytes"] == 4 * r["params"]  # 2(N-1)/N of the fp32 gradients, N = 2
        left = run_processes(marker)
        assert not left, f"processes left behind: {[p.pid for p in left]}"
    if namespaces:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert not set(namespaces) & set(listed), "a network namespace was left behind"
        assert not any((Path("/etc/netns") / n).exists() for n in namespaces)
