"""The adapters' device slots and host copies (vLLM's LRU worker LoRA manager).

`max_loras` device slots hold adapters for the step (jaxllm.models.lora); a request
running under an adapter holds its slot from admission until it finishes or is
preempted, so its tokens always find it. The scheduler never runs more than
`max_loras` distinct adapters at once, so a newly admitted request's adapter finds a
slot no running request holds: the least recently used such slot is overwritten.
Adapters read from disk stay on the host, `max_cpu_loras` of them (least recently used
dropped), so an adapter coming back to a slot is not read again.
"""

from __future__ import annotations

import collections
import logging

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxllm.config import ModelConfig
from jaxllm.lora.peft import load_adapter
from jaxllm.lora.request import LoRAConfig, LoRARequest
from jaxllm.models.lora import LoRAWeights, abstract_lora, set_slot, zeros_like_abstract
from jaxllm.models.pipeline import lora_specs, stage_layers

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, cfg: ModelConfig, config: LoRAConfig, dtype, mesh: Mesh | None = None) -> None:
        """`mesh`: the slots sharded over it as their projections are (tensor parallelism),
        stacked by stage as the layers are (pipeline parallelism)."""
        self.cfg = cfg
        self.config = config
        self.mesh = mesh
        abstract = stage_layers(abstract_lora(cfg, config.max_loras, config.max_lora_rank, dtype), cfg, mesh)
        self.weights: LoRAWeights = zeros_like_abstract(abstract)
        if mesh is None:
            self.shardings = None
            self._set_slot = jax.jit(set_slot, donate_argnums=(0,))
        else:
            specs = lora_specs(cfg, mesh)
            self.shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                          is_leaf=lambda x: isinstance(x, PartitionSpec))
            abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                    self.shardings)
            self.weights = jax.device_put(self.weights, self.shardings)
            self._set_slot = jax.jit(set_slot, donate_argnums=(0,), out_shardings=self.shardings)
        self.abstract = abstract
        self._host: collections.OrderedDict[int, LoRAWeights] = collections.OrderedDict()  # LRU, by lora_int_id
        self._paths: dict[int, LoRARequest] = {}  # the request each host copy was read for
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU: lora_int_id -> slot
        self._users: collections.Counter[int] = collections.Counter()  # running requests per lora_int_id
        self._held: dict[str, int] = {}  # request id -> its lora_int_id

    # ------------------------------------------------------------- host copies

    def add(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's host arrays, read (and checked) if not already held;
        ValueError naming what is wrong with it, or if its id names another path."""
        known = self._paths.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} is already {known.lora_name!r} at "
                             f"{known.lora_path}, not {lora.lora_path}")
        if known is None and self._users[lora.lora_int_id]:  # removed, but its slot still serves running requests
            raise ValueError(f"lora_request: lora_int_id {lora.lora_int_id} was removed while requests still run "
                             "under it; give the adapter a new id")
        host = self._host.get(lora.lora_int_id)
        if host is None:
            host, rank = load_adapter(lora.lora_path, self.cfg, self.config.max_lora_rank)
            logger.info("LoRA adapter %r (id %d, rank %d) read from %s", lora.lora_name, lora.lora_int_id, rank,
                        lora.lora_path)
            self._host[lora.lora_int_id] = host
            self._paths[lora.lora_int_id] = lora
            while len(self._host) > self.config.max_cpu_loras:
                self._host.popitem(last=False)  # read again if it is needed again
        self._host.move_to_end(lora.lora_int_id)
        return host

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy; its slot once no running request holds it).
        Whether it was known."""
        known = self._paths.pop(lora_int_id, None) is not None
        self._host.pop(lora_int_id, None)
        if not self._users[lora_int_id]:
            self._slot_of.pop(lora_int_id, None)
        return known

    def list_loras(self) -> list[int]:
        return list(self._paths)

    # ------------------------------------------------------------- device slots

    def acquire(self, req_id: str, lora: LoRARequest | None) -> int:
        """The slot (1..max_loras; 0: no adapter) of a request admitted to the batch,
        its adapter loaded into one if it is not in one already."""
        if lora is None:
            return 0
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            host = stage_layers(self.add(lora), self.cfg, self.mesh)
            self.weights = self._set_slot(self.weights, jnp.int32(slot), host)
            self._slot_of[lora.lora_int_id] = slot
        self._slot_of.move_to_end(lora.lora_int_id)
        self._users[lora.lora_int_id] += 1
        self._held[req_id] = lora.lora_int_id
        return slot + 1

    def release(self, req_id: str) -> None:
        """A request left the batch (finished or preempted): its slot may be reused."""
        lora_id = self._held.pop(req_id, None)
        if lora_id is not None:
            self._users[lora_id] -= 1
            if not self._users[lora_id] and lora_id not in self._paths:  # removed while it ran
                self._slot_of.pop(lora_id, None)

    def _free_slot(self) -> int:
        """A slot no running request's adapter holds (0-based): an empty one, else the
        least recently used."""
        taken = set(self._slot_of.values())
        empty = next((s for s in range(self.config.max_loras) if s not in taken), None)
        if empty is not None:
            return empty
        victim = next((i for i in self._slot_of if not self._users[i]), None)
        if victim is None:
            raise RuntimeError(f"more than max_loras={self.config.max_loras} adapters in the running batch "
                               "(the scheduler should prevent it)")
        return self._slot_of.pop(victim)
