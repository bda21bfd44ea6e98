"""The evaluation harness behind `benchmarks/evaluate.py`: tasks and systems as plugins (registries)."""
