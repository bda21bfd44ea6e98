"""The streaming episodic engine: one session's attention state, chunk by chunk.

Per layer the state holds the sink tokens and the local window (pre-RoPE K, V, plus
how much attention each local token has received). A forward pass calls `attend` once
per layer; it assembles

    [sinks | recalled events (chronological) | local window | new tokens]

applies RoPE at the positions the scheme assigns, runs one softmax over all of it, and
appends the new tokens to the resident part. After the forward pass the stream
(`sealing.Stream`) scores surprise from the same logits, finds boundaries, refines them on
the key-similarity graph, and seals whole events that have left the local window into the
event memory.

Which events come back is decided per step (`memory_section.MemorySection`): while reading, each
layer recalls by its own queries (`retrieval.recall`); a prompt and its answer are read with a
`RecallPlan` (`retrieval.question`), given to `step`, `decode` and `probe` as an argument.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engramkv import hf
from engramkv.config import EngineConfig
from engramkv.engine.memory_section import MemorySection, buffer_to_host
from engramkv.engine.sealing import LayerState, Stream
from engramkv.engine.window import assemble, resident_columns, window_positions
from engramkv.errors import StoreCorruptError
from engramkv.kernels.window_attention import window_attention
from engramkv.memory.events import EventMemory
from engramkv.memory.surprise import token_surprise
from engramkv.retrieval.question import RecallPlan
from engramkv.spec import ModelSpec


@dataclass
class Probe:
    """What the model computed for probed tokens, per layer, without the stream changing."""

    queries: list[torch.Tensor]  # (Hkv * D,) each: the recall query of the step
    keys: list[torch.Tensor]  # (Hkv, C, D) each: the probed tokens' pre-RoPE keys
    recalled: list[list[int]]  # the events each layer's query recall chose for the probed tokens
    last_logits: torch.Tensor  # (V,) what the probed tokens predict next


@dataclass
class _Pass:
    """One forward pass, as the attention hook sees it (`hf.AttentionState`)."""

    state: EpisodicState
    plan: RecallPlan | None  # None: reading, each layer recalls by its own queries with the reading budget
    refresh: bool  # recall anew (False on the decode steps between two recalls: reuse the last selection)
    probe: bool  # read without changing the stream; keep each layer's query and keys
    queries: list[torch.Tensor | None]
    keys: list[torch.Tensor | None]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        return self.state.attend(layer, query, key, value, scaling, self)


class EpisodicState:
    """The resident window of every layer, the unsealed stream, and the forward passes over them."""

    def __init__(self, model: PreTrainedModel, rope: hf.Rope, spec: ModelSpec, cfg: EngineConfig,
                 memory: EventMemory, summary_layers: list[int]):
        self.model, self.rope, self.spec, self.cfg, self.memory = model, rope, spec, cfg, memory
        self.dtype, self.device = model.dtype, model.device
        self.summary_layers = summary_layers
        self.section = MemorySection(memory, cfg, spec, self.device, self.dtype)
        empty = torch.empty(spec.num_kv_heads, 0, spec.head_dim, dtype=self.dtype, device=self.device)
        self.layers = [
            LayerState(empty, empty, empty, empty, torch.empty(spec.num_kv_heads, 0, device=self.device),
                       buffer=deque(maxlen=cfg.recall.contiguity_buffer))
            for _ in range(spec.num_layers)
        ]
        self.stream = Stream(cfg, summary_layers)
        self.last_logits: torch.Tensor | None = None  # (V,) predicts the next token
        self.decode_steps = 0  # decode steps since the last prompt: recall refreshes every decode_interval
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (P, D)

    @property
    def n_tokens(self) -> int:
        return self.stream.n_tokens

    # ------------------------------------------------------------------ attention hook
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               forward: _Pass) -> torch.Tensor:  # (1, C, H, D)
        st = self.layers[layer]
        q, k, v = query[0], key[0], value[0]  # (H, C, D), (Hkv, C, D), (Hkv, C, D)
        n_new = q.shape[1]
        mem_k, mem_v, used, query = self.section.recall(layer, st, q, forward.plan, forward.refresh, forward.probe)
        # (Hkv, M, D) each; used: None, or how many of the M slots hold events (`MemorySection.recall`)
        if forward.probe and query is not None:
            forward.queries[layer] = query
        # A plan may skip the oldest `skip` local tokens (its window_from) and a gap after them (its
        # window_gap). Memory goes before the local window, or (a plan with memory_at) between the local
        # text read before the prompt and the prompt: `split` of the attended local tokens precede it.
        plan = forward.plan
        skip = split = 0
        n_local = st.local_k.shape[1]
        start = self.stream.local_start
        if plan is not None and plan.window_from is not None:
            skip = min(max(plan.window_from - start, 0), n_local)
        kept: torch.Tensor | None = None  # (L,) the attended local tokens, where a gap is skipped
        if plan is not None and plan.window_gap is not None:
            gap_from = min(max(plan.window_gap[0] - start, skip), n_local)
            gap_to = min(max(plan.window_gap[1] - start, gap_from), n_local)
            if gap_to > gap_from:
                kept = torch.cat([torch.arange(skip, gap_from), torch.arange(gap_to, n_local)]).to(self.device)
        if plan is not None and plan.memory_at is not None:
            at = min(max(plan.memory_at - start, 0), n_local)
            split = int((kept < at).sum()) if kept is not None else at - skip
        split = max(split, 0)
        if kept is None:
            local_k, local_v = st.local_k[:, skip:], st.local_v[:, skip:]  # (Hkv, L, D) each
        else:
            local_k, local_v = st.local_k[:, kept], st.local_v[:, kept]
        n_sink, n_mem, n_local = st.sink_k.shape[1], mem_k.shape[1], local_k.shape[1]
        keys = assemble(st.sink_k, local_k, mem_k, k, split)  # (Hkv, N, D)
        values = assemble(st.sink_v, local_v, mem_v, v, split)  # (Hkv, N, D)

        cos, sin = self._cos_sin(n_sink, n_mem, n_local, n_new, q, used)  # (N, D) each
        # the queries whose attention each resident key received is counted (what picks representatives)
        n_probe = 0 if forward.probe else min(n_new, self.cfg.representatives.stat_queries)
        padding = None if used is None else (n_sink + split, n_mem, used)
        out, mass = window_attention(q, keys, values, cos, sin, scaling, n_probe, self.cfg.model.kernels, padding)
        # out (H, C, D); mass (Hkv, N) or None

        if forward.probe:
            forward.keys[layer] = k
        else:
            assert mass is not None
            # on the compute device: no host synchronisation per layer and chunk (issue 19)
            received = resident_columns(mass, n_sink, split, n_mem)  # (Hkv, L + C)
            if kept is not None:  # the skipped tokens received nothing from these queries
                full = received.new_zeros(received.shape[0], st.local_k.shape[1] + received.shape[1] - n_local)
                full[:, kept] = received[:, :n_local]
                full[:, st.local_k.shape[1]:] = received[:, n_local:]
                received = full
            elif skip:
                received = torch.cat([received.new_zeros(received.shape[0], skip), received], dim=1)
            self._append(st, k, v, received)
        return out[None].transpose(1, 2)

    def _cos_sin(self, n_sink: int, n_mem: int, n_local: int, n_new: int, like: torch.Tensor,
                 used: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # (N, D) each
        """RoPE's cos and sin at each window key's position (`window_positions`); with `used`, of the memory's
        n_mem slots the first `used` hold events and the residents follow them."""
        scheme = self.cfg.recall.positions
        n_window = n_sink + n_mem + n_local + n_new
        if used is not None:  # computed where `used` is: the positions cannot be known on the host
            cols = torch.arange(n_window, device=self.device)
            positions = (cols - (cols >= n_sink + n_mem) * (n_mem - used) if scheme == "contiguous" else torch.where(
                cols < n_sink + n_mem, cols.clamp(max=n_sink), cols - n_mem + (used > 0).long()))
        else:
            positions = None if scheme == "contiguous" or n_mem == 0 else window_positions(
                n_sink, n_mem, n_local, n_new, scheme)  # (N,); None: 0..N-1
        needed = n_window if positions is None or used is not None else int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < needed:
            self._rope_table = self.rope.table(max(needed, self.cfg.attention_span()), like)
        cos, sin = self._rope_table
        if positions is None:  # a view of the table, no gather
            return cos[:n_window], sin[:n_window]
        index = positions.to(self.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def _append(self, st: LayerState, k: torch.Tensor, v: torch.Tensor, received: torch.Tensor) -> None:
        to_sink = min(k.shape[1], self.cfg.window.n_sink - st.sink_k.shape[1])
        if to_sink > 0:
            st.sink_k = torch.cat([st.sink_k, k[:, :to_sink]], dim=1)
            st.sink_v = torch.cat([st.sink_v, v[:, :to_sink]], dim=1)
        n_local_old = st.local_k.shape[1]
        st.local_k = torch.cat([st.local_k, k[:, to_sink:]], dim=1)
        st.local_v = torch.cat([st.local_v, v[:, to_sink:]], dim=1)
        # `received` covers [local (old) | new]; the sink part of the new tokens is dropped.
        if to_sink:
            received = torch.cat([received[:, :n_local_old], received[:, n_local_old + to_sink :]], dim=1)
        st.local_attention = F.pad(st.local_attention, (0, k.shape[1] - to_sink)) + received  # (Hkv, L + C')

    # ------------------------------------------------------------------ stream processing
    @torch.inference_mode()
    def step(self, token_ids: torch.Tensor, plan: RecallPlan | None = None, seal: bool = True) -> torch.Tensor:
        """Read `token_ids` (T,) into the stream; returns the logits (T, V), on the model's device.

        plan: how a prompt reads memory (`retrieval.question`); None while reading a document. seal: False
        reads a draft (`Reader.reading`): nothing leaves the local window.
        """
        self.decode_steps = 0
        forward = self._pass(plan, refresh=True, probe=False)
        ids = token_ids.to(self.device)  # one copy to the device, for the forward and the surprise
        logits = hf.forward(self.model, ids[None], forward)
        # scored where the logits are: only (T,) surprises and the last row cross to the host, not (T, V)
        previous = None if self.last_logits is None else self.last_logits.to(self.device)
        surprise = token_surprise(logits, ids.long(), previous).cpu()  # (T,)
        self._advance(token_ids, logits, surprise, seal)
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int, plan: RecallPlan, seal: bool = True) -> torch.Tensor:
        """Read one generated token; returns the logits (1, V) that predict the next one.

        The prompt's recall stands for the first tokens; it is refreshed every `decode_interval` after that.
        """
        refresh = self.decode_steps > 0 and self.decode_steps % self.cfg.recall.decode_interval == 0
        self.decode_steps += 1
        token_ids = torch.tensor([token_id])
        forward = self._pass(plan, refresh=refresh, probe=False)
        logits = hf.forward(self.model, token_ids[None].to(self.device), forward, logits_to_keep=1).cpu()
        if self.last_logits is not None:  # only the last row was computed: the surprise comes from the one before
            surprise = -torch.log_softmax(self.last_logits, dim=-1)[token_ids]  # (1,)
        else:
            surprise = token_surprise(logits, token_ids, None)
        self._advance(token_ids, logits, surprise, seal)
        return logits

    def _advance(self, token_ids: torch.Tensor, logits: torch.Tensor, surprise: torch.Tensor, seal: bool) -> None:
        # A copy: a view would keep the chunk's whole (C, V) logits alive, and a checkpoint saving it would
        # write them all (71 MB of a 124 MB checkpoint, measured).
        self.last_logits = logits[-1].to("cpu", copy=True)
        self.stream.record(token_ids.cpu(), surprise)
        # In decoding too, so a long reply cannot push positions past the trained length (a draft, which seals
        # nothing, is kept short enough by its caller: `Session`'s list room).
        if seal:
            self.stream.seal(self.layers, self.memory)

    def _pass(self, plan: RecallPlan | None, refresh: bool, probe: bool) -> _Pass:
        n = len(self.layers)
        return _Pass(self, plan, refresh, probe, [None] * n, [None] * n)

    @torch.inference_mode()
    def probe(self, token_ids: torch.Tensor, plan: RecallPlan | None = None) -> Probe:
        """Run `token_ids` (T,) without changing the stream; returns each layer's recall query and keys."""
        saved = [(st.recalled_ids, st.recalled_tokens, st.recalled_kv) for st in self.layers]
        forward = self._pass(plan, refresh=True, probe=True)
        logits = hf.forward(self.model, token_ids[None].to(self.device), forward, logits_to_keep=1).cpu()
        recalled = [list(st.recalled_ids) for st in self.layers]
        for st, (ids, parts, kv) in zip(self.layers, saved):
            st.recalled_ids, st.recalled_tokens, st.recalled_kv = ids, parts, kv
        empty = torch.zeros(self.spec.num_kv_heads * self.spec.head_dim)
        queries = [query if query is not None else empty for query in forward.queries]
        keys = [key.float().cpu() for key in forward.keys if key is not None]
        return Probe(queries, keys, recalled, logits[-1])

    def resident_keys(self, layers: list[int]) -> list[torch.Tensor]:
        """The resident window's keys (sinks, then local tokens) of each of `layers`: (Hkv, R, D) each."""
        return [torch.cat([self.layers[i].sink_k, self.layers[i].local_k], dim=1) for i in layers]

    # ------------------------------------------------------------------ persistence
    def snapshot(self, host: bool = True) -> dict[str, Any]:
        """Everything but the event memory, as tensors and plain values (what a store checkpoints).

        Resident keys and values stay in the model's dtype, so a restored stream continues exactly. `host`: copied
        to host RAM (a checkpoint); else copied where they are (a draft's undo: on a GPU, no round trip).
        """
        where = torch.device("cpu") if host else self.device
        for st in self.layers:
            buffer_to_host(st)
        return {
            **self.stream.snapshot(), "last_logits": self.last_logits,
            # Derived, written for the engramkv versions that held them as counters (they read them back).
            "sink_len": self.stream.sink_len, "tail_start": self.stream.local_start, "events_sealed": len(self.memory),
            "layers": [
                {
                    # copies: the resident tensors are views into larger buffers, and saving a view
                    # would write the whole buffer.
                    "sink_k": st.sink_k.to(where, copy=True), "sink_v": st.sink_v.to(where, copy=True),
                    "local_k": st.local_k.to(where, copy=True), "local_v": st.local_v.to(where, copy=True),
                    "local_attention": st.local_attention.to(where, copy=True), "buffer": list(st.buffer),
                }
                for st in self.layers
            ],
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Inverse of `snapshot` (the event memory must already hold the events it had then)."""
        if len(snapshot["layers"]) != len(self.layers):
            raise StoreCorruptError(f"the checkpoint holds {len(snapshot['layers'])} layers, the model "
                                    f"{len(self.layers)}")
        self.stream.restore(snapshot)
        self.last_logits = snapshot["last_logits"]
        if self.stream.n_tokens != snapshot["n_tokens"]:
            raise StoreCorruptError(f"the checkpoint's stream holds {self.stream.n_tokens} tokens but records "
                                    f"{snapshot['n_tokens']}")
        for st, saved in zip(self.layers, snapshot["layers"]):
            st.sink_k, st.sink_v = saved["sink_k"].to(self.device), saved["sink_v"].to(self.device)
            st.local_k, st.local_v = saved["local_k"].to(self.device), saved["local_v"].to(self.device)
            st.local_attention = saved["local_attention"].to(self.device)
            st.buffer.clear()
            st.buffer.extend(saved["buffer"])
            st.device_buffer = None
        self.forget_recalled()

    def seal_rest(self) -> None:
        """Seal the tokens still in the local window into events (`Stream.seal_rest`)."""
        self.stream.seal_rest(self.layers, self.memory)

    def forget_recalled(self) -> None:
        """Drop each layer's last recalled KV, so the next step gathers it again: what a stream restored from
        a checkpoint starts with, and what a commit must leave behind too (the store's hot tier may have
        handed out exact KV that a restored stream would get decoded)."""
        for st in self.layers:
            st.recalled_ids, st.recalled_tokens, st.recalled_kv = [], None, None


def shifted_snapshot(snapshot: dict[str, Any], tokens: int, events: int) -> dict[str, Any]:
    """`snapshot` (from `EpisodicState.snapshot`) of a stream read after its first tokens were sinks alone, moved
    to where its text lies in a longer stream: every position after the sinks by `tokens`, every event id by
    `events`. A sharded ingest (`engramkv.sharding`) continues the whole document from its last shard this way."""
    moved = dict(snapshot)
    moved["n_tokens"] = snapshot["n_tokens"] + tokens
    moved["local_start"] = moved["tail_start"] = snapshot["local_start"] + tokens
    moved["boundaries"] = [b + tokens for b in snapshot["boundaries"]]
    moved["events_sealed"] = snapshot["events_sealed"] + events
    segmenter = snapshot["segmenter"]
    moved["segmenter"] = {**segmenter, "event_start": segmenter["event_start"] + tokens,
                          "position": segmenter["position"] + tokens}
    moved["layers"] = [{**layer, "buffer": [e + events for e in layer["buffer"]]} for layer in snapshot["layers"]]
    return moved
