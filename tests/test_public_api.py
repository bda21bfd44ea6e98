import inspect

import engramkv


def test_all_is_sorted_and_complete():
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
