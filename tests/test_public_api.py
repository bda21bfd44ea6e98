import inspect

import engramkv

EXPORTED = {
    # the model, its sessions and stores
    "EpisodicLM", "Session", "EventStore", "NamespaceMemory", "NamespaceInfo",
    # what calls return or take
    "IngestReport", "IngestProgress", "RecalledEvent", "SessionStats", "RecallPlan", "ModelSpec",
    "Event", "EventMemory", "PersistentMemory", "TransientMemory", "InMemoryEventMemory", "DocumentProgress",
    "TierBytes", "Theta", "Answer", "calibrate", "CalibrationReport", "FitReport", "fit_lowrank_bases",
    # the config tree
    "EngineConfig", "AllocationConfig", "CalibrationConfig", "ModelConfig", "WindowConfig", "SegmentationConfig", "RefinementConfig", "RepresentativeConfig",
    "RecallConfig", "GenerationConfig", "StoreConfig", "IndexConfig", "LowRankConfig", "ShardConfig",
    # the exception tree
    "EngramError", "ConfigError", "ModelLoadError", "InputError", "EmptyInputError", "SessionError", "StoreError",
    "StoreLockedError", "StoreMismatchError", "StoreCorruptError", "StoreFullError", "ReadOnlyError", "NamespaceError",
    "WorkerError",
}


def test_all_is_exactly_the_public_surface():
    assert set(engramkv.__all__) == EXPORTED
    assert engramkv.__all__ == sorted(engramkv.__all__)
    for name in engramkv.__all__:
        assert hasattr(engramkv, name), name


def test_every_public_name_has_a_docstring():
    for name in engramkv.__all__:
        obj = getattr(engramkv, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_one_exception_tree():
    for name in engramkv.__all__:
        obj = getattr(engramkv, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, engramkv.EngramError), name


def test_every_class_in_a_public_signature_is_exported():
    """What a public method returns or takes (of engramkv's own classes) can be named from the package."""
    public = [engramkv.EpisodicLM, engramkv.Session, engramkv.EventStore]
    for cls in public:
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            hints = inspect.get_annotations(member, eval_str=True)
            for hint in hints.values():
                for part in _classes(hint):
                    if part.__module__.startswith("engramkv"):
                        assert part.__name__ in EXPORTED, f"{cls.__name__}.{name} uses {part.__name__}"


def _classes(hint):
    import typing

    args = typing.get_args(hint)
    if args:
        for arg in args:
            yield from _classes(arg)
    elif inspect.isclass(hint):
        yield hint
