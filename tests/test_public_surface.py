"""`import sgjax as sgl`: every public name loads lazily, and the TYPE_CHECKING block names exactly the same ones (so
editors resolve what programs use)."""

import ast
import os

import sgjax


def test_lazy_names_load_and_match_the_type_checking_imports():
    tree = ast.parse(open(os.path.join(os.path.dirname(sgjax.__file__), "__init__.py")).read())
    typed = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for imp in node.body
        for alias in imp.names
    }
    assert typed == set(sgjax._LAZY)
    for name in sgjax.__all__:
        obj = getattr(sgjax, name)
        assert getattr(obj, "__name__", name) == name or name == "global_config"
