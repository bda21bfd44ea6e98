"""Write the 113k-token test document: Python's language reference with two planted facts.

    python benchmarks/python_reference.py /tmp/demo/python_reference.md

The text is `pydoc_data.topics` (the reference topics that `help()` shows, shipped with CPython:
natural technical English, 467,621 bytes with the facts, 113,594 tokens for the embedded model),
one "## name" section per topic in sorted order. After the section that ends 30% of the way in, a
note names the release manager (Ilse Vandermeer, Ghent); after the one at 70%, the build server
(Kestrel-9, Tartu). Neither fact is anywhere else in the text, nor in the model's weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pydoc_data.topics

FACTS = {
    0.3: "Note from the maintainers: the release manager for this edition of the reference was Ilse Vandermeer, "
         "who signed it off in Ghent.",
    0.7: "Note from the maintainers: the build server that typeset this reference is called Kestrel-9 and lives "
         "in a basement in Tartu.",
}


def document() -> str:
    topics = pydoc_data.topics.topics
    names = sorted(topics)
    planted = {int(fraction * len(names)): fact for fraction, fact in FACTS.items()}  # after that many sections
    parts = []
    for i, name in enumerate(names):
        parts.append(f"## {name}\n\n{topics[name]}")
        if i + 1 in planted:
            parts.append(f"\n{planted[i + 1]}\n")
    return "# The Python language reference, topic by topic\n\n" + "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="where to write the document")
    args = parser.parse_args()
    text = document()
    args.path.write_text(text, encoding="utf-8")
    print(f"{args.path}: {len(text.encode()):,} bytes")


if __name__ == "__main__":
    main()
