"""The `kvxfer` command: workers, the local cluster, the colocated reference.

    kvxfer prefill [--port P] [--etcd URL] [--provider net] [--model tiny] ...
    kvxfer decode  [--port P] [--etcd URL] [--provider net] [--model tiny] ...
    kvxfer up [--port P] [--prefill N] [--decode M] [--etcd URL]
    kvxfer up --engine vllm --model DIR [--prefill-args "..."] [--decode-args "..."] -- <vLLM flags>
    kvxfer vllm-args --role prefill|decode --port P --cluster-key-file F --etcd URL
    kvxfer join --engine vllm --role decode --model DIR --etcd URL --cluster-key-file F [-- <vLLM flags>]
    kvxfer router [--etcd URL] [--cluster-key-file F] [router flags: kvxfer router --help]
    kvxfer generate PROMPT [--max-tokens N] [--model tiny]
    kvxfer providers

Every flag of the worker commands maps to a setting that can also come from the
environment (KVXFER_<NAME>, e.g. KVXFER_PROVIDER=shm).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Sequence


def _add_worker_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help=f"HTTP port (default {default_port}; 0 picks a free one)")
    p.add_argument("--advertise-host", help="host put in the registered http_url (default --host)")
    p.add_argument("--worker-id", help="id in the registry (default role-hostname-random)")
    p.add_argument("--model", help="model preset: tiny (default) or llama3-8b-kv")
    p.add_argument("--provider", help="libfabric provider: auto (default), net, tcp, shm, efa, verbs")
    p.add_argument("--rails", type=int, help="endpoints (NICs) used as one (default 1)")
    p.add_argument("--bind-host", help="address the transfer engine binds (e.g. 127.0.0.1)")
    p.add_argument("--same-host", action=argparse.BooleanOptionalAction, default=None,
                   help="copy KV process to process (process_vm_writev) with workers on this "
                        "machine instead of through the provider (default on)")
    p.add_argument("--tcp-congestion",
                   help="TCP congestion control of the engine's fabric connections over tcp/net, names in order "
                        "of preference (default cubic,reno: under BBR without fq, TCP paced them to 0.4x); "
                        "\"system\" keeps the system's")
    p.add_argument("--num-pages", type=int, help="KV cache pages (default 4096)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep finished prompts' full pages and reuse them for prompts with the same prefix: only "
                        "the tokens and pages not held are computed and sent (default on; idle cached pages are "
                        "evicted, least recently used first, when pages run out)")
    p.add_argument("--transfer-timeout-s", type=float, help="a write not complete by then fails (default 10)")
    p.add_argument("--etcd", help="comma-separated etcd endpoints; omitted: no registry")
    p.add_argument("--etcd-prefix", help="registry key prefix (default /kvxfer)")
    _add_etcd_tls_flags(p)
    p.add_argument("--lease-ttl-s", type=int, help="registry lease TTL (default 5)")
    p.add_argument("--drain-timeout-s", type=float, help="SIGTERM drain bound (default 30)")
    p.add_argument("--cluster-key-file", help="cluster key file: signs this worker's registry record "
                   "(env KVXFER_CLUSTER_KEY_FILE; unset: unsigned, with a warning)")


def _add_etcd_tls_flags(p: argparse.ArgumentParser) -> None:
    """The client credentials for an etcd that asks for them (as `kvxfer up`'s does)."""
    p.add_argument("--etcd-ca-file", help="CA bundle that verifies etcd (https:// endpoints; a `kvxfer up` "
                                          "cluster's is LOG_DIR/etcd-tls/ca.crt)")
    p.add_argument("--etcd-cert-file", help="client certificate presented to etcd (`kvxfer up`'s etcd takes no "
                                            "client without one: LOG_DIR/etcd-tls/client.crt)")
    p.add_argument("--etcd-key-file", help="private key of --etcd-cert-file (LOG_DIR/etcd-tls/client.key)")


def _add_instance_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    """Where an instance listens and which cluster it joins (vllm-args, join)."""
    free = "; 0 picks a free one" if default_port == 0 else ", vLLM's default"
    p.add_argument("--port", type=int, default=default_port, help=f"the instance's API port (default {default_port}{free})")
    p.add_argument("--host", default="127.0.0.1", help="address the API server binds (default 127.0.0.1)")
    p.add_argument("--advertise-host", help="host in the URL the router reaches the instance at (default --host)")
    p.add_argument("--etcd", help="comma-separated etcd endpoints of the cluster (omitted: the instance does not "
                                  "register, and no router finds it)")
    p.add_argument("--cluster-key-file", help="the cluster's key: signs the registry record and derives the vLLM "
                                              "API key the router sends (required unless --insecure)")
    _add_etcd_tls_flags(p)
    p.add_argument("--insecure", action="store_true", help="no cluster key: unsigned record, open API (development)")
    p.add_argument("--metrics-port", type=int,
                   help="port of the connector's kvxfer_connector_* /metrics (default: the API port + 1; 0: none)")
    p.add_argument("--worker-id", help="id in the registry (default vllm-ROLE-PID)")
    p.add_argument("--provider", help="libfabric provider of the connector (default auto)")
    p.add_argument("--connector-config", default="{}",
                   help="more kv_connector_extra_config, a JSON object of ConnectorSettings names (e.g. "
                        "'{\"load_stall_timeout_s\": 60}')")


def _connector_config(args: argparse.Namespace, port: int) -> tuple[dict[str, Any], str | None]:
    """(kv_connector_extra_config, API key) from the instance flags; SystemExit(2) with a message if bad."""
    import json

    from kvxfer.integrations.vllm.launch import cluster_connector_config

    if args.cluster_key_file is None and not args.insecure:
        raise SystemExit("kvxfer: --cluster-key-file is required (the cluster's key; --insecure runs without one)")
    try:
        extra = json.loads(args.connector_config)
    except ValueError as exc:
        raise SystemExit(f"kvxfer: --connector-config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SystemExit("kvxfer: --connector-config must be a JSON object")
    if args.provider:
        extra.setdefault("provider", args.provider)
    for name in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file"):
        if getattr(args, name):
            extra.setdefault(name, str(Path(getattr(args, name)).resolve()))
    metrics_port = port + 1 if args.metrics_port is None else args.metrics_port
    try:
        return cluster_connector_config(args.role, port=port, advertise_host=args.advertise_host or args.host,
                                        etcd=args.etcd, cluster_key_file=args.cluster_key_file,
                                        metrics_port=metrics_port, worker_id=args.worker_id, extra_config=extra)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvxfer: {exc}") from None


def _vllm_args(args: argparse.Namespace) -> int:
    import json

    from kvxfer.integrations.vllm.launch import OwnCommandLine

    line = OwnCommandLine.of(args.role, *_connector_config(args, args.port))
    print(json.dumps({"env": line.env, "flags": line.flags}, indent=1) if args.format == "json" else line.shell())
    return 0


def _join(args: argparse.Namespace, passthrough: list[str]) -> int:
    """`kvxfer join`: replaces this process with the instance (signals then reach it directly)."""
    import os
    import socket

    port = args.port
    if port == 0:
        with socket.socket() as s:
            s.bind((args.host, 0))
            port = int(s.getsockname()[1])
    if args.engine == "builtin":
        if passthrough:
            raise SystemExit("kvxfer join: flags after -- are vLLM's; --engine builtin takes none")
        argv = [sys.executable, "-m", "kvxfer.cli", args.role, "--port", str(port), "--host", args.host]
        for flag, value in (("--etcd", args.etcd), ("--cluster-key-file", args.cluster_key_file),
                            ("--model", args.model), ("--worker-id", args.worker_id), ("--provider", args.provider),
                            ("--advertise-host", args.advertise_host), ("--etcd-ca-file", args.etcd_ca_file),
                            ("--etcd-cert-file", args.etcd_cert_file), ("--etcd-key-file", args.etcd_key_file)):
            if value:
                argv += [flag, value]
        os.execv(sys.executable, argv)
    from kvxfer.integrations.vllm.launch import VllmInstanceSpec, kv_role_of

    if not args.model or not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"kvxfer join: --model must be a Hugging Face checkpoint directory (got {args.model!r})")
    extra, api_key = _connector_config(args, port)
    spec = VllmInstanceSpec(model_dir=Path(args.model), port=port, host=args.host, kv_role=kv_role_of(args.role),
                            cpu_cores=args.cpu_cores, kv_cache_gib=args.kv_cache_gib, extra_config=extra,
                            api_key=api_key, user_args=passthrough,
                            # Only the connector's flags, as `vllm-args` gives: the instance must match the
                            # cluster's others (block size, served name), whose flags the user knows.
                            served_model_name=None, block_size=None, seed=None, enforce_eager=False)
    print(f"kvxfer join: {args.role} instance on {spec.url}, cores {args.cpu_cores}; it registers in "
          f"{args.etcd or '(no etcd)'} once loaded", flush=True)
    argv = spec.argv()
    os.execve(argv[0], argv, spec.env())
    return 0  # not reached


def _settings_from(args: argparse.Namespace, cls: Any) -> Any:
    fields = {k: v for k, v in vars(args).items() if v is not None and k in cls.model_fields}
    return cls(**fields)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `kvxfer` command."""
    parser = argparse.ArgumentParser(
        prog="kvxfer",
        description="KV-cache transfer for disaggregated LLM prefill and decode.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefill", help="run a prefill worker")
    _add_worker_flags(p, 8100)
    p.add_argument("--emulated-layer-compute-ms", type=float,
                   help="extra time per layer and chunk, to emulate a larger model (default 0)")
    p = sub.add_parser("decode", help="run a decode worker")
    _add_worker_flags(p, 8200)
    p.add_argument("--max-batch", type=int, help="running batch size (default 64)")
    p.add_argument("--kv-wait-timeout-s", type=float, help="ImmCounter admission deadline (default 30)")

    from kvxfer.cluster.instance_restarts import RestartSettings  # pydantic only: --help stays quick

    p = sub.add_parser("up", help="start a local etcd (unless --etcd), the router and workers")
    p.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--etcd", help="etcd endpoints; omitted: start a local etcd")
    p.add_argument("--model", default="tiny",
                   help="builtin: model preset (default tiny); vllm: a Hugging Face checkpoint directory (default: "
                        "a small seeded Llama made locally, see `kvxfer make-llama`)")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="builtin: kvxfer's own reference workers (default); vllm: vLLM instances running "
                        "KvxferConnector, one per core (needs the vllm extra)")
    p.add_argument("--provider", default="auto", help="libfabric provider for all workers")
    p.add_argument("--insecure", action="store_true",
                   help="no cluster key: registry records unsigned, worker control APIs open (development only; logs a warning)")
    p.add_argument("--admin-port", type=int, help="router admin port (GET /workers; default: a free one)")
    p.add_argument("--log-dir", help="folder of the processes' logs (default: a new temporary folder, printed at start); "
                                     "made owner-only (0700), as are the logs in it (0600)")
    p.add_argument("--num-pages", type=int,
                   help="builtin: KV cache pages per worker (default: as many as the memory budget allows, at most "
                        "2048); refused up front if all workers' pages do not fit")
    p.add_argument("--kv-memory-budget-gib", type=float,
                   help="builtin: memory all workers' KV caches may take together, GiB (default: MemAvailable less "
                        "10%% and the processes' own memory, weights included); a layout that needs more is refused "
                        "before any worker starts, with the memory it needs")
    p.add_argument("--prefill-args", default="",
                   help="vLLM flags for the prefill instances only, one quoted string (e.g. \"--max-num-seqs 4\"; "
                        "a single flag as --prefill-args=--enforce-eager); after the common ones, so they win")
    p.add_argument("--decode-args", default="", help="vLLM flags for the decode instances only (as --prefill-args)")
    p.add_argument("--max-restarts", type=int, default=RestartSettings().max_restarts,
                   help="restarts of a worker or vLLM instance that died, each under its own name, before it is "
                        "left down (default %(default)s; 0: never restart, only report)")
    p.add_argument("--restart-backoff-s", type=float, default=RestartSettings().restart_backoff_s,
                   help="seconds before an instance's first restart, doubled for each further one of the same "
                        "instance (default %(default)s)")
    p.epilog = ("With --engine vllm, everything after `--` is passed to every vLLM API server (e.g. `-- "
                "--max-num-seqs 8 --served-model-name llama`). kvxfer sets only --kv-transfer-config; its other "
                "defaults (--block-size 32, --enforce-eager, --seed 0, --shutdown-timeout 30, --served-model-name "
                "DIR's name) give way to a flag of yours of the same name; context length and dtype are vLLM's, "
                "from the checkpoint. Each instance gets a core of its own (VLLM_CPU_OMP_THREADS_BIND) and serves "
                "vLLM's vllm:* on its API port's /metrics and kvxfer_connector_* on a port of its own: both are "
                "listed in LOG_DIR/prometheus-targets.json (a Prometheus file_sd file).")

    p = sub.add_parser("vllm-args", help="print the environment and flags that make your own vLLM API server a "
                                         "kvxfer prefill or decode instance",
                       description="Prints a bash snippet for `eval`: `export VLLM_API_KEY=...` (derived from the "
                                   "cluster key; the router sends it) and the array KVXFER_VLLM_FLAGS "
                                   "(--kv-transfer-config, --shutdown-timeout so SIGTERM drains). Then run "
                                   "`python -m vllm.entrypoints.openai.api_server --model DIR --port P "
                                   "\"${KVXFER_VLLM_FLAGS[@]}\"` (`vllm serve` fails under the vllm-cpu "
                                   "distribution). --format json prints {\"env\": {...}, \"flags\": [...]}.")
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="the instance's role")
    _add_instance_flags(p, default_port=8000)
    p.add_argument("--format", choices=("shell", "json"), default="shell", help="output format (default shell)")

    p = sub.add_parser("join", help="start one more prefill or decode instance in a running cluster")
    p.add_argument("--engine", choices=("vllm", "builtin"), default="vllm",
                   help="vllm: a vLLM API server with KvxferConnector (default); builtin: kvxfer's own worker")
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="the instance's role")
    p.add_argument("--model", help="vllm: the Hugging Face checkpoint directory the cluster serves (required); "
                                   "builtin: the model preset (default tiny)")
    _add_instance_flags(p, default_port=0)
    p.add_argument("--cpu-cores", default="0",
                   help="vllm: cores of the instance (VLLM_CPU_OMP_THREADS_BIND, and taskset), e.g. 1 or 2-3 "
                        "(default 0)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vllm: KV cache size (VLLM_CPU_KVCACHE_SPACE; "
                                                                   "default 1)")
    p.epilog = ("With --engine vllm, everything after `--` is passed to the vLLM API server, and kvxfer adds only "
                "--kv-transfer-config and --shutdown-timeout 30: give the flags the cluster's other instances "
                "have where they matter (--served-model-name, --block-size; a `kvxfer up` cluster uses "
                "--block-size 32 --served-model-name DIR's name). The instance registers in etcd once loaded and "
                "warmed up; the router sends it traffic from then on. SIGTERM drains it.")

    p = sub.add_parser("router", add_help=False,
                       help="run the router alone (python -m kvxfer_router; flags: kvxfer router --help)")

    p = sub.add_parser("generate", help="greedy completion in one process (the colocated reference)")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="tiny")

    p = sub.add_parser("make-llama", help="write a small seeded Llama checkpoint (HF format, local tokenizer; "
                                          "no downloads) that vLLM loads")
    p.add_argument("out_dir", help="directory to write (kept as is if it holds the same shape already)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--max-positions", type=int, default=None,
                   help="max_position_embeddings of the config: the context vLLM derives (default 4096; 8192 "
                        "with --size-1b)")
    p.add_argument("--size-1b", action="store_true", help="the benchmark's ~1.1 B parameter shape instead")

    sub.add_parser("providers", help="list libfabric providers usable here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["router"]:
        from kvxfer_router.cli import main as router_main

        # kvxfer's name for the etcd flag, as in every other command.
        renamed = []
        for arg in argv[1:]:
            name, eq, value = arg.partition("=")
            renamed.append(("--etcd-endpoints" if name == "--etcd" else name) + eq + value)
        return router_main(renamed)
    # Everything after `--` is vLLM's (up, join): argparse never sees it.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and args.command not in ("up", "join"):
        parser.error(f"flags after -- are passed to vLLM by `up` and `join` only, not `{args.command}`")
    args.vllm_args = passthrough
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "prefill":
        from kvxfer.workers.prefill.http import run_prefill_worker
        from kvxfer.workers.prefill.service import PrefillSettings

        run_prefill_worker(_settings_from(args, PrefillSettings))
    elif args.command == "decode":
        from kvxfer.workers.decode.http import run_decode_worker
        from kvxfer.workers.decode.service import DecodeSettings

        run_decode_worker(_settings_from(args, DecodeSettings))
    elif args.command == "up":
        from kvxfer.cluster.local_cluster import run_up

        return run_up(args)
    elif args.command == "vllm-args":
        return _vllm_args(args)
    elif args.command == "join":
        return _join(args, passthrough)
    elif args.command == "generate":
        from kvxfer.model.config import ModelConfig
        from kvxfer.model.tokenizer import ByteTokenizer
        from kvxfer.model.transformer import Transformer

        model = Transformer(ModelConfig.preset(args.model))
        tok = ByteTokenizer()
        out = model.generate(tok.encode(args.prompt), args.max_tokens)
        print(tok.decode(out.tokens))
    elif args.command == "make-llama":
        from dataclasses import replace
        from pathlib import Path

        from kvxfer.integrations.vllm.checkpoint import SHAPE_1B, CheckpointShape, make_checkpoint

        shape = SHAPE_1B if args.size_1b else CheckpointShape(layers=args.layers, hidden=args.hidden)
        shape = replace(shape, seed=args.seed)
        if args.max_positions is not None:
            shape = replace(shape, max_positions=args.max_positions)
        print(make_checkpoint(Path(args.out_dir), shape))
    elif args.command == "providers":
        from kvxfer.transfer.engine import available_providers

        print("\n".join(available_providers()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
