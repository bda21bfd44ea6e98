"""The memory section of a layer's window: which events' keys and values it holds at one step.

    [sinks | recalled events (chronological) | local window | new tokens]
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^

While reading, each layer recalls by its own queries within the reading budget (`retrieval.recall`); a prompt and
its answer read the events their `RecallPlan` pins, or recall by their queries within the plan's budget. On the
decode steps between two recalls the last section is reused.

Where the kernels run (a GPU) and the memory lies in RAM on the model's device, reading recalls without leaving
the device (`recall_on_device`, issue 19): the section then has the reading budget's size and its first `used`
slots hold the events, the rest padding that the window attention masks. Answers and probes report which events
they read, so they recall on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engramkv.config import EngineConfig
from engramkv.engine.sealing import LayerState
from engramkv.kernels.backend import use_triton
from engramkv.memory.events import EventMemory, OnDevice, RecallTensors
from engramkv.retrieval.question import RecallPlan
from engramkv.retrieval.recall import recall_on_device, select_events
from engramkv.spec import ModelSpec


class MemorySection:
    """Recalls each layer's memory section for one session's event memory."""

    def __init__(self, memory: EventMemory, cfg: EngineConfig, spec: ModelSpec, device: torch.device,
                 dtype: torch.dtype):
        self.memory, self.cfg, self.spec, self.device, self.dtype = memory, cfg, spec, device, dtype

    def recall(self, layer: int, st: LayerState, q: torch.Tensor, plan: RecallPlan | None, refresh: bool,
               probe: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s memory keys and values (Hkv, M, D) each for queries `q` (H, C, D); `used`: None, or on
        the device path the (1,) int32 count of the M slots that hold events; and the recall query (Hkv * D,) where
        one was computed (what a probe keeps).

        plan: None while reading. refresh: False on the decode steps that reuse the last section. probe: read
        without changing the stream (the contiguity buffer is neither read nor advanced)."""
        if not self.cfg.recall.enabled or len(self.memory) == 0:
            empty = q.new_empty(self.spec.num_kv_heads, 0, self.spec.head_dim)
            return empty, empty, None, None
        tensors = None if plan is not None or probe else self._on_device()
        if tensors is not None:
            if st.device_buffer is None:
                held = list(st.buffer)
                st.device_buffer = torch.tensor([-1] * (self.cfg.recall.contiguity_buffer - len(held)) + held,
                                                dtype=torch.long, device=self.device)
            query = group_query(q, self.spec.num_kv_heads)
            k, v, used, st.device_buffer = recall_on_device(
                tensors, layer, query, self.cfg.recall, self.cfg.segmentation.min_event, self.memory.shortest_event,
                st.device_buffer, self.cfg.segmentation.min_surprise, self.cfg.model.kernels)
            st.recalled_ids, st.recalled_tokens, st.recalled_kv = [], None, None  # the host path gathers anew
            return k.to(self.dtype), v.to(self.dtype), used, query
        buffer_to_host(st)
        query = None
        if refresh or st.recalled_kv is None:
            query = group_query(q, self.spec.num_kv_heads)  # (Hkv * D,)
            parts = None
            if plan is not None and plan.events is not None:
                ids, parts = list(plan.events), plan.event_tokens
            else:
                budget = plan.budget if plan is not None else self.cfg.recall.budget_tokens
                ids = select_events(self.memory, layer, query, self.cfg.recall, self.cfg.segmentation.min_event,
                                    None if probe else st.buffer, budget, self.cfg.segmentation.min_surprise)
            if ids != st.recalled_ids or parts != st.recalled_tokens or st.recalled_kv is None:
                k, v = self.memory.gather(layer, ids)  # (Hkv, M, D) each
                if parts is not None:
                    keep = _parts_index([self.memory.event(e).length for e in ids], parts)  # (M',)
                    k, v = k[:, keep], v[:, keep]
                st.recalled_kv = (k.to(self.device, self.dtype), v.to(self.device, self.dtype))
                st.recalled_ids, st.recalled_tokens = ids, parts
        return *st.recalled_kv, None, query

    def _on_device(self) -> RecallTensors | None:
        """The memory's tensors, where reading recalls on the device: with Triton's kernels, events on the compute
        device."""
        recall = self.cfg.recall
        if (recall.budget_tokens == 0 or not recall.select_on_device
                or not use_triton(self.cfg.model.kernels, self.device) or not isinstance(self.memory, OnDevice)):
            return None
        tensors = self.memory.recall_tensors()
        return tensors if tensors is not None and tensors.keys.device == self.device else None


def group_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:  # (H, C, D) -> (Hkv * D,)
    """A step's recall query: its queries averaged over the tokens and each KV head's group of query heads."""
    h, c, d = q.shape
    grouped = q.float().view(num_kv_heads, h // num_kv_heads, c, d)  # (Hkv, G, C, D)
    return grouped.mean(dim=(1, 2)).flatten()


def buffer_to_host(st: LayerState) -> None:
    """The contiguity buffer back in `st.buffer`, where reading on the device kept it."""
    if st.device_buffer is not None:
        st.buffer.clear()
        st.buffer.extend(e for e in st.device_buffer.tolist() if e >= 0)
        st.device_buffer = None


def _parts_index(lengths: list[int], parts: Sequence[tuple[int, int]]) -> torch.Tensor:  # (M',)
    """Positions, in events gathered back to back with these `lengths`, of each event's [first, end) part."""
    if len(parts) != len(lengths):
        raise ValueError(f"{len(parts)} token ranges for {len(lengths)} events")
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    pieces = [torch.arange(start + max(0, a), start + min(b, length))
              for start, length, (a, b) in zip(starts, lengths, parts)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
