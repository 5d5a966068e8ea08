"""Command line: ``python -m kvxfer_router [--flag value ...]`` runs the router.

Every ``RouterSettings`` field is a flag (``max_in_flight`` -> ``--max-in-flight``); a flag
overrides its ``KVXFER_ROUTER_*`` environment variable, which overrides the default. Workers
come from the etcd registry, or from ``--workers-file`` (a JSON list of worker records) for
runs without etcd.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from pydantic import ValidationError

from .directory import EtcdWorkerDirectory, StaticWorkerDirectory, WorkerDirectory
from .policy_registry import policy_names
from .settings import RouterSettings

log = logging.getLogger("kvxfer_router")


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one flag per ``RouterSettings`` field plus ``--workers-file``."""
    parser = argparse.ArgumentParser(
        prog="python -m kvxfer_router",
        description="kvxfer router: OpenAI-compatible /v1/completions over disaggregated prefill/decode "
        "workers. Each setting can also be given as environment variable KVXFER_ROUTER_<NAME>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, field in RouterSettings.model_fields.items():
        env = f"KVXFER_ROUTER_{name.upper()}"
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} (env {env}; default {json.dumps(default)})"
        kind: Callable[[str], Any]
        if field.annotation in (int, float, str):
            kind = field.annotation  # type: ignore[assignment]
        elif field.annotation in (Path, Path | None):
            kind = Path  # file settings: certificates, keys
        else:
            kind = _json_object
        extra: dict[str, Any] = {}
        if name == "policy":
            extra["choices"] = policy_names()
        elif name == "kv_index_mode":
            extra["choices"] = ["precise", "approximate", "both"]
        # SUPPRESS: a flag left out must not shadow the environment variable.
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=argparse.SUPPRESS,
                            help=help_text, **extra)
    parser.add_argument(
        "--workers-file", type=Path, default=None,
        help="JSON list of worker records (registry WorkerRecord fields) to route to instead of "
        "reading etcd; for single-machine runs and debugging.",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """Settings from parsed flags over the environment; ``ValidationError`` if invalid."""
    given = {k: v for k, v in vars(args).items() if k in RouterSettings.model_fields}
    return RouterSettings(**given)


def open_directory(settings: RouterSettings, workers_file: Path | None) -> tuple[WorkerDirectory, Callable[[], None]]:
    """The worker directory to route with, and how to close it.

    With ``workers_file``: a static list. Otherwise an etcd ``RegistryWatcher`` that is
    started here (blocking until its first sync, so the router starts ready when workers
    are registered) and closed by the returned callable.
    """
    if workers_file is not None:
        records = json.loads(workers_file.read_text())
        if not isinstance(records, list):
            raise ValueError(f"{workers_file}: expected a JSON list of worker records")
        return StaticWorkerDirectory(records), lambda: None
    from kvxfer.registry import RegistrySettings, RegistryWatcher

    if settings.cluster_key_file is None:
        log.warning("no cluster key (KVXFER_ROUTER_CLUSTER_KEY_FILE): any record written to etcd is routed to, "
                    "a fake worker included. Development only.")
    watcher = RegistryWatcher(RegistrySettings(
        endpoints=settings.etcd_endpoints, prefix=settings.registry_prefix, tls_ca_path=settings.etcd_ca_file,
        tls_cert_path=settings.etcd_cert_file, tls_key_path=settings.etcd_key_file,
        cluster_key_path=settings.cluster_key_file))
    watcher.start()
    return EtcdWorkerDirectory(watcher), watcher.close


def public_server_config(app: Any, settings: RouterSettings) -> Any:
    """The uvicorn config of the public port: TLS when configured, `header_timeout_s` on
    request headers, `keep_alive_timeout_s` on idle connections, and a graceful shutdown
    bounded by the request deadline."""
    import uvicorn

    from .header_timeout import header_timeout_protocol

    # In-flight requests end within their deadline, so that bounds a graceful shutdown
    # (SIGTERM); the app's own clean-up then takes at most shutdown_timeout_s.
    # TLS only on the public port: the admin port stays on loopback (port-forward to reach it).
    tls: dict[str, Any] = {}
    if settings.tls_cert_file is not None:
        tls = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                          http=header_timeout_protocol(settings.header_timeout_s),
                          timeout_keep_alive=settings.keep_alive_timeout_s,
                          timeout_graceful_shutdown=math.ceil(settings.request_deadline_s), **tls)


def serve(app: Any, admin_app: Any | None, settings: RouterSettings) -> None:
    """Serves the public app until SIGINT/SIGTERM, and the admin app beside it in the same loop."""
    import uvicorn

    class AdminServer(uvicorn.Server):
        # The public server owns the signals; the admin server stops when it does.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    public = uvicorn.Server(public_server_config(app, settings))

    async def run() -> None:
        admin_task = None
        if admin_app is not None:
            admin = AdminServer(uvicorn.Config(admin_app, host=settings.admin_host, port=settings.admin_port,
                                               log_level="warning", lifespan="off"))
            admin_task = asyncio.create_task(admin.serve())
        try:
            await public.serve()
        finally:
            if admin_task is not None:
                admin.should_exit = True
                await admin_task

    event_loop_runner()(run())


def event_loop_runner() -> Callable[[Any], Any]:
    """uvloop's `run` where uvloop is installed, else asyncio's. uvicorn picks uvloop by
    itself (loop "auto") only when it runs the loop; `serve` runs it, for the admin server
    beside the public one. Against instances that answer at once, the router's CPU per
    relayed vLLM request was about 17% lower on uvloop (benchmarks/README.md, "The router's
    cost to a vLLM user")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, open the worker directory, and serve until interrupted; exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        parser.error(f"invalid settings:\n{exc}")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from .admin import create_admin_app
    from .app import create_app

    try:
        directory, close_directory = open_directory(settings, args.workers_file)
    except Exception as exc:
        log.error("cannot open the worker directory: %s", exc)
        return 2
    try:
        app = create_app(settings, directory)
        admin_app = create_admin_app(app.state.router) if settings.admin_port >= 0 else None
        serve(app, admin_app, settings)
    finally:
        close_directory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
