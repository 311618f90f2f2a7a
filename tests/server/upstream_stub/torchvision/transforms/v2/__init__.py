from torchvision.transforms import InterpolationMode  # noqa: F401


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    from torchvision._missing import Missing

    return Missing(name)
