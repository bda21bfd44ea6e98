"""An agent that uses engramkv as two tools, `recall` and `chat`, over an ingested document.

The agent keeps a JSON transcript of tool calls, as an LLM agent framework would: it first calls
`recall` with the user's question to see which parts of the document are relevant, then `chat`
with the question, and checks whether the answer is grounded in what recall returned (it shares a
number or a word of four letters or more with a recalled event that the question does not already
contain); if not, it asks once more with the recalled events quoted, in document order. The tools are plain functions over the library API and return
JSON-serialisable dicts, so they plug into any tool-calling loop.

    python examples/agent_tool.py                      # the embedded model, a generated report
    python examples/agent_tool.py --document notes.txt --question "Who signed the contract?"
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from engramkv import EngineConfig, EpisodicLM, Session

Tool = Callable[..., dict[str, Any]]


def make_tools(session: Session) -> dict[str, Tool]:
    """The two tools an agent gets: each takes JSON-able arguments and returns a JSON-able dict."""

    def recall(query: str, k: int = 3) -> dict[str, Any]:
        return {"events": [event.model_dump(mode="json") for event in session.recall(query, k=k)]}

    def chat(message: str, max_new_tokens: int = 32) -> dict[str, Any]:
        return {"answer": session.chat(message, max_new_tokens=max_new_tokens).strip()}

    return {"recall": recall, "chat": chat}


def _words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"\d+|[A-Za-z]{4,}", text)}


def grounded(answer: str, events: list[dict[str, Any]], question: str = "") -> bool:
    """Does the answer use something recall found, beyond echoing the question?"""
    recalled = set().union(*(_words(e["text"]) for e in events)) if events else set()
    return bool((_words(answer) - _words(question)) & recalled)


def run_agent(tools: dict[str, Tool], question: str) -> list[dict[str, Any]]:
    """Recall, answer, check, and retry once with the best evidence quoted; returns the transcript."""
    transcript: list[dict[str, Any]] = []

    def call(name: str, **arguments: Any) -> dict[str, Any]:
        result = tools[name](**arguments)
        transcript.append({"tool": name, "arguments": arguments, "result": result})
        return result

    events = call("recall", query=question)["events"]
    answer = call("chat", message=question)["answer"]
    if events and not grounded(answer, events, question):
        in_order = sorted(events, key=lambda e: e["token_start"])
        evidence = " ".join("".join(e["text"] for e in in_order).split())[:600]
        call("chat", message=f'The document says: "{evidence}"\n{question}')
    return transcript


def demo_document() -> tuple[str, str, str]:
    """A generated report with one fact in the middle of about 9k tokens of filler."""
    filler = ("The quarterly figures were discussed at length and the committee noted the usual items. "
              "Minutes were approved without changes and the next meeting was scheduled. ") * 110
    fact = "The new warehouse will be built in Tampere, and construction starts in March. "
    return filler + fact + filler, "In which city will the new warehouse be built?", "Tampere"


def main(argv: list[str] | None = None, lm: EpisodicLM | None = None,
         config: EngineConfig | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--document", help="a text file (default: a generated report)")
    parser.add_argument("--question")
    args = parser.parse_args(argv)
    lm = lm or EpisodicLM.from_pretrained()
    session = lm.session(config)
    if args.document:
        session.ingest_file(args.document)
        question = args.question or "What is this document about?"
    else:
        text, question, _ = demo_document()
        session.ingest(text)
        question = args.question or question
    transcript = run_agent(make_tools(session), question)
    print(json.dumps(transcript, indent=2))
    return transcript


if __name__ == "__main__":
    main()
