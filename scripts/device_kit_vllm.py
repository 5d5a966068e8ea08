"""Adds to the device kit what `scripts/device_check_vllm.py` needs of vLLM, for a GPU
machine whose Python has torch but neither vLLM nor a way to fetch it.

The check takes vLLM's own KV layout and view code as its oracle (`vllm.v1.kv_cache_layout`,
`vllm.v1.kv_cache_interface` and what they import), so those modules are copied, as they
are, from the vLLM installed here. They are pure Python and import no compiled vLLM op.

One module is not copied: `vllm.distributed.kv_transfer.kv_connector.v1.base`, from which
the connector's metadata takes its two base classes. The real module imports vLLM's whole
runtime (attention backends, model executor, distributed state), which needs vLLM's
compiled ops built for this machine's torch; the kit writes instead a module holding only
those two classes, as vLLM declares them, under empty package files. Nothing the check
compares passes through them.

Third-party packages the copied modules and kvxfer import, and the GPU machine's image
lacks, are installed as CPython 3.12 wheels beside them (pip, from the package registries
this machine reaches).

    python scripts/device_kit_vllm.py [--kit .devicekit] [--python-version 3.12]

Writes KIT/pylib; the kit's env.sh puts it on PYTHONPATH. Run after scripts/device_kit.sh,
with the project's Python (the one with vLLM).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The vLLM modules the check reads layouts and views from; their imports come along.
ORACLE_MODULES = ("vllm.v1.kv_cache_layout", "vllm.v1.kv_cache_interface")

#: The module replaced by its two base classes, and the packages above it, left empty.
METADATA_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

#: Packages the GPU machine's image lacks (its list: /work/.library/device/KINDS.md):
#: pydantic for vLLM's config dataclasses, etcd-sdk-python for kvxfer's registry client.
WHEELS = ("pydantic==2.14.4", "pydantic_core==2.50.5", "annotated_types", "typing_inspection",
          "etcd-sdk-python==0.0.7")

#: The two base classes, as vLLM declares them, and nothing of the runtime behind them.
BASE_STUB = '''"""Written by scripts/device_kit_vllm.py: vLLM's two connector metadata base classes,
as vLLM declares them, without the runtime its real module imports."""

from abc import ABC, abstractmethod


class KVConnectorMetadata(ABC):  # noqa: B024
    """Scheduler connector -> worker connector."""


class KVConnectorWorkerMetadata(ABC):
    """Worker connector -> scheduler connector."""

    @abstractmethod
    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        ...
'''


def copy_oracle(target: Path) -> list[str]:
    """Copies every vLLM module that importing the oracle loads, each file as it is."""
    before = set(sys.modules)
    for name in ORACLE_MODULES:
        importlib.import_module(name)
    copied = []
    for name in sorted(set(sys.modules) - before):
        module = sys.modules[name]
        source = getattr(module, "__file__", None)
        if not name.startswith("vllm") or source is None:
            continue
        if not source.endswith(".py"):
            raise SystemExit(f"{name} is compiled ({source}): the kit copies pure-Python modules only")
        relative = Path(*name.split(".")) / "__init__.py" if source.endswith("__init__.py") \
            else Path(*name.split(".")).with_suffix(".py")
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target / relative)
        copied.append(name)
    return copied


def write_metadata_base(target: Path) -> None:
    parts = METADATA_BASE.split(".")
    for depth in range(2, len(parts)):
        package = target.joinpath(*parts[:depth])
        package.mkdir(parents=True, exist_ok=True)
        init = package / "__init__.py"
        if not init.exists():
            init.write_text("# Written by scripts/device_kit_vllm.py: empty, so the base below imports alone.\n")
    target.joinpath(*parts).with_suffix(".py").write_text(BASE_STUB)


def install_wheels(target: Path, python_version: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                    "--target", str(target), *WHEELS], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit", type=Path, default=REPO / ".devicekit",
                        help="the device kit's folder (made by scripts/device_kit.sh); default: %(default)s")
    parser.add_argument("--python-version", default="3.12",
                        help="the GPU machine's Python, for the wheels; default: %(default)s")
    args = parser.parse_args()
    target = args.kit / "pylib"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    copied = copy_oracle(target)
    write_metadata_base(target)
    install_wheels(target, args.python_version)
    print(f"[device kit] {len(copied)} vLLM modules and {len(WHEELS)} wheels in {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
