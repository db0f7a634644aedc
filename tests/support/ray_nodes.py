"""Real Ray nodes on this machine for the tests that need a cluster: their own temp dir and ports, started with
the venv's ``ray start --block`` and torn down by stopping only their own processes (never ``ray stop``, which
stops every Ray on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_S = 180
# set on every node of a local cluster to its temp dir, and inherited by every process the nodes start: vLLM's
# engine processes rename themselves (VLLM::EngineCore), so their command lines no longer name the cluster
MARKER_ENV = "POPULORA_TEST_CLUSTER"
NODE_ENV = "POPULORA_TEST_NODE"  # and to the node's index, so that a node's processes can be stopped alone


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def own_processes(marker: str) -> list:
    """Every process whose command line names ``marker`` (a temp dir of the test's own), or whose environment
    has it as :data:`MARKER_ENV` (what a local cluster's nodes started, renamed or orphaned)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in process.info["cmdline"] or ()) or (
                    process.pid != os.getpid() and process.environ().get(MARKER_ENV) == marker):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kill_tree(marker: str) -> None:
    """Stop every process whose command line names ``marker``, and their children."""
    import psutil

    processes = own_processes(marker)
    for process in list(processes):
        try:
            processes += process.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=15)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _environ(process) -> dict:
    import psutil

    try:
        return process.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def node_env(**extra: str) -> dict[str, str]:
    """This environment without Ray's and Slurm's variables, the venv first on PATH, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               # Ray's memory monitor kills workers at 95% of the machine's memory, other processes' included;
               # on a shared test machine that is not this cluster's doing
               RAY_memory_monitor_refresh_ms="0", **extra)
    return env


def wait_for_nodes(gcs: str, count: int, env: dict, port: int = 0) -> None:
    """Until ``count`` nodes are alive (and, with ``port``, one of them is the node on that node manager port)."""
    probe = ("import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
             "alive = [n for n in ray.nodes() if n['Alive']]; "
             "print(len(alive) if int(sys.argv[2]) in [0, *(n['NodeManagerPort'] for n in alive)] else -1)")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        done = subprocess.run([sys.executable, "-c", probe, gcs, str(port)], env=env, capture_output=True,
                              text=True, timeout=120)
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(3)
    raise TimeoutError(f"Ray nodes at {gcs} did not come up: {done.stdout[-500:]} {done.stderr[-2000:]}")


def node_flags(ports: list[int], gpus: int, cpus: int) -> list[str]:
    """``ray start`` flags for a node on six ``ports`` of its own, blocking (the process is the node)."""
    return ["--num-gpus", str(gpus), "--num-cpus", str(cpus), "--object-store-memory", str(200 * 1024 ** 2),
            "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
            "--dashboard-agent-listen-port", str(ports[2]), "--dashboard-agent-grpc-port", str(ports[3]),
            "--metrics-export-port", str(ports[4]), "--runtime-env-agent-port", str(ports[5]),
            "--disable-usage-stats", "--block"]


@contextlib.contextmanager
def local_cluster(nodes: int, gpus: int, cpus: int, env: dict[str, str] | None = None,
                  node_envs: list[dict[str, str]] | None = None) -> Iterator[dict]:
    """A head and ``nodes - 1`` more raylets on this machine, ``gpus`` logical GPUs and ``cpus`` CPUs each, every
    one with :func:`node_env` plus ``env`` plus its own entry of ``node_envs`` (a raylet's workers inherit its
    environment, as on separate machines). Yields the addresses: ``dashboard`` (the job API), ``gcs``, the nodes'
    ``temp`` dir, and each node's ``node_manager_ports`` (what ``ray.nodes()`` reports as ``NodeManagerPort``);
    and ``lose_node(i)``, which kills node ``i`` (not the head) and every process it started at once, as a failed
    machine does, and ``restart_node(i)``, which starts it again on new ports (``node_manager_ports`` follows)."""
    temp = tempfile.mkdtemp(prefix="prh-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs, dashboard, client, *ports = free_ports(3 + nodes * 6)
    envs = [node_env(**{**(env or {}), **(node_envs or [{}] * nodes)[index], MARKER_ENV: temp,
                        NODE_ENV: str(index)}) for index in range(nodes)]
    started = []
    try:
        head = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
                "--ray-client-server-port", str(client), "--temp-dir", temp, *node_flags(ports[:6], gpus, cpus)]
        started.append(subprocess.Popen(head, env=envs[0], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True))
        wait_for_nodes(f"127.0.0.1:{gcs}", 1, envs[0])
        gcs_address = f"127.0.0.1:{gcs}"
        node_manager_ports = [ports[0]]

        def start_node(index: int, own_ports: list[int]) -> None:
            worker = [str(VENV_BIN / "ray"), "start", "--address", gcs_address, "--node-ip-address",
                      "127.0.0.1", *node_flags(own_ports, gpus, cpus)]
            started.append(subprocess.Popen(worker, env=envs[index], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))

        for index in range(1, nodes):
            start_node(index, ports[6 * index:6 * index + 6])
            node_manager_ports.append(ports[6 * index])
        wait_for_nodes(gcs_address, nodes, envs[0])

        def lose_node(index: int) -> dict[str, str]:
            """Kill node ``index``; returns its ``NodeID`` and ``NodeManagerAddress`` as Ray reported them."""
            import psutil

            if index == 0:
                raise ValueError("the head holds the cluster's state: losing it is losing the cluster")
            probe = ("import json, sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR', "
                     "log_to_driver=False); print(json.dumps([n for n in ray.nodes() if n['Alive'] and "
                     "n['NodeManagerPort'] == int(sys.argv[2])][0]))")
            done = subprocess.run([sys.executable, "-c", probe, gcs_address,
                                   str(cluster["node_manager_ports"][index])], env=envs[0], capture_output=True,
                                  text=True, timeout=120, check=True)
            node = json.loads(done.stdout.strip().splitlines()[-1])
            for process in [*own_processes(temp)]:
                if _environ(process).get(NODE_ENV) == str(index):
                    with contextlib.suppress(psutil.NoSuchProcess):  # gone already
                        process.kill()  # SIGKILL, the raylet and its workers alike: nothing gets to clean up
            return {"id": node["NodeID"], "address": node["NodeManagerAddress"]}

        def restart_node(index: int) -> None:
            own_ports = free_ports(6)
            start_node(index, own_ports)
            cluster["node_manager_ports"][index] = own_ports[0]
            wait_for_nodes(gcs_address, nodes, envs[0], port=own_ports[0])

        cluster = {"dashboard": f"http://127.0.0.1:{dashboard}", "gcs": gcs_address, "temp": temp,
                   "node_manager_ports": node_manager_ports, "lose_node": lose_node, "restart_node": restart_node}
        yield cluster
    finally:
        for node in reversed(started):
            node.send_signal(signal.SIGTERM)
        for node in reversed(started):
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()
        kill_tree(temp)
        shutil.rmtree(temp, ignore_errors=True)
