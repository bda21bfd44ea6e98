"""Move an evaluation's runs under another system name, when what a name means changes.

When a candidate's coefficients ship, its runs (`engram-alloc-no-idoc`) are the shipped model's
(`engram-alloc`), and the old model's runs under that name are superseded. This moves the candidate's runs
of some tasks from other result files into one, renamed (each run keeps its old name in `relabelled_from`),
after dropping the superseded runs of the new names there; the `-chat` twin of every name goes with it.
The command is added to the file's `commands` and a note to its `relabelled` list, and the file's table is
written again (`evaluate.save`). The runs stay in the files they came from unless `--remove-moved`.
`--lengths` limits the move and the drop to some lengths; `NAME=NAME` moves runs without renaming them (cells
measured again under the answer path of now, in a file of their own, replacing the old cells' runs).

    python benchmarks/relabel.py --into allocation_a --source allocation_c allocation_d \\
        --tasks passkey niah-single --rename engram-alloc-no-idoc=engram-alloc --drop engram-alloc \\
        --because "the no-i_doc candidate's coefficients shipped"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evaluate import OUT, previous_runs, save


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--into", required=True, help="the result file (results/evaluate/NAME.json) to move runs into")
    parser.add_argument("--source", nargs="+", default=[], help="result files to take the renamed runs from")
    parser.add_argument("--tasks", nargs="+", required=True, help="the tasks whose runs move")
    parser.add_argument("--rename", nargs="+", default=[], metavar="OLD=NEW", help="system names (and their -chat)")
    parser.add_argument("--drop", nargs="+", default=[], metavar="SYSTEM",
                        help="systems (and their -chat) whose runs of those tasks in --into are superseded")
    parser.add_argument("--lengths", nargs="+", type=int, help="only runs of these lengths move or drop (default: all)")
    parser.add_argument("--because", required=True, help="why, for the file's note")
    parser.add_argument("--remove-moved", action="store_true", help="delete the moved runs from the sources")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    renames = dict(_pair(text) for text in args.rename)
    renames |= {f"{old}-chat": f"{new}-chat" for old, new in renames.items() if not old.endswith("-chat")}
    dropped = {*args.drop, *(f"{s}-chat" for s in args.drop if not s.endswith("-chat"))}  # a -chat name is a twin
    tasks = set(args.tasks)

    def chosen(run: dict) -> bool:
        return run["task"] in tasks and (args.lengths is None or run["length"] in args.lengths)

    into = args.out / f"{args.into}.json"
    if not into.exists():
        raise SystemExit(f"{into} does not exist (--into names a results file without .json)")
    model_id = json.loads(into.read_text()).get("model")  # what every source must hold runs of
    runs, commands, notes = previous_runs(into, model_id, must_exist=True)
    kept = [r for r in runs if not (chosen(r) and r["system"] in dropped)]
    incoming: dict[tuple, dict] = {}  # a run in two sources (a cell run again elsewhere): the later source's
    remaining: dict[Path, list[dict]] = {}  # a source's runs that stay in it
    for name in args.source:
        path = args.out / f"{name}.json"
        source, source_commands, _ = previous_runs(path, model_id, must_exist=True)
        stays = []
        for run in source:
            if chosen(run) and run["system"] in renames:
                renamed = {"relabelled_from": run["system"]} if renames[run["system"]] != run["system"] else {}
                new = {**run, "system": renames[run["system"]], **renamed, "relabelled_source": name}
                incoming[new["task"], new["system"], new["length"], new["seed"]] = new
            else:
                stays.append(run)
        commands += [f"{c} (runs relabelled from {name})" for c in source_commands if any(
            old in c.split() for old in renames)]
        remaining[path] = stays
    if any((r["task"], r["system"], r["length"], r["seed"]) in incoming for r in kept):
        raise SystemExit("a renamed run would stand beside a run of the same name, task, length and seed: --drop it")
    moved = len(incoming)
    kept += incoming.values()
    if args.remove_moved:  # only once the move is known to be possible
        for path, stays in remaining.items():
            path.write_text(json.dumps({**json.loads(path.read_text()), "runs": stays}, indent=2) + "\n")
    command = " ".join(["python benchmarks/relabel.py", *(argv if argv is not None else sys.argv[1:])])
    commands.append(command)
    at = f" at {', '.join(map(str, args.lengths))} tokens" if args.lengths else ""
    notes["relabelled"] = [*notes.get("relabelled", []), f"{moved} runs of {', '.join(sorted(tasks))}{at} "
                           f"from {', '.join(args.source)}: " + ", ".join(f"{a} -> {b}" for a, b in renames.items())
                           + (f"; runs of {', '.join(sorted(dropped))} dropped" if dropped else "")
                           + f" ({args.because})"]
    save(argparse.Namespace(name=args.into, out=args.out, notes=notes), model_id, kept, commands, plot=True)
    print(f"{moved} runs moved into {args.into}; {len(runs) - len(kept) + moved} dropped")


def _pair(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old or not new:
        raise SystemExit(f"--rename takes OLD=NEW, not {text!r}")
    return old, new


if __name__ == "__main__":
    main()
