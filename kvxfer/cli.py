"""The `kvxfer` command: workers, the local cluster, the colocated reference.

    kvxfer prefill [--port P] [--etcd URL] [--provider net] [--model tiny] ...
    kvxfer decode  [--port P] [--etcd URL] [--provider net] [--model tiny] ...
    kvxfer up [--port P] [--prefill N] [--decode M] [--etcd URL]
    kvxfer generate PROMPT [--max-tokens N] [--model tiny]
    kvxfer providers

Every flag of the worker commands maps to a setting that can also come from the
environment (KVXFER_<NAME>, e.g. KVXFER_PROVIDER=shm).
"""

from __future__ import annotations

import argparse
import logging
import sys
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
    p.add_argument("--transfer-timeout-s", type=float, help="a write not complete by then fails (default 10)")
    p.add_argument("--etcd", help="comma-separated etcd endpoints; omitted: no registry")
    p.add_argument("--etcd-prefix", help="registry key prefix (default /kvxfer)")
    p.add_argument("--lease-ttl-s", type=int, help="registry lease TTL (default 5)")
    p.add_argument("--drain-timeout-s", type=float, help="SIGTERM drain bound (default 30)")
    p.add_argument("--cluster-key-file", help="cluster key file: signs this worker's registry record "
                   "(env KVXFER_CLUSTER_KEY_FILE; unset: unsigned, with a warning)")


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
    p.add_argument("--size-1b", action="store_true", help="the benchmark's ~1.1 B parameter shape instead")

    sub.add_parser("providers", help="list libfabric providers usable here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvxfer` console script."""
    args = build_parser().parse_args(argv)
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
        print(make_checkpoint(Path(args.out_dir), replace(shape, seed=args.seed)))
    elif args.command == "providers":
        from kvxfer.transfer.engine import available_providers

        print("\n".join(available_providers()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
