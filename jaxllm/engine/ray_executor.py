"""One engine over several hosts, placed and supervised by Ray
(`--distributed-executor-backend ray`).

JAX runs a multi-process program in lockstep: every process launches each step with
the same inputs, and `jax.distributed` joins their devices into one mesh. Here the
processes come from Ray: the engine core (the scheduler, the KV cache manager and, under
`serve`, behind the HTTP server) is process 0 and drives its own host's devices; each
other host's devices are driven by a `RayWorker` actor. A placement group reserves one
bundle per process, one per node (STRICT_SPREAD), process 0's on the node the engine
starts on; the coordinator address (this node's IP and a free port) and each process's
id come from that placement, never from the user.

Before each model step process 0 sends the step's SchedulerOutput and token bitmask to
every worker as an actor call; each applies them to its own model runner, whose host
state is a function of the SchedulerOutputs it has seen, and runs the same executable.
JAX's collectives carry the tensors between hosts. A worker that dies cannot be replaced
(`jax.distributed` does not take a process back into a running mesh): the monitor thread
sees its actor end, logs why and exits the process, so that the server's frontend
answers the requests in flight with errors, `/health` turns 503 and the server exits
for its orchestrator to restart it. When process 0 stops, its actors die with it (Ray
ends the actors of an owner that is gone).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time

logger = logging.getLogger(__name__)

READY_SECONDS = 600.0  # how long the placement group and the workers may take to start
EXIT_CODE = 70  # the engine process's exit status when a worker dies (EX_SOFTWARE)


@dataclasses.dataclass(frozen=True)
class Placement:
    """This process's place in a multi-process engine: jax.distributed's coordinator
    (process 0's host:port), the process count and this process's id."""

    coordinator_address: str
    num_processes: int
    process_id: int
    cpu_devices: int = 0  # > 0: simulated CPU devices this process drives (a cluster without GPUs)


def initialize(placement: Placement) -> None:
    """jax.distributed over the placement's processes (before JAX starts a backend)."""
    import jax

    if placement.cpu_devices:
        jax.config.update("jax_num_cpu_devices", placement.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    jax.distributed.initialize(placement.coordinator_address, num_processes=placement.num_processes,
                               process_id=placement.process_id)


class RayWorker:
    """A process other than 0: its own EngineCore (loads the weights, warms up), whose
    runner runs every step process 0 sends. Made a Ray actor by RayExecutor."""

    def __init__(self, config, placement: Placement) -> None:
        from jaxllm.engine.core import EngineCore

        self.core = EngineCore(config, placement=placement, progress=False)

    def ready(self) -> tuple[str, int]:
        """(node IP, pid) once started."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def execute(self, sched, bitmask) -> None:
        """Run the step; a step that fails here ends the process (nobody waits for this
        call's result, and process 0 would wait in the step's collectives): the monitor
        then stops the engine as for a dead worker."""
        try:
            self.core.runner.execute_model(sched, bitmask)
        except BaseException:
            logger.critical("the step failed in this worker process; exiting", exc_info=True)
            logging.shutdown()
            os._exit(EXIT_CODE)

    def add_lora(self, lora) -> None:
        """Read and check an adapter here too (its folder at the same path on every
        node); ValueError to process 0 where it cannot be served."""
        self.core.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        self.core.remove_lora(lora_int_id)

    def update_weights_from_path(self, path: str) -> None:
        """Read the weights at `path` (the same on every node) and take them, in step with
        process 0 (after the steps already sent); ValueError to process 0 where they do
        not fit."""
        self.core.update_weights_from_path(path)

    def shutdown(self) -> None:
        """jax.distributed's shutdown, which every process enters together."""
        import jax

        jax.distributed.shutdown()

    def watch(self) -> None:
        """Returns only when the actor ends (the monitor's error then): a call in its own
        concurrency group, so it waits beside the steps."""
        threading.Event().wait()


class RayExecutor:
    """Process 0's side: the placement group, the workers, the steps sent to them and the
    monitor thread."""

    def __init__(self, config) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect(ray)
        n = config.num_processes
        per_host, gpus = _devices_per_process(config, ray)
        bundle = {"GPU": per_host, "CPU": 1} if gpus else {"CPU": 1}
        if sum(bool(node.get("Alive")) for node in ray.nodes()) < n:  # fail now, not after READY_SECONDS
            raise RuntimeError(_unplaceable(ray, n, bundle))
        self._pg = placement_group([bundle] * n, strategy="STRICT_SPREAD", name=f"jaxllm-engine-{os.getpid()}")
        try:
            ray.get(self._pg.ready(), timeout=READY_SECONDS)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._pg)
            raise RuntimeError(_unplaceable(ray, n, bundle)) from None
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.util.placement_group_table(self._pg)["bundles_to_node_id"]
        mine = [i for i, node in nodes.items() if node == here]
        if not mine:
            ray.util.remove_placement_group(self._pg)
            raise RuntimeError("distributed_executor_backend ray: no bundle of the placement group landed on this "
                               "node; start the engine on a node with free devices")
        others = [i for i in sorted(nodes) if i != mine[0]]
        cpu = 0 if gpus else per_host
        self.placement = Placement(f"{ray.util.get_node_ip_address()}:{_free_port()}", n, 0, cpu)
        actor = ray.remote(concurrency_groups={"watch": 1})(RayWorker)
        self.workers = []
        for pid, index in enumerate(others, start=1):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=index)
            self.workers.append(actor.options(num_cpus=1, num_gpus=per_host if gpus else 0,
                                              scheduling_strategy=strategy, name=f"jaxllm-worker-{os.getpid()}-{pid}",
                                              runtime_env={"env_vars": worker_env(gpus)}).remote(
                config, dataclasses.replace(self.placement, process_id=pid)))
        self._ray = ray
        self.sends, self.send_seconds = 0, 0.0  # steps sent, and the host time it took (scripts/bench_ray.py)
        self._watches = [w.watch.options(concurrency_group="watch").remote() for w in self.workers]
        self._closing = threading.Event()
        self._started = [w.ready.remote() for w in self.workers]
        threading.Thread(target=self._monitor, name="jaxllm-ray-monitor", daemon=True).start()

    def wait_started(self) -> list[tuple[str, int]]:
        """Each worker's (node IP, pid), once their EngineCores are built (after the
        leader's: jax.distributed waits for all processes)."""
        return self._ray.get(self._started)

    def send(self, sched, bitmask) -> None:
        """The step to every worker (returns at once; the monitor sees their failures)."""
        start = time.perf_counter()
        for worker in self.workers:
            worker.execute.remote(sched, bitmask)
        self.sends += 1
        self.send_seconds += time.perf_counter() - start

    def add_lora(self, lora) -> None:
        """Every worker reads and checks the adapter (after the steps already sent to it);
        ValueError with the first worker's reason where one cannot."""
        try:
            self._ray.get([worker.add_lora.remote(lora) for worker in self.workers])
        except self._ray.exceptions.RayTaskError as e:
            raise ValueError(f"{e.cause} (on a worker process)") from None

    def remove_lora(self, lora_int_id: int) -> None:
        """Every worker forgets the adapter after the steps already sent to it (actor calls
        run in order), so its slots stay the same as process 0's."""
        for worker in self.workers:
            worker.remove_lora.remote(lora_int_id)

    def update_weights_from_path(self, path: str):
        """Every worker reads and takes the weights at `path` after the steps already
        sent to it; returns the calls, for `wait` (process 0 places its own share between:
        its arrays and the workers' make one mesh's)."""
        return [worker.update_weights_from_path.remote(path) for worker in self.workers]

    def wait(self, calls) -> None:
        """The workers' calls done; ValueError with the first one's reason where one failed."""
        try:
            self._ray.get(calls)
        except self._ray.exceptions.RayTaskError as e:
            raise ValueError(f"{e.cause} (on a worker process)") from None

    def _monitor(self) -> None:
        """Exit the process (EXIT_CODE) when a worker's actor ends while the engine runs."""
        done, _ = self._ray.wait(self._watches, num_returns=1)
        self._exit_for(done[0])

    def exit_if_a_worker_died(self, timeout: float = 5.0) -> None:
        """After process 0's step failed: if a worker has ended (waiting up to `timeout`
        for Ray to notice), exit as the monitor does, naming it (the step's own error is
        then only the lost peer's connection)."""
        done, _ = self._ray.wait(self._watches, num_returns=1, timeout=timeout)
        if done:
            self._exit_for(done[0])

    def _exit_for(self, watch) -> None:
        if self._closing.is_set():
            return
        try:
            self._ray.get(watch)
            why = "it returned"
        except Exception as e:  # RayActorError: the process died, or the actor was killed
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logger.critical("process %d of the engine (a Ray worker) ended (%s); an engine over several processes "
                        "cannot go on without it: exiting", self._watches.index(watch) + 1, why)
        logging.shutdown()
        os._exit(EXIT_CODE)

    def close(self) -> None:
        """Shut jax.distributed down in every process together (its barrier waits for
        all of them), then stop the workers and free their placement. Registered to run
        at exit, before JAX's own shutdown would wait for workers that never come."""
        import jax

        if self._closing.is_set():
            return
        self._closing.set()
        atexit.unregister(self.close)
        stopping = [w.shutdown.remote() for w in self.workers]
        try:
            jax.distributed.shutdown()
            self._ray.get(stopping, timeout=60)
        except Exception as e:  # a worker gone already: nothing left to wait for
            logger.warning("stopping the Ray workers: %s", e)
        for worker in self.workers:
            self._ray.kill(worker)
        self._ray.util.remove_placement_group(self._pg)

    def close_at_exit(self) -> None:
        """Call close at exit (after jax.distributed is initialized: atexit runs last
        registered first)."""
        atexit.register(self.close)


def connect(ray) -> None:
    """This process attached to Ray: the running cluster (RAY_ADDRESS, or `ray start` on
    this node), else a local one of this node alone."""
    if not ray.is_initialized():
        ray.init(address="auto" if _cluster_running() else None, logging_level=logging.WARNING)


def _cluster_running() -> bool:
    """Whether a Ray cluster is there to join: RAY_ADDRESS, or `ray start` on this node."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    from ray._private.services import find_gcs_addresses  # what address="auto" reads

    return bool(find_gcs_addresses())


def _devices_per_process(config, ray) -> tuple[int, bool]:
    """(devices each process drives, whether they are GPUs): the engine's devices over
    its processes; GPUs where the cluster has them."""
    n, devices = config.num_processes, config.devices_per_engine
    if devices % n:
        raise ValueError(f"num_processes: {n} processes cannot drive {devices} devices evenly "
                         f"(tensor_parallel_size x pipeline_parallel_size)")
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    return devices // n, gpus


def worker_env(gpus: bool) -> dict[str, str]:
    """What a worker process inherits of this one's environment: the JAX platform and the
    log level (Ray sets CUDA_VISIBLE_DEVICES from the bundle's GPUs)."""
    keep = ("JAX_PLATFORMS", "JAXLLM_LOG_LEVEL", "XDG_CACHE_HOME", "PYTHONPATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    if not gpus:
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _unplaceable(ray, n: int, bundle: dict) -> str:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    have = "; ".join(f"{node['NodeManagerAddress']}: {node['Resources']}" for node in nodes)
    return (f"distributed_executor_backend ray: {n} processes need {n} nodes with {bundle} free each, one per node "
            f"(within {READY_SECONDS:.0f} s); the cluster has {len(nodes)} nodes alive: {have}")


def wait_for_workers(executor: RayExecutor) -> None:
    """Log each worker once started."""
    start = time.monotonic()
    for i, (ip, pid) in enumerate(executor.wait_started(), start=1):
        logger.info("process %d of %d: Ray worker pid %d on %s (%.0f s)", i, executor.placement.num_processes, pid,
                    ip, time.monotonic() - start)
