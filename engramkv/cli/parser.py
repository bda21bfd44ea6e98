"""The `engramkv` command's arguments: every sub-command, option and help text (the commands are in `cli`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from engramkv import GenerationConfig

DEFAULT_STORE = "~/.engramkv/store"


def _count(least: int, most: int | None = None) -> Callable[[str], int]:
    """An integer option's type: out of [least, most] it is refused at parse time, before a model loads."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least or (most is not None and value > most):
            bounds = f"at least {least}" if most is None else f"from {least} to {most}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def _common(parser: argparse.ArgumentParser, json_flag: bool = True) -> None:
    parser.add_argument("--store", default=DEFAULT_STORE, help=f"store directory (default {DEFAULT_STORE})")
    parser.add_argument("--user", default="default", help="namespace: user_id (default 'default')")
    parser.add_argument("--agent", default="default", help="namespace: agent_id (default 'default')")
    parser.add_argument("--session", default="default", help="namespace: session_id (default 'default')")
    parser.add_argument("--model", default=None,
                        help="hub id or local path of a Llama/Qwen2/Mistral model (default: the embedded one)")
    if json_flag:
        parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def parser_for(commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> argparse.ArgumentParser:
    """The `engramkv` parser; each sub-command's `run` default is its function in `commands`."""
    parser = argparse.ArgumentParser(prog="engramkv", description="Episodic memory inside a language model's "
                                     "attention: ingest long documents, then ask, recall and chat over them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ingest", help="stream text files into a store (resumable, Ctrl-C safe)",
                       description="Stream UTF-8 text or Markdown files into a store. Binary or undecodable "
                       "files are refused before anything is written. Ctrl-C commits and stops; running the "
                       "same command again resumes where it stopped.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="text files to ingest, in order")
    p.add_argument("--codec", choices=["fp16", "int8", "int4", "int2", "lowrank"], default=None,
                   help="cold-tier codec of a new store, fixed at its creation: 'lowrank' is about a sixth of "
                   "int8 on disk (default: the config's store.codec, int8); an existing store keeps its own, "
                   "and naming another one is an error")
    p.add_argument("--config", default=None, metavar="FILE",
                   help='JSON of the EngineConfig fields to change, e.g. {"store": {"index": {"rank": 24}}}')
    p.add_argument("--workers", type=_count(1), default=None, metavar="N",
                   help="read each file in N shards at once on Ray workers, merged in document order (a new, empty "
                   "namespace; needs `pip install 'engramkv[ray]'`; default: the config's shards.workers, 1)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --workers: the Ray cluster to run on ('auto', 'ray://head:10001'); default: a local "
                   "Ray for this ingest. Every worker must see the store's directory")
    _common(p)
    p.set_defaults(run=commands["ingest"])

    p = sub.add_parser("ask", help="ask a question over the stored stream (one chat turn, store unchanged)",
                       description="One chat turn over everything stored in the namespace. The store is opened "
                       "read-only: the question and answer are not kept.")
    p.add_argument("question")
    p.add_argument("--max-new-tokens", type=_count(1), default=None,
                   help=f"longest answer in tokens (default: the config's, {GenerationConfig().max_new_tokens})")
    p.add_argument("--budget-tokens", type=_count(0), default=None,
                   help="the most context the answer reads: resident window + question + recalled tokens "
                   "(default: recall.answer_context_tokens, unset)")
    p.add_argument("--show-recall", action="store_true",
                   help="also print the inference parameters and the events the answer attended to, best match first")
    p.add_argument("--allocation", choices=["fixed", "model", "auto"], default=None,
                   help="how the recall budget is chosen: the fixed default, the fitted allocation model, or "
                   "'auto' (the model where coefficients ship for it) (default: the config's allocation.mode)")
    p.add_argument("--coefficients", default=None,
                   help="allocation coefficients file (`engramkv calibrate --out`; default: the ones shipped for the model)")
    p.add_argument("-k", type=_count(1), default=3, help="events shown with --show-recall or --json (default 3)")
    _common(p)
    p.set_defaults(run=commands["ask"])

    p = sub.add_parser("recall", help="the stored events that best match a query",
                       description="Match QUERY against every stored event the way a question is matched "
                       "(its tokens' keys against each event's key summary, then a token-level re-ranking) and "
                       "print the best K with their text and score.")
    p.add_argument("query")
    p.add_argument("-k", type=_count(1), default=5, help="number of events (default 5)")
    _common(p)
    p.set_defaults(run=commands["recall"])

    p = sub.add_parser("calibrate", help="fit the recall budget model on calibration tasks and write its coefficients",
                       description="Ingest each calibration document once into a store under --work-dir, answer "
                       "its question as a chat turn under a design of inference parameters (events, tokens per "
                       "event, recall rounds, demonstrations, window), fit the allocation model, and write its "
                       "coefficients with R^2 and MSE on held-out samples (JSON; pass it as "
                       "allocation.coefficients). Interrupted, it resumes from the observations it wrote.")
    p.add_argument("--out", default="allocation.json", help="coefficients file to write (default allocation.json)")
    p.add_argument("--work-dir", default="calibration-work",
                   help="stores and observations.jsonl of the run (default ./calibration-work)")
    p.add_argument("--tasks", nargs="+", default=None, help="calibration tasks (default: the config's)")
    p.add_argument("--lengths", nargs="+", type=_count(1), default=None, help="document lengths in tokens")
    p.add_argument("--samples", type=_count(1), default=None, help="samples per task and length")
    p.add_argument("--design-size", type=_count(1), default=None, help="thetas every sample is answered under")
    p.add_argument("--fit-only", action="store_true", help="fit the observations already written; run nothing")
    p.add_argument("--refeature", action="store_true",
                   help="answer nothing: measure again the features of observations written before a feature "
                   "was added (each document ingested again), then fit")
    p.add_argument("--model-id", default=None, help="with --fit-only: the id the coefficients are written for "
                   "(default: --model's)")
    p.add_argument("--model", default=None, help="hub id or local path of the model to calibrate (default: "
                   "embedded); with --fit-only only its tokenizer is loaded")
    p.add_argument("--config", default=None, metavar="FILE",
                   help='JSON of the EngineConfig fields to change, e.g. {"recall": {"answer_reading": "centred"}}; '
                   "the options above override its calibration fields")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.set_defaults(run=commands["calibrate"])

    p = sub.add_parser("fit-bases", help="fit the lowrank codec's bases on the model's own keys and values",
                       description="Read calibration text with the model (default: docstrings of Python's "
                       "standard library, offline), fit per-layer key and value bases by SVD, give each "
                       "layer the fewest bits per token within the error budgets on held-out tokens, and write the bases file a "
                       "store with store.codec 'lowrank' copies (store.lowrank.bases).")
    p.add_argument("--out", required=True, help="bases file to write (.safetensors)")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE", help="UTF-8 files to fit on instead")
    p.add_argument("--tokens", type=_count(1), default=None, help="calibration tokens to read (default: the config's)")
    p.add_argument("--key-error", type=float, default=None, help="held-out relative error budget of keys")
    p.add_argument("--early-key-error", type=float, default=None,
                   help="the keys' budget in the first --early-layers share of the layers (default: the config's)")
    p.add_argument("--early-layers", type=float, default=None, help="share of layers, from the first, that "
                   "--early-key-error applies to (default: the config's, 0.5)")
    p.add_argument("--value-error", type=float, default=None, help="held-out relative error budget of values")
    p.add_argument("--heads-per-group", type=_count(1), default=None, help="KV heads sharing a basis (default: all)")
    p.add_argument("--weight-keys", action=argparse.BooleanOptionalAction, default=None,
                   help="weigh key dimensions by the queries' energy on them (default: the config's, off)")
    p.add_argument("--weight-values", action=argparse.BooleanOptionalAction, default=None,
                   help="weigh value dimensions by the output projection's column norms (default: the config's, on)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--model", default=None, help="hub id or local path of the model (default: embedded)")
    p.add_argument("--config", default=None, metavar="FILE", help="JSON of the EngineConfig fields to change")
    p.add_argument("--json", action="store_true", help="print the ranks and errors as JSON on stdout")
    p.set_defaults(run=commands["fit-bases"])

    p = sub.add_parser("stats", help="tokens, events, tiers and disk use of a namespace",
                       description="Tokens, events, documents, memory tiers and disk use of one namespace.")
    _common(p)
    p.set_defaults(run=commands["stats"])

    p = sub.add_parser("sessions", help="list or delete the namespaces of a store",
                       description="'list' shows every namespace (user/agent/session) of the store; 'delete' "
                       "removes one with its events, index entries and blobs.")
    p.add_argument("action", choices=["list", "delete"])
    p.add_argument("--yes", action="store_true", help="delete without asking")
    _common(p)
    p.set_defaults(run=commands["sessions"])

    p = sub.add_parser("chat", help="open the terminal chat app over a store",
                       description="A Textual chat over one namespace of a store: streamed answers, a memory "
                       "panel, the events recalled for each answer, a surprise plot, /ingest PATH with a "
                       "progress bar, /session NAME to switch. Conversation turns are kept as memory.")
    _common(p, json_flag=False)
    p.set_defaults(run=commands["chat"], json=False)

    p = sub.add_parser("serve", help="an HTTP API over a store, the model loaded once",
                       description="Serve every namespace of one store over HTTP (ingest with progress, streamed "
                       "chat, recall, stats, namespaces; the OpenAPI schema at /openapi.json, interactive docs at "
                       "/docs). Bound to localhost by default; any other address needs an API token.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_count(0, 65535), default=8000, help="port (default 8000)")
    p.add_argument("--token", default=None, help="API token every request must send as 'Authorization: Bearer "
                   "TOKEN' (default: $ENGRAMKV_API_TOKEN; required off localhost)")
    p.add_argument("--files-root", default=None, metavar="DIR", help="the directory whose files an ingest request "
                   "may name by path (default: none; requests send text)")
    p.add_argument("--max-open", type=_count(1), default=8, metavar="N",
                   help="namespaces held open at once (default 8; each keeps its window and its hot and warm tiers "
                   "in RAM): a request to another closes the one used least recently, committed, and its next "
                   "request reopens it")
    p.add_argument("--store", default=DEFAULT_STORE, help=f"store directory (default {DEFAULT_STORE})")
    p.add_argument("--model", default=None,
                   help="hub id or local path of a Llama/Qwen2/Mistral model (default: the embedded one)")
    p.set_defaults(run=commands["serve"], json=False)
    return parser
