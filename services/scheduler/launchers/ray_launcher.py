"""RayLauncher: the `ray` backend's launcher: Ray places the tp * pp Worker services.

A placement group holds one bundle per rank ({"GPU": 1, "CPU": 1} on CUDA, else
{"CPU": 1}; PACK by default), and bundle r holds rank r's actor. Each actor (RankHost)
starts the same `pagestream worker` process the `mp` backend starts, on its own node,
bound to the node's IP, and hands back the address from the worker's ready file. The
worker process is the actor's child and exits when the actor goes (PARENT_PID_ENV), so a
killed actor or a finished Ray job leaves no rank behind. The scheduler then drives the
addresses like any external group.

The ranks meet at tcp://<rank 0's node IP>:<a port free there> (a file rendezvous cannot
cross hosts). On a GPU bundle Ray sets CUDA_VISIBLE_DEVICES to the one device it gave the
actor, so every rank's local rank is 0.

Ray is imported only when this backend is used (it is an optional extra), and Ray is
started only when nobody has: a local instance, or the cluster at RAY_ADDRESS. A Ray the
caller started is left running by close().
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.launchers.launcher import PARENT_PID_ENV, WorkerStartError

logger = logging.getLogger(__name__)

# rank, rendezvous (tcp://...), host to bind, ready file -> the arguments of the Python
# interpreter that runs that rank (the actor runs them with its own interpreter, which on a
# cluster need not live where the driver's does).
RayWorkerCommand = Callable[[int, str, str, str], list[str]]

# Forwarded from the engine's environment to every rank: the interface and tuning choices
# of the collectives, and where the model comes from (a cluster node's environment is the
# one `ray start` ran in, not the engine's).
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "HF_")
ACTOR_CALL_TIMEOUT_S = 30.0

INSTALL_HINT = "pip install 'pagestream[ray]'"


def import_ray():
    """The ray module, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"--distributed-executor-backend ray needs Ray, which is not installed: {INSTALL_HINT}"
        ) from exc
    return ray


class RankHost:
    """Inside a Ray actor: one rank's `pagestream worker` process on the actor's node."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="pagestream-ray-")
        self.ready_file = os.path.join(self.folder, "address")
        self.process: subprocess.Popen | None = None

    def describe(self) -> dict:
        """Where this rank lives: the node IP to bind, its cores, its ready file."""
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "cpus": os.cpu_count() or 1,
            "ready_file": self.ready_file,
        }

    def free_port(self) -> int:
        """A port free on this node now, for the rendezvous rank 0's worker will host."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, interpreter_args: list[str], env: dict[str, str]) -> int:
        """Start the worker (its logs go to the actor's, which Ray forwards); its pid."""
        child_env = {**os.environ, **env, PARENT_PID_ENV: str(os.getpid())}
        self.process = subprocess.Popen([sys.executable, *interpreter_args], env=child_env)
        return self.process.pid

    def wait_ready(self, timeout_s: float) -> str:
        """The address the worker bound, once it has written its ready file."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.isfile(self.ready_file):
                with open(self.ready_file, encoding="utf-8") as f:
                    if address := f.read().strip():
                        return address
            if (code := self.exit_code()) is not None:
                raise WorkerStartError(f"the worker process exited with {code}")
            time.sleep(0.05)
        raise WorkerStartError(f"the worker did not bind a port within {timeout_s}s")

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s; removes the ready file's folder."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class RankPlace:
    """A started rank: the node it landed on and its worker's pid there."""

    ip: str
    cpus: int
    ready_file: str
    pid: int = 0


class RayLauncher:
    def __init__(
        self,
        world_size: int,
        command: RayWorkerCommand,
        device: str = "auto",
        strategy: str = "PACK",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        self.ray = import_ray()
        self.world_size = world_size
        self.command = command
        self.device = device
        self.strategy = strategy
        self.placement_group = None
        self.actors: list = []
        self.places: list[RankPlace] = []
        self.owns_ray = False
        self.gpu = False

    @property
    def pids(self) -> list[int]:
        """The worker processes' pids, each on its own node (see `places`)."""
        return [place.pid for place in self.places]

    def start(self, timeout_s: float = 180.0) -> list[str]:
        """Place and start every rank; their addresses in rank order once each listens."""
        deadline = time.monotonic() + timeout_s
        try:
            self._connect()
            self._place(deadline)
            self._start_actors(deadline)
            return self._wait_ready(deadline)
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        if self.ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            self.ray.init(address="auto")
        else:
            self.ray.init()
        self.owns_ray = True

    def _uses_gpu(self) -> bool:
        """device cuda, or auto on a cluster that has GPUs (as auto means CUDA when the
        worker's machine has it)."""
        if self.device != "auto":
            return self.device == "cuda"
        return self.ray.cluster_resources().get("GPU", 0) > 0

    def _place(self, deadline: float) -> None:
        from ray.util.placement_group import placement_group

        timeout_s = max(0.1, deadline - time.monotonic())
        self.gpu = self._uses_gpu()
        bundle = {"GPU": 1, "CPU": 1} if self.gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * self.world_size, self.strategy)
        try:
            self.ray.get(self.placement_group.ready(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise WorkerStartError(
                f"Ray could not place {self.world_size} bundles of {bundle} "
                f"({self.strategy}) within {timeout_s:.0f}s; the cluster has "
                f"{self.ray.cluster_resources()}"
            ) from None

    def _start_actors(self, deadline: float) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 1 if self.gpu else 0
        actor_class = self.ray.remote(RankHost)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, rank)
            options = dict(num_cpus=1, num_gpus=gpus, scheduling_strategy=strategy)
            self.actors.append(actor_class.options(**options).remote())
        places = self._get([a.describe.remote() for a in self.actors], deadline)
        port = self._get(self.actors[0].free_port.remote(), deadline)
        rendezvous = f"tcp://{places[0]['ip']}:{port}"
        starts = []
        for rank, (actor, place) in enumerate(zip(self.actors, places, strict=True)):
            argv = self.command(rank, rendezvous, place["ip"], place["ready_file"])
            starts.append(actor.start.remote(argv, self._rank_env(place, places)))
        pids = self._get(starts, deadline)
        self.places = [RankPlace(**p, pid=pid) for p, pid in zip(places, pids, strict=True)]
        nodes = [p["ip"] for p in places]
        logger.info(
            "ray: started %d ranks on %s (rendezvous %s)", self.world_size, nodes, rendezvous
        )

    def _rank_env(self, place: dict, places: list[dict]) -> dict[str, str]:
        """Forwarded variables, and on each node an equal share of its cores per rank
        there (as `mp` does on one machine) unless OMP_NUM_THREADS was set."""
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        ranks_here = sum(1 for p in places if p["ip"] == place["ip"])
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, place["cpus"] // ranks_here))
        env["OMP_NUM_THREADS"] = threads
        return env

    def _wait_ready(self, deadline: float) -> list[str]:
        addresses = []
        for rank, actor in enumerate(self.actors):
            try:
                wait = actor.wait_ready.remote(max(0.1, deadline - time.monotonic()))
                addresses.append(self._get(wait, deadline + ACTOR_CALL_TIMEOUT_S))
            except WorkerStartError as exc:
                raise WorkerStartError(f"worker rank {rank} on Ray: {exc}") from None
        return addresses

    def _get(self, refs, deadline: float):
        """ray.get with what is left of the start's time, failures as WorkerStartError."""
        ray = self.ray
        try:
            return ray.get(refs, timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            message = "the Ray actors of the worker group did not answer in time"
            raise WorkerStartError(message) from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, WorkerStartError):
                raise WorkerStartError(str(exc.cause)) from None
            raise
        except ray.exceptions.RayActorError as exc:
            raise WorkerStartError(f"a Ray actor of the worker group died: {exc}") from None

    def check_alive(self) -> None:
        """Raise WorkerStartError naming the first rank whose process or actor is gone."""
        for rank, actor in enumerate(self.actors):
            deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
            try:
                code = self._get(actor.exit_code.remote(), deadline)
            except WorkerStartError as exc:
                raise WorkerStartError(f"worker rank {rank}: {exc}") from None
            if code is not None:
                place = self.places[rank] if rank < len(self.places) else None
                where = f"pid {place.pid} on {place.ip}" if place else "its process"
                raise WorkerStartError(
                    f"worker rank {rank} ({where}) exited with {code}; its log says why"
                )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker, kill the actors, free the placement group, and let go of
        Ray if this group started it. Never raises: it runs on failure paths too."""
        ray = self.ray
        actors, self.actors = self.actors, []
        try:
            ray.get([a.stop.remote(timeout_s) for a in actors], timeout=timeout_s + 5)
        except Exception:  # a dead actor's worker exits with it (PARENT_PID_ENV)
            logger.warning("ray: some ranks did not stop cleanly", exc_info=True)
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:
                logger.warning("ray: could not kill a rank's actor", exc_info=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.owns_ray:
            self.owns_ray = False
            ray.shutdown()
