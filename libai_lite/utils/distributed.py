"""The process group, the ("pp", "dp", "cp", "tp") device mesh in one ``Layout``, rank helpers and hang reports."""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import UsageError
from .parallel_dims import ParallelDims


@dataclass
class Layout:
    """A running rank's ``ParallelDims`` (the one layout record) with its place, device and mesh.

    Built once by ``setup_dist`` and passed to whatever needs it; the sizes and options read through to ``dims``
    (``layout.tensor_parallel_size`` is ``layout.dims.tensor_parallel_size``).
    """

    dims: ParallelDims
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    # dp x cp flattened (setup_dist): kept here, as torch deprecates slicing a flattened dim from the root mesh.
    dp_cp_mesh: DeviceMesh | None = field(default=None, repr=False)
    # HSDP: the data-parallel ranks (x cp) as their 2-D ("dp_replicate", "dp_shard") mesh FSDP2 shards over.
    hsdp_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def of(cls, dims: ParallelDims, rank: int = 0, local_rank: int = 0, device: torch.device | None = None,
           mesh: DeviceMesh | None = None) -> Layout:
        """The ``Layout`` of ``dims`` for one rank (``mesh`` None: no process group, what the planner checks)."""
        return cls(dims, rank, local_rank, device if device is not None else torch.device("cpu"), mesh)

    # Coordinates on the mesh (0 without one).
    pp_rank = property(lambda self: self._coord("pp"))
    dp_rank = property(lambda self: self._coord("dp"))
    tp_rank = property(lambda self: self._coord("tp"))
    cp_rank = property(lambda self: self._coord("cp"))

    def _coord(self, name: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(name)

    def group(self, name: str):
        """The process group of one mesh dimension (None when there is no mesh)."""
        return None if self.mesh is None else self.mesh.get_group(name)

    @property
    def replica_mesh(self) -> DeviceMesh | None:
        """The mesh gradients are reduced (and ZeRO shards) over: dp, or dp x cp flattened under context
        parallelism, since every cp rank holds the whole parameters (Megatron's data-parallel-with-cp group).
        Under HSDP the same ranks as the 2-D ("dp_replicate", "dp_shard") mesh: FSDP2 shards over the
        second dimension and all-reduces over the first."""
        if self.mesh is None:
            return None
        if self.data_parallel_replicate_size > 1:
            return self.hsdp_mesh
        if self.context_parallel_size == 1:
            return self.mesh["dp"]
        return self.dp_cp_mesh

    @property
    def replica_group(self):
        """The one process group of all ``replica_mesh``'s ranks (under HSDP too, whose mesh is 2-D): what a
        reduction over every data-parallel (x cp) rank uses. None when there is no mesh."""
        if self.mesh is None:
            return None
        return (self.mesh["dp"] if self.context_parallel_size == 1 else self.dp_cp_mesh).get_group()

    @property
    def replica_size(self) -> int:
        """Ranks in ``replica_mesh``: data_parallel_size x context_parallel_size."""
        return self.data_parallel_size * self.context_parallel_size


def _read_through(name: str) -> property:
    return property(lambda self: getattr(self.dims, name), doc=f"``dims.{name}``")


for _name in [f.name for f in dataclasses.fields(ParallelDims)] + ["num_stages", "hsdp"]:
    setattr(Layout, _name, _read_through(_name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# train.dist.backend's choices. gloo also carries CUDA tensors (staged through host memory), so several
# processes can share one GPU, which NCCL refuses (one communicator rank per device).
BACKENDS = ("nccl", "gloo")


def default_backend(requested: str | None = None) -> str:
    """The process-group backend for ``train.dist.backend``: ``requested`` when it is one of ``BACKENDS``
    and usable here; null picks nccl when CUDA is present, gloo otherwise. UsageError for any other."""
    if requested is None or requested == "":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in BACKENDS:
        raise UsageError(f"train.dist.backend={requested!r} is not supported: use 'nccl' (GPUs), 'gloo' (CPU, or "
                         f"several processes sharing one GPU) or null for nccl on CUDA and gloo otherwise")
    if requested == "nccl" and not torch.cuda.is_available():
        raise UsageError("train.dist.backend='nccl' needs a CUDA device and this process sees none; use 'gloo' or "
                         "null (gloo on the CPU)")
    return requested


# torch's NCCL flight recorder: each variable with the older name torch also reads, so a user's setting under
# either name is kept. The buffer holds the last collectives of every group; DUMP_ON_TIMEOUT writes it
# to the file prefix + rank when the watchdog sees a timeout.
_FLIGHT_RECORDER = (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                    ("TORCH_NCCL_DUMP_ON_TIMEOUT", None),
                    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
FLIGHT_RECORDER_DIR = "flight_recorder"


def flight_recorder_env(backend: str, output_dir: str | None, environ=None) -> dict[str, str]:
    """The environment variables that turn on torch's NCCL flight recorder, dumping into
    ``<output_dir>/flight_recorder/rank_<r>`` on a collective timeout: none for gloo or without an output
    directory, and none that the user already set (under either of torch's names)."""
    environ = os.environ if environ is None else environ
    if backend != "nccl" or not output_dir:
        return {}
    values = ("2000", "1", os.path.join(os.path.abspath(output_dir), FLIGHT_RECORDER_DIR, "rank_"))
    return {name: value for (name, old), value in zip(_FLIGHT_RECORDER, values)
            if name not in environ and (old is None or old not in environ)}


def flight_recorder_dir(environ=None) -> str | None:
    """The folder this process's NCCL flight recorder dumps into (None when it is off)."""
    environ = os.environ if environ is None else environ
    if _MONITOR.get("backend") != "nccl":
        return None
    prefix = environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    size = environ.get("TORCH_FR_BUFFER_SIZE") or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
    if not prefix or not size or size.strip() == "0" or environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "0") in ("", "0"):
        return None
    return os.path.dirname(prefix) or "."


def _init_process_group(timeout_s: float, backend: str | None = None, output_dir: str | None = None) -> None:
    if dist.is_initialized():
        return
    backend = default_backend(backend)
    # Read by ProcessGroupNCCL when the group is created, so set before it.
    os.environ.update(flight_recorder_env(backend, output_dir))
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if backend == "nccl" and local_world > torch.cuda.device_count():
            raise UsageError(f"{local_world} processes per node but {torch.cuda.device_count()} visible GPU(s): NCCL "
                             f"needs a GPU per rank; launch at most {torch.cuda.device_count()} per node, or set "
                             f"train.dist.backend=gloo to share the GPUs")
        if torch.cuda.is_available():
            # Modulo the devices: more local ranks than GPUs share them (gloo; NCCL refuses two ranks on
            # one device at its first collective).
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # A restarted job under static rendezvous reuses the agent store, which still holds the
            # dead workers' gloo addresses; a prefix per restart keeps each attempt's keys apart.
            world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"/libai_lite/restart_{restart}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # A plain `python tools/train_net.py` run is a world of one; initialising a real group
        # keeps one code path (DCP, DeviceMesh, barriers) for every launch.
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0,
                                timeout=timeout)


def check_backend_layout(pipeline_parallel_size: int) -> None:
    """Refuse, before any work, a layout the backend cannot carry on this device.

    gloo's send/recv takes host memory only, so pipeline stages exchanging CUDA activations over gloo
    would fail at their first send; gloo's collectives stage CUDA tensors through host memory and work.
    """
    if pipeline_parallel_size > 1 and torch.cuda.is_available() and dist.get_backend() == "gloo":
        raise UsageError(f"train.dist.backend='gloo' cannot carry the pipeline's send/recv of CUDA tensors "
                         f"(pipeline_parallel_size={pipeline_parallel_size}): use backend nccl (one GPU per rank), "
                         f"or pipeline_parallel_size=1 when ranks share a GPU")


def hsdp_mesh(replica_mesh: DeviceMesh, replicate: int) -> DeviceMesh:
    """The 1-D ``replica_mesh`` (dp, or dp x cp) unflattened into ("dp_replicate", "dp_shard"): row-major, so a
    shard group holds neighbouring data-parallel ranks (one node's, when the launch puts neighbours on a node, as
    torchrun does) and a replicate group the same shard of each. Collective: it creates both dimensions' groups."""
    return replica_mesh._unflatten(0, (replicate, replica_mesh.size() // replicate), ("dp_replicate", "dp_shard"))


def setup_dist(dist_cfg, zero_cfg=None, output_dir: str | None = None) -> Layout:
    """Initialise the process group and the ("pp", "dp", "cp", "tp") mesh from ``train.dist`` and
    ``train.zero_optimization`` (``ParallelDims.resolve`` for the world launched); returns the run's ``Layout``.
    Under NCCL, torch's flight recorder dumps into ``output_dir`` (``flight_recorder_env``)."""
    timeout_s = float(dist_cfg.get("timeout", 600) or 600)
    _init_process_group(timeout_s, dist_cfg.get("backend", None), output_dir)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims.resolve(world_size, dist_cfg, zero_cfg)
    check_backend_layout(dims.pipeline_parallel_size)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    # torchtitan's order: cp sits between dp and tp, so a cp group's ranks are tp apart and a
    # dp x cp replica group is contiguous once flattened.
    pp, dp, cp, tp = (dims.pipeline_parallel_size, dims.data_parallel_size, dims.context_parallel_size,
                      dims.tensor_parallel_size)
    mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    layout = Layout.of(dims, rank, int(os.environ.get("LOCAL_RANK", 0)), device, mesh)
    if cp > 1:
        # Flattening creates the dp x cp process group, a collective: every rank does it here, together.
        layout.dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    if dp > 1 and tp > 1 and cp == 1 and not dims.hsdp:
        # Sharded and tensor-parallel weights are DTensors over (dp, tp): a value partial on both (the gradient
        # norm) is then reduced in one all_reduce over this flattened group instead of one per dimension.
        mesh["dp", "tp"]._flatten("dp_tp")
    if dims.hsdp:
        layout.hsdp_mesh = hsdp_mesh(mesh["dp"] if cp == 1 else layout.dp_cp_mesh, dims.data_parallel_replicate_size)
    _MONITOR.update(timeout_s=timeout_s, backend=dist.get_backend(), group=dist.new_group(backend="gloo") if world_size > 1 else None,
                    # train.dist.timeout applies here too: a stuck rank must still end the run in time.
                    control=dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1
                    else None)
    return layout


# ------------------------------------------------------------------------------ hangs

# What this rank is doing, for the message a collective timeout turns into. A separate gloo
# group (its own connections, untouched by the timed-out collective) lets rank 0 ask who is missing.
_ACTIVITY: dict = {"what": "setup", "iteration": None}
# "control": a gloo group over all ranks for the few host scalars ranks agree on (the stop flag every step,
# a log line's sums): reduced in host memory, so under NCCL they never wait on, or read back from, the GPU.
_MONITOR: dict = {"timeout_s": None, "group": None, "control": None, "backend": None}


def set_activity(what: str, iteration: int | None = None) -> None:
    """Record what this rank is doing now (cheap: two dict writes), for ``describe_collective_timeout``."""
    _ACTIVITY["what"] = what
    _ACTIVITY["iteration"] = iteration


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a collective that gave up waiting for other ranks."""
    while exc is not None:
        text = str(exc).lower()
        if isinstance(exc, getattr(dist, "DistBackendError", ())) or "timed out" in text or "timeout" in text \
                or "connection closed by peer" in text or "connection reset by peer" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _collective_name(exc: BaseException) -> str:
    """The torch.distributed function the traceback was in (all_reduce, broadcast, ...), or a description."""
    names = [frame.name for frame in traceback.extract_tb(exc.__traceback__)
             if f"{os.sep}distributed{os.sep}" in frame.filename and frame.name not in ("wrapper", "_wrapper")]
    if names:
        return names[-1]
    # DDP and FSDP reduce gradients from autograd hooks in C++: no Python frame names them.
    return "a gradient reduction inside backward" if "backward" in _ACTIVITY["what"] else "a collective"


def describe_worker_death(exc: BaseException) -> str | None:
    """torch's report of a DataLoader worker that died (a kill, the out-of-memory killer, a crash in native
    code) as one line naming where the run was; None for any other error. torch raises it from its SIGCHLD
    handler, so it can leave from any point of a step."""
    what = None
    while exc is not None and what is None:
        if isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker"):
            what = " ".join(str(exc).split()).rstrip(". ")
        elif isinstance(exc, (ConnectionError, EOFError)) and any(
                f"{os.sep}torch{os.sep}{part}" in frame.filename
                # Names only: reading source lines is time another worker's SIGCHLD can land in.
                for frame in traceback.StackSummary.extract(traceback.walk_tb(exc.__traceback__), lookup_lines=False)
                for part in ("multiprocessing", os.path.join("utils", "data"))):
            # The batch a dead worker was handing over: its socket closes before torch's SIGCHLD check runs.
            what = f"a DataLoader worker died while handing over a batch ({type(exc).__name__}: {exc})"
        exc = exc.__cause__ or exc.__context__
    if what is None:
        return None
    it = _ACTIVITY["iteration"]
    where = _ACTIVITY["what"] + (f" at iteration {it}" if it is not None else "")
    return (f"{what} during {where}: a kill or the kernel's out-of-memory killer "
            f"ends workers so (dmesg says which); free host memory or lower dataloader.train.num_workers, then "
            f"--resume from the last checkpoint")


def describe_out_of_memory(exc: BaseException) -> str | None:
    """An allocation that failed (torch's OutOfMemoryError on an accelerator, the CPU allocator's RuntimeError)
    as one line naming where the run was and what to lower; None for any other error."""
    while exc is not None and not (isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc))):
        exc = exc.__cause__ or exc.__context__
    if exc is None:
        return None
    text = str(exc)
    cpu = re.search(r"you tried to allocate (\d+) bytes", text)
    accel = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", text)
    size = f"{int(cpu.group(1)) / 2**30:.2f} GiB" if cpu else (accel.group(1) if accel else "an allocation")
    it = _ACTIVITY["iteration"]
    where = _ACTIVITY["what"] + (f" at iteration {it}" if it is not None else "")
    return (f"out of {'host' if cpu else 'device'} memory during {where} (asking for {size}): lower "
            f"train.train_micro_batch_size or the sequence length, or turn on activation checkpointing or ZeRO "
            f"(tools/estimate_memory.py CONFIG estimates the peak of a setting), then run it again with --resume "
            f"(from the last checkpoint, or from the start where none was saved)")


def _missing_ranks() -> list[int] | None:
    """On rank 0: the ranks that do not answer a monitored barrier on the side group (None if unknown)."""
    group = _MONITOR["group"]
    if group is None or dist.get_rank() != 0:
        return None
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=min(10.0, _MONITOR["timeout_s"] or 10.0)),
                               wait_all_ranks=True)
    except Exception as e:  # noqa: BLE001 - its message lists the ranks that did not arrive
        m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(e))
        return [int(r) for r in m.group(1).replace(" ", "").split(",") if r] if m else None
    return []


def describe_collective_timeout(exc: BaseException) -> str:
    """One line naming this rank, the operation and step it gave up in, and the ranks that did not arrive."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    it = _ACTIVITY["iteration"]
    where = _ACTIVITY["what"] + (f" at iteration {it}" if it is not None else "")
    timeout = _MONITOR["timeout_s"]
    missing = _missing_ranks()
    if missing:
        who = f"rank(s) {missing} did not arrive (stuck or dead: see their log.txt.rank<N>)"
    else:
        who = "another rank stopped responding (stuck or dead: see the other ranks' log.txt.rank<N>)"
    after = f" after {timeout:g} s" if timeout else ""
    folder = flight_recorder_dir()
    dump = (f"; NCCL's flight recorder dumps each rank's last collectives to {folder}{os.sep}rank_<N> "
            f"(`torchfrtrace {folder}` names the rank and collective that diverged)") if folder else ""
    return (f"rank {rank} timed out{after} in {_collective_name(exc)} during {where}: {who}{dump}; "
            f"if the work is only slow, raise train.dist.timeout")


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _collective_device(group) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo takes CPU ones.
    nccl = dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _all_reduce_scalars(values: Sequence[float], group, op, mean: bool = False) -> list[float]:
    values = [float(v) for v in values]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values
    if group is None and _MONITOR["control"] is not None:
        group = _MONITOR["control"]
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return (t / dist.get_world_size(group) if mean else t).tolist()


def all_reduce_mean(values: Sequence[float], group=None) -> list[float]:
    """Mean of a few scalars over a process group (all ranks when `group` is None)."""
    return _all_reduce_scalars(values, group, dist.ReduceOp.SUM, mean=True)


def all_reduce_sum(values: Sequence[float], group=None) -> list[float]:
    """Sum of a few scalars over a process group."""
    return _all_reduce_scalars(values, group, dist.ReduceOp.SUM)


def all_reduce_max(values: Sequence[float], group=None) -> list[float]:
    """Maximum of a few scalars over a process group."""
    return _all_reduce_scalars(values, group, dist.ReduceOp.MAX)


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_MONITOR["control"])
    return box[0]


def destroy() -> None:
    """Tear down the process group (end of a run or a test)."""
    _MONITOR.update(timeout_s=None, group=None, control=None, backend=None)
    set_activity("setup")
    if dist.is_initialized():
        dist.destroy_process_group()
