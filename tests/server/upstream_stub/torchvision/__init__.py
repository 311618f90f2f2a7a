"""A stand-in for torchvision (see tests/server/test_upstream_sglang.py): upstream SGLang's bench_serving imports
InternVL's image helpers at module level; its text datasets never call them."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    from torchvision._missing import Missing

    return Missing(name)
