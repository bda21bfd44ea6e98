"""The streaming episodic engine: one session's attention state, chunk by chunk.

Per layer the state holds the sink tokens and the local window (pre-RoPE K, V, plus
how much attention each local token has received). A forward pass calls `attend` once
per layer; it assembles

    [sinks | recalled events (chronological) | local window | new tokens]

applies RoPE at the positions the scheme assigns, runs one softmax over all of it, and
appends the new tokens to the resident part. After the forward pass the engine scores
surprise from the same logits, finds boundaries, refines them on the key-similarity
graph, and seals whole events that have left the local window into the event memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engramkv import hf
from engramkv.config import EngineConfig
from engramkv.memory.events import Event, EventMemory
from engramkv.memory.refinement import refine_boundary, similarity_graph
from engramkv.memory.segmentation import OnlineSegmenter
from engramkv.memory.surprise import token_surprise
from engramkv.memory.summary import key_summary, representative, summary_layer_ids
from engramkv.retrieval.recall import select_events
from engramkv.spec import ModelSpec
from engramkv.engine.window import assemble, lower_right_causal_mask, resident_columns, window_positions

Mode = Literal["ingest", "prompt", "decode", "probe"]  # prompt = ingest of a question, with the answer budget


@dataclass
class _LayerState:
    sink_k: torch.Tensor  # (Hkv, S', D) pre-RoPE
    sink_v: torch.Tensor  # (Hkv, S', D)
    local_k: torch.Tensor  # (Hkv, L, D) pre-RoPE
    local_v: torch.Tensor  # (Hkv, L, D)
    local_attention: torch.Tensor  # (Hkv, L) float32, attention received while resident
    recalled_ids: list[int] = field(default_factory=list)
    recalled_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    buffer: deque[int] = field(default_factory=deque)
    probe_query: torch.Tensor | None = None  # (Hkv * D,) set in probe mode
    probe_keys: torch.Tensor | None = None  # (Hkv, C, D) pre-RoPE, set in probe mode


@dataclass
class Probe:
    """What the model computed for probed tokens, per layer, without the stream changing."""

    queries: list[torch.Tensor]  # (Hkv * D,) each: the recall query of the step
    keys: list[torch.Tensor]  # (Hkv, C, D) each: the probed tokens' pre-RoPE keys
    recalled: list[list[int]]  # the events each layer's query recall chose for the probed tokens


class EpisodicState:
    """Implements `hf.AttentionState`; drives segmentation and sealing between forward passes."""

    def __init__(
        self,
        model: PreTrainedModel,
        rope: hf.Rope,
        spec: ModelSpec,
        cfg: EngineConfig,
        memory: EventMemory,
    ):
        self.model, self.rope, self.spec, self.cfg, self.memory = model, rope, spec, cfg, memory
        self.dtype, self.device = model.dtype, model.device
        empty = torch.empty(spec.num_kv_heads, 0, spec.head_dim, dtype=self.dtype, device=self.device)
        self.layers = [
            _LayerState(
                empty,
                empty,
                empty,
                empty,
                torch.empty(spec.num_kv_heads, 0),
                buffer=deque(maxlen=cfg.recall.contiguity_buffer),
            )
            for _ in range(spec.num_layers)
        ]
        # The sink tokens, and the tokens not yet sealed into an event (stream[tail_start:]); sealed
        # ones live in the event memory.
        self.sink_tokens = torch.empty(0, dtype=torch.int32)
        self.tail_tokens = torch.empty(0, dtype=torch.int32)
        self.tail_start = 0
        self.n_tokens = 0
        self.sink_len = 0
        self.local_start = 0  # global index of the first local-window token
        self.local_surprise = torch.empty(0)  # (L,) surprise of local tokens
        self.boundaries: list[int] = []  # starts of events inside the local window, after local_start
        self.segmenter = OnlineSegmenter(cfg.segmentation, cfg.surprise_window)
        self.last_logits: torch.Tensor | None = None  # (V,) predicts the next token
        self.mode: Mode = "ingest"
        self.recall_now = True
        self.decode_steps = 0
        self.events_sealed = 0
        self.summary_layers = summary_layer_ids(spec.num_layers, cfg.recall.summary_layers)
        # Set for a chat turn: every layer attends to these events while the answer is read and written.
        self.pinned_events: list[int] | None = None
        self.pinned_from = 0  # global index of the first token read with the pinned events (the prompt's start)
        self._masks: dict[int, torch.Tensor] = {}  # wide causal masks by query count
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (P, D)

    # ------------------------------------------------------------------ attention hook
    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        st = self.layers[layer]
        q, k, v = query[0], key[0], value[0]  # (H, C, D), (Hkv, C, D), (Hkv, C, D)
        n_new = q.shape[1]
        mem_k, mem_v = self._recalled(layer, st, q)  # (Hkv, M, D) each
        n_sink, n_mem, n_local = st.sink_k.shape[1], mem_k.shape[1], st.local_k.shape[1]
        # Memory goes before the local window, or (an answer with before_question) between the local
        # text read before the prompt and the prompt: `split` local tokens precede it.
        split = 0
        if self._memory_before_question():
            split = min(max(self.pinned_from - self.local_start, 0), n_local)
        keys = assemble(st.sink_k, st.local_k, mem_k, k, split)  # (Hkv, N, D)
        values = assemble(st.sink_v, st.local_v, mem_v, v, split)  # (Hkv, N, D)
        n_keys = keys.shape[1]

        positions = window_positions(n_sink, n_mem, n_local, n_new, self.cfg.recall.positions)  # (N,)
        cos, sin = self._cos_sin(positions, q)  # (N, D) each
        q_rot = self.rope.apply(q, cos[-n_new:], sin[-n_new:])  # (H, C, D)
        k_rot = self.rope.apply(keys, cos, sin)  # (Hkv, N, D)
        mask = None if n_keys == n_new else self._mask(n_new, n_keys)
        out = F.scaled_dot_product_attention(
            q_rot[None], k_rot[None], values[None], attn_mask=mask, is_causal=mask is None and n_new > 1,
            scale=scaling, enable_gqa=True,
        )  # (1, H, C, D)

        if self.mode != "probe":
            received = self._attention_received(q_rot, k_rot, scaling, n_sink, split, n_mem)  # (Hkv, L + C)
            self._append(st, k, v, received)
        else:
            st.probe_keys = k
        return out.transpose(1, 2)  # (1, C, H, D)

    def _mask(self, n_queries: int, n_keys: int) -> torch.Tensor:  # (C, N) bool view
        # A lower-right causal mask of width N is the right end of a wider one: build it once per
        # query count and slice, since every layer (different recall sizes) wants another N.
        wide = self._masks.get(n_queries)
        if wide is None or wide.shape[1] < n_keys:
            width = max(n_keys, self.cfg.attention_span())
            wide = self._masks[n_queries] = lower_right_causal_mask(n_queries, width).to(self.device)
        return wide[:, wide.shape[1] - n_keys :]

    def _cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < needed:
            self._rope_table = self.rope.table(max(needed, self.cfg.attention_span()), like)
        cos, sin = self._rope_table
        if self.cfg.recall.positions == "contiguous":  # positions are 0..N-1: a view, no gather
            return cos[:needed], sin[:needed]
        index = positions.to(self.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def _recalled(self, layer: int, st: _LayerState, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cfg.recall.enabled or len(self.memory) == 0:
            empty = q.new_empty(self.spec.num_kv_heads, 0, self.spec.head_dim)
            return empty, empty
        if self.recall_now or st.recalled_kv is None:
            query = self._group_query(q)  # (Hkv * D,)
            if self.mode == "probe":
                st.probe_query = query
            recall = self.cfg.recall
            budget = recall.budget_tokens
            if self.mode in ("prompt", "decode") and recall.answer_budget_tokens is not None:
                budget = min(budget, recall.answer_budget_tokens)
            if self.pinned_events is not None and self.mode in ("prompt", "decode"):
                ids = self.pinned_events
            else:
                ids = select_events(
                    self.memory, layer, query, recall, self.cfg.segmentation.min_event,
                    None if self.mode == "probe" else st.buffer, budget=budget,
                )
            if ids != st.recalled_ids or st.recalled_kv is None:
                k, v = self.memory.gather(layer, ids)
                st.recalled_kv = (k.to(self.device, self.dtype), v.to(self.device, self.dtype))
                st.recalled_ids = ids
        return st.recalled_kv

    def _group_query(self, q: torch.Tensor) -> torch.Tensor:
        h, c, d = q.shape
        grouped = q.float().view(self.spec.num_kv_heads, h // self.spec.num_kv_heads, c, d)  # (Hkv, G, C, D)
        return grouped.mean(dim=(1, 2)).flatten()  # (Hkv * D,)

    def _memory_before_question(self) -> bool:
        recall = self.cfg.recall
        return (self.pinned_events is not None and self.mode in ("prompt", "decode")
                and recall.answer_layout == "before_question" and recall.positions == "contiguous")

    def _attention_received(
        self, q_rot: torch.Tensor, k_rot: torch.Tensor, scaling: float, n_sink: int, memory_at: int, n_mem: int
    ) -> torch.Tensor:  # (Hkv, L + C)
        """Attention that the last few queries pay to each local/new token (feeds the representatives);
        the keys are assembled with `memory_at` local tokens before the memory."""
        h, c, d = q_rot.shape
        hkv, n_keys = k_rot.shape[0], k_rot.shape[1]
        s = min(c, self.cfg.representatives.stat_queries)
        probe = q_rot[:, -s:].float().reshape(hkv, (h // hkv) * s, d)  # (Hkv, G*s, D)
        logits = (probe @ k_rot.float().transpose(1, 2) * scaling).view(hkv, h // hkv, s, n_keys)  # (Hkv, G, s, N)
        # Causality only bites inside the last s keys (the probing queries themselves).
        future = ~self._mask(s, s)  # (s, s) strictly upper triangle
        logits[..., n_keys - s :].masked_fill_(future, float("-inf"))
        weights = logits.softmax(dim=-1).sum(dim=(1, 2))  # (Hkv, N)
        return resident_columns(weights, n_sink, memory_at, n_mem).cpu()

    def _append(self, st: _LayerState, k: torch.Tensor, v: torch.Tensor, received: torch.Tensor) -> None:
        to_sink = min(k.shape[1], self.cfg.window.n_sink - st.sink_k.shape[1])
        if to_sink > 0:
            st.sink_k = torch.cat([st.sink_k, k[:, :to_sink]], dim=1)
            st.sink_v = torch.cat([st.sink_v, v[:, :to_sink]], dim=1)
        n_local_old = st.local_k.shape[1]
        st.local_k = torch.cat([st.local_k, k[:, to_sink:]], dim=1)
        st.local_v = torch.cat([st.local_v, v[:, to_sink:]], dim=1)
        accumulated = torch.cat([st.local_attention, torch.zeros(received.shape[0], k.shape[1] - to_sink)], dim=1)
        # `received` covers [local (old) | new]; the sink part of the new tokens is dropped.
        accumulated[:, :n_local_old] += received[:, :n_local_old]
        accumulated[:, n_local_old:] += received[:, n_local_old + to_sink :]
        st.local_attention = accumulated

    # ------------------------------------------------------------------ stream processing
    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor, mode: Mode = "ingest") -> torch.Tensor:
        """Run the model over `token_ids` (T,) and advance the stream; returns the logits (T or 1, V)."""
        self.mode = mode
        if mode == "decode":
            # The prompt's recall stands for the first tokens; refresh every decode_interval after that.
            self.recall_now = self.decode_steps > 0 and self.decode_steps % self.cfg.recall.decode_interval == 0
            self.decode_steps += 1
        else:
            self.recall_now, self.decode_steps = True, 0
        keep = 1 if mode == "decode" else 0
        logits = hf.forward(self.model, token_ids[None].to(self.device), self, logits_to_keep=keep).cpu()
        if mode == "probe":
            return logits
        if mode == "decode" and self.last_logits is not None:  # only the last row was computed
            surprise = -torch.log_softmax(self.last_logits, dim=-1)[token_ids.cpu().long()]  # (1,)
        else:
            surprise = token_surprise(logits, token_ids.cpu().long(), self.last_logits)
        self.last_logits = logits[-1]
        self._record(token_ids.cpu(), surprise)
        self._seal()  # in decoding too, so a long reply cannot push positions past the trained length
        return logits

    def _record(self, token_ids: torch.Tensor, surprise: torch.Tensor) -> None:
        n = token_ids.shape[0]
        to_sink = min(n, self.cfg.window.n_sink - self.sink_len)
        self.sink_tokens = torch.cat([self.sink_tokens, token_ids[:to_sink].to(torch.int32)])
        self.tail_tokens = torch.cat([self.tail_tokens, token_ids[to_sink:].to(torch.int32)])
        self.sink_len += to_sink
        if self.events_sealed == 0:
            self.local_start = self.tail_start = self.sink_len
        self.n_tokens += n
        local_part = surprise[to_sink:]
        self.local_surprise = torch.cat([self.local_surprise, local_part])
        if local_part.numel():
            if self.segmenter.position < self.sink_len:  # the first local token opens the first event
                self.segmenter.position = self.segmenter.event_start = self.sink_len
            self.boundaries.extend(b for b in self.segmenter.push(local_part) if b > self.local_start)

    def _seal(self) -> None:
        """Seal whole events that start before the local window's left edge."""
        cutoff = self.n_tokens - self.cfg.window.n_local
        while self.local_start < cutoff and self.boundaries:
            start = self.local_start
            end = self._refined_end(start)
            self._seal_event(start, end)

    def _refined_end(self, start: int) -> int:
        seg, ref = self.cfg.segmentation, self.cfg.refinement
        end = self.boundaries[0]
        if not ref.enabled or seg.mode == "uniform":
            self.boundaries.pop(0)
            return end
        after = self.boundaries[1] if len(self.boundaries) > 1 else self.n_tokens
        keys = self._graph_keys(start, after)  # (after - start, F)
        graph = similarity_graph(keys)
        # Never let the following event grow past max_event when the boundary moves left.
        min_split = max(seg.min_event, (after - start) - seg.max_event)
        refined = start + refine_boundary(graph, end - start, min_split, ref.metric)
        self.boundaries.pop(0)
        return refined

    def _graph_keys(self, start: int, end: int) -> torch.Tensor:  # (T, layers_up * Hkv * D)
        n_up = max(1, round(self.spec.num_layers * self.cfg.refinement.layer_fraction))
        lo, hi = start - self.local_start, end - self.local_start
        per_layer = [st.local_k[:, lo:hi].permute(1, 0, 2).flatten(1) for st in self.layers[-n_up:]]
        return torch.cat(per_layer, dim=1).float()

    def _seal_event(self, start: int, end: int) -> None:
        n = end - start
        keys = torch.stack([st.local_k[:, :n] for st in self.layers])  # (layers, Hkv, n, D)
        values = torch.stack([st.local_v[:, :n] for st in self.layers])  # (layers, Hkv, n, D)
        reps = torch.stack([self._representative(st, n) for st in self.layers])  # (layers, Hkv * D)
        summary = key_summary(keys[self.summary_layers].cpu())  # (S * Hkv * D,)
        surprise = self.local_surprise[:n]
        event = Event(
            id=len(self.memory), start=start, end=end,
            surprise_mean=float(surprise.mean()), surprise_max=float(surprise.max()),
        )
        token_ids = self.tail_tokens[start - self.tail_start : end - self.tail_start]  # (n,)
        self.memory.add(event, keys, values, reps, summary, token_ids)
        self.tail_tokens = self.tail_tokens[end - self.tail_start :]
        self.tail_start = end
        for st in self.layers:
            st.local_k, st.local_v = st.local_k[:, n:], st.local_v[:, n:]
            st.local_attention = st.local_attention[:, n:]
        self.local_surprise = self.local_surprise[n:]
        self.local_start = end
        self.events_sealed += 1

    def _representative(self, st: _LayerState, n: int) -> torch.Tensor:  # (Hkv * D,)
        r = min(n, self.cfg.representatives.keys_per_head)
        top = st.local_attention[:, :n].topk(r, dim=1).indices  # (Hkv, r)
        keys = st.local_k[:, :n].float().cpu()  # (Hkv, n, D)
        chosen = keys.gather(1, top[..., None].expand(-1, -1, keys.shape[-1]))  # (Hkv, r, D)
        return chosen.mean(dim=1).flatten()

    # ------------------------------------------------------------------ queries
    def probe(self, token_ids: torch.Tensor) -> Probe:
        """Run `token_ids` (T,) without changing the stream; returns each layer's recall query and keys."""
        saved = [(st.recalled_ids, st.recalled_kv) for st in self.layers]
        self.step(token_ids, mode="probe")
        queries, keys, recalled = [], [], []
        for st, (ids, kv) in zip(self.layers, saved):
            queries.append(st.probe_query if st.probe_query is not None else self._empty_query())
            assert st.probe_keys is not None
            keys.append(st.probe_keys.float().cpu())
            recalled.append(list(st.recalled_ids))
            st.probe_query, st.probe_keys, st.recalled_ids, st.recalled_kv = None, None, ids, kv
        return Probe(queries, keys, recalled)

    def _empty_query(self) -> torch.Tensor:
        return torch.zeros(self.spec.num_kv_heads * self.spec.head_dim)

    # ------------------------------------------------------------------ persistence
    def snapshot(self) -> dict[str, Any]:
        """Everything but the event memory, as tensors and plain values (what a store checkpoints).

        Resident keys and values stay in the model's dtype, so a restored stream continues exactly.
        """
        return {
            "n_tokens": self.n_tokens, "sink_len": self.sink_len, "local_start": self.local_start,
            "local_surprise": self.local_surprise.clone(), "boundaries": list(self.boundaries),
            "sink_tokens": self.sink_tokens.clone(), "tail_tokens": self.tail_tokens.clone(),
            "tail_start": self.tail_start, "last_logits": self.last_logits, "events_sealed": self.events_sealed,
            "segmenter": {
                "history": list(self.segmenter.history), "event_start": self.segmenter.event_start,
                "position": self.segmenter.position,
            },
            "layers": [
                {
                    # clone(): the resident tensors are views into larger buffers, and saving a view
                    # would write the whole buffer.
                    "sink_k": st.sink_k.cpu().clone(), "sink_v": st.sink_v.cpu().clone(),
                    "local_k": st.local_k.cpu().clone(), "local_v": st.local_v.cpu().clone(),
                    "local_attention": st.local_attention.clone(), "buffer": list(st.buffer),
                }
                for st in self.layers
            ],
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Inverse of `snapshot` (the event memory must already hold the events it had then)."""
        for name in ("n_tokens", "sink_len", "local_start", "local_surprise", "sink_tokens", "tail_tokens",
                     "tail_start", "last_logits", "events_sealed"):
            setattr(self, name, snapshot[name])
        self.boundaries = list(snapshot["boundaries"])
        seg = snapshot["segmenter"]
        self.segmenter.history.clear()
        self.segmenter.history.extend(seg["history"])
        self.segmenter.event_start, self.segmenter.position = seg["event_start"], seg["position"]
        if len(snapshot["layers"]) != len(self.layers):
            raise ValueError("snapshot has another number of layers")
        for st, saved in zip(self.layers, snapshot["layers"]):
            st.sink_k, st.sink_v = saved["sink_k"].to(self.device), saved["sink_v"].to(self.device)
            st.local_k, st.local_v = saved["local_k"].to(self.device), saved["local_v"].to(self.device)
            st.local_attention = saved["local_attention"]
            st.buffer.clear()
            st.buffer.extend(saved["buffer"])
            st.recalled_ids, st.recalled_kv = [], None
