"""Every error kvxfer raises is a KvxferError, so callers catch one family."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kvxfer
from kvxfer.errors import KvxferError


def all_kvxfer_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(kvxfer.__path__, "kvxfer."):
        if info.name.endswith("_native"):
            continue
        names.append(info.name)
    return names


def test_every_exception_class_in_the_package_derives_from_kvxfer_error() -> None:
    strays = []
    for name in all_kvxfer_modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name
                    and not issubclass(obj, KvxferError) and not obj.__name__.startswith("_")):
                strays.append(f"{name}.{obj.__name__}")
    assert not strays, f"exception classes outside the KvxferError family: {strays}"
