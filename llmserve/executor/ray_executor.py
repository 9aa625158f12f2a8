"""`--distributed-executor-backend ray`: the engine's other ranks as Ray actors.

This process (the Ray driver) is rank 0; ranks 1..N-1 are actors of one placement group,
one bundle per rank (`num_threads` CPUs each), bundle 0 pinned to this node for rank 0,
packed onto as few nodes as hold them (a pipeline's stages spill over to the next node,
a tensor-parallel group stays together where it fits). Each actor's one method call runs
the worker loop (`worker.run_ray_worker`): it connects to rank 0 exactly as a spawned or
torchrun worker does (the store on rank 0's node address, every rank from its interface
that routes there) and returns once told to stop. The cluster is the one `ray start` made
(RAY_ADDRESS, or "auto": this node's); without one Ray starts a local cluster.

An actor whose call ends before stop (its process or node died) is found by the watch
thread within a second: the engine is unavailable (503), and the server exits for its
orchestrator to start it again.
"""

import logging
import os
import threading
import time

import torch

from llmserve.executor.executor import TensorParallelExecutor
from llmserve.executor.ranks import connect, free_port, route_address
from llmserve.executor.worker import run_ray_worker

logger = logging.getLogger(__name__)


def join_ray_cluster() -> None:
    """Connect this process to the Ray cluster `ray start` made (RAY_ADDRESS, else this
    node's); without one, start a local one. Ray must be installed."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS", "auto")
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError:
        logger.info("no Ray cluster at %s: starting one on this machine", address)
        ray.init(log_to_driver=False)


class RayExecutor(TensorParallelExecutor):
    """Rank 0 of ranks placed on a Ray cluster; see the module docstring."""

    exits_on_failure = True

    def __init__(self, size: int, device: torch.device, num_threads: int | None,
                 pipeline_size: int = 1) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RuntimeError("distributed_executor_backend ray needs Ray: pip install "
                               "'llmserve[ray]'") from None
        join_ray_cluster()
        self._ray = ray
        node = ray.util.get_node_ip_address()
        cpus = float(num_threads or 1)
        bundles = [{"CPU": cpus, f"node:{node}": 0.001}] + [{"CPU": cpus}] * (size - 1)
        self.placement = placement_group(bundles, strategy="PACK")
        if not self.placement.wait(timeout_seconds=120):
            ray.util.remove_placement_group(self.placement)
            raise RuntimeError(f"the Ray cluster cannot place {size} ranks of {cpus:g} CPUs "
                               f"each (ray.available_resources(): "
                               f"{ray.available_resources()})")
        host, port = route_address(node), free_port()
        actor = ray.remote(num_cpus=cpus)(_Rank)
        self.actors = [
            actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement, placement_group_bundle_index=rank),
                name=None).remote()
            for rank in range(1, size)]
        self.calls = [a.run.remote(rank, size, host, port, str(device), num_threads,
                                   pipeline_size)
                      for rank, a in enumerate(self.actors, start=1)]
        logger.info("Ray: %d rank actors placed (%s)", size - 1, ", ".join(
            f"rank {r}: {n}" for r, n in enumerate(self._nodes(), start=1)))
        super().__init__(connect(0, size, host, port, device, pipeline_size))
        self._watch = threading.Thread(target=self._watch_actors, daemon=True,
                                       name="llmserve-ray-watch")
        self._watch.start()

    def _nodes(self) -> list[str]:
        table = self._ray.util.placement_group_table(self.placement)
        by_bundle = table.get("bundles_to_node_id", {})
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in self._ray.nodes()}
        return [ips.get(by_bundle.get(i), "?") for i in range(1, len(self.actors) + 1)]

    def _dead_worker(self) -> str | None:
        done, _ = self._ray.wait(self.calls, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self.calls.index(done[0]) + 1
        try:
            self._ray.get(done[0])
            why = "returned"
        except Exception as exc:  # noqa: BLE001 - what ended it, said
            why = str(exc).strip().splitlines()[-1][:300]
        return f"rank {rank} (a Ray actor) ended: {why}"

    def _watch_actors(self) -> None:
        while not self._stopped:
            time.sleep(1.0)
            if self._stopped:
                return
            found = self._dead_worker()
            if found is not None and not self._stopped:
                self.failure = found
                logger.error("%s; the engine is unavailable", found)
                return

    def shutdown(self) -> None:
        was_stopped = self._stopped
        super().shutdown()
        if was_stopped:
            return
        ray = self._ray
        try:
            ray.wait(self.calls, num_returns=len(self.calls), timeout=10)
        except Exception:  # noqa: BLE001 - the cluster may be gone already
            pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        try:
            ray.util.remove_placement_group(self.placement)
        except Exception:  # noqa: BLE001
            pass


class _Rank:
    """A Ray actor running one rank's worker loop."""

    def run(self, rank: int, size: int, host: str, port: int, device: str,
            num_threads: int | None, pipeline_size: int) -> None:
        run_ray_worker(rank, size, host, port, device, num_threads, pipeline_size)
