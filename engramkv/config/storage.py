"""The knobs of the persistent store (tiers, codecs, index) and of the sharded ingest."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engramkv.config._base import _Strict


class IndexConfig(_Strict):
    """The per-layer FAISS indexes of a persistent store."""

    ivf_min_events: int = Field(default=50_000, ge=16, description="Events per namespace past which the flat index "
                                "is rebuilt as IVF (`ivf_codec`).")
    ivf_lists_per_sqrt: float = Field(default=4.0, gt=0, description="IVF lists = this * sqrt(events) at rebuild.")
    ivf_nprobe: int = Field(default=32, ge=1, description="IVF lists scanned per search.")
    ivf_codec: Literal["sq8", "sq6", "sq4"] = Field(
        default="sq6",
        description="Bits per dimension of IVF entries (fixed at the rebuild) and of low-rank codes. Measured on the "
        "default model's representatives (8k natural-text events; share of the exact top 10 a flat quantised index "
        "keeps): layers sq8 / sq6 / sq4 0.91 / 0.90 / 0.81-0.85, key summaries 0.98 / 0.96 / 0.87.",
    )
    rank: int | None = Field(default=None, ge=1, description="Low-rank entries (`storage.projection`): past "
                             "`project_min_events`, projected on `rank` principal directions, no ids, no IVF.")
    project_min_events: int = Field(default=2048, ge=16, description="Events at which the projections are fitted.")
    rerank: int = Field(default=50, ge=1, description="Candidates a low-rank search scores again exactly.")
    device: Literal["auto", "cpu", "gpu"] = Field(
        default="auto",
        description="Where searches run: 'auto' mirrors the indexes onto GPU 0 when a GPU build of FAISS is "
        "installed and sees a GPU, else CPU; 'gpu' fails if it cannot. The saved indexes are the CPU ones.",
    )


class LowRankConfig(_Strict):
    """The `lowrank` cold-tier codec (`storage.lowrank`): the bases a new store takes; how `fit-bases` fits them."""

    bases: str | None = Field(default=None, description="Bases file (from `engramkv fit-bases`) a new lowrank "
                              "store copies; None: those shipped for the model. A store reads its own copy.")
    heads_per_group: int | None = Field(default=None, ge=1, description="KV heads sharing one basis (None: all).")
    key_error: float = Field(default=0.10, gt=0, lt=1, description="Fit: each layer's keys get the fewest bits "
                             "whose held-out error (relative to the centred keys) is within this (see early_key_error).")
    early_key_error: float | None = Field(default=0.25, gt=0, lt=1, description="Fit: the keys' budget in the first "
                                          "`early_layers` of the layers (None: key_error); their error costs less.")
    early_layers: float = Field(default=0.5, ge=0, le=1, description="Fit: the share of layers, from the first, "
                                "that early_key_error applies to.")
    value_error: float = Field(default=0.50, gt=0, lt=1, description="Fit: the same budget for values (keys need the "
                               "tighter one: their error compounds through reading, benchmarks/README.md).")
    tokens: int = Field(default=32_768, ge=1024, description="Fit: calibration tokens read (a fifth held out).")
    weight_keys: bool = Field(default=False, description="Fit: weigh key dimensions by the queries' energy on "
                              "them, so the error budget is of what attention scores see (measured: no gain).")
    weight_values: bool = Field(default=True, description="Fit: weigh value dimensions by the output "
                                "projection's column norms, so the budget is of what leaves attention.")


class StoreConfig(_Strict):
    """The tiered, persistent event store (used when a session is opened with `store=`)."""

    codec: Literal["fp16", "int8", "int4", "int2", "lowrank"] = Field(
        default="int8",
        description="Cold-tier (disk) encoding of event KV; fixed when the store is created. 'lowrank': keys and "
        "values projected onto fitted per-layer bases, the latent quantised (`store.lowrank`).",
    )
    lowrank: LowRankConfig = LowRankConfig()
    hot_bytes: int = Field(default=256 * 2**20, ge=0, description="Decoded KV kept on the device (LRU by bytes); "
                           "hot_write_through's exact KV is held beside it (at most commit_tokens tokens' KV).")
    hot_write_through: bool = Field(default=True, description="New events' exact KV goes into the hot tier until the "
                                    "next commit (`storage.tiers.HotTier`); off: every read comes through the codec.")
    warm_bytes: int = Field(default=512 * 2**20, ge=0, description="Encoded blobs kept in host RAM (LRU by bytes).")
    prefetch: Literal["auto", "on", "off"] = Field(default="auto", description="Decode the next layer's recalled "
                                                   "blocks in the background; 'auto' turns it on for CUDA devices.")
    read_ahead: bool = Field(default=True, description="Ask the kernel for all of a layer's cold blobs at once before "
                             "reading them (one disk wait, not one per blob, when the store is not in the page cache).")
    segment_bytes: int = Field(default=256 * 2**20, ge=2**16, description="Size at which a segment file is closed.")
    commit_tokens: int = Field(default=16_384, ge=1, description="Ingested tokens between two commits (the most a "
                               "crash can lose).")
    release_free_memory: bool = Field(
        default=True,
        description="After each commit, hand the C heap's free pages back to the OS (glibc malloc_trim; nothing "
        "elsewhere): memory FAISS and torch freed otherwise stays in the process's resident set.",
    )
    index_save_events: int = Field(default=2_000, ge=1, description="Events between index saves (caught up on open).")
    catalog_url: str | None = Field(default=None, description="SQLAlchemy URL of the catalog; None means "
                                    "catalog.sqlite inside the store directory.")
    index: IndexConfig = IndexConfig()


class ShardConfig(_Strict):
    """Sharded ingest (`Session.ingest_file(workers=N)`, `engramkv ingest --workers N`): one document cut at
    paragraphs into N shards, each read by a Ray worker (`engramkv.sharding`), merged in document order."""

    workers: int = Field(default=1, ge=1, description="Shards read at once, one Ray worker each; 1 reads in this "
                         "process, without Ray.")
    ray_address: str | None = Field(default=None, description="Ray cluster to run on ('auto', 'ray://host:10001'); "
                                    "None starts a local one for the ingest. Workers must see the store's path.")
    threads_per_worker: int | None = Field(default=None, ge=1, description="torch threads (and Ray CPUs) per worker; "
                                           "None: this machine's cores / workers.")
    max_retries: int = Field(default=2, ge=0, description="Times a shard whose worker died is read again from its "
                             "start (its partial output discarded).")
    min_shard_bytes: int = Field(default=32 * 1024, ge=1024, description="Fewer shards for a short document: about "
                                 "this many bytes each at least (~8k tokens of English; a shard starts cold).")
