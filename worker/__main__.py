"""``python -m worker --model M``: a worker without the CLI (the CLI's ``sluice worker`` calls ``run_worker``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict

from engine.models.base import UnsupportedModelError
from jobs.units import parse_size
from worker.isolation import EngineSick
from worker.worker import run_worker

EXIT_ENGINE_SICK = 3  # the engine fails even alone: a supervisor (compose, systemd) should restart us


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    p.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--queue", default=None, help="queue to serve (default: the --model string)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="default: SLUICE_REDIS_URL, else the embedded server")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="a size: 2GiB, 512MB or bytes")
    p.add_argument("--lookahead", type=int, default=None)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--heartbeat-ttl", type=float, default=10.0)
    p.add_argument("--grace-period", type=float, default=30.0)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--exit-when-idle", type=float, default=None, help="seconds")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = {k: v for k, v in {"dtype": a.dtype, "max_num_seqs": a.max_num_seqs, "kv_cache_memory": a.kv_cache_memory,
                                "max_num_batched_tokens": a.max_num_batched_tokens}.items() if v is not None}
    try:
        report = run_worker(a.model, queue=a.queue, worker_id=a.worker_id, redis_url=a.redis_url,
                            lookahead=a.lookahead, max_deliveries=a.max_deliveries, heartbeat_ttl=a.heartbeat_ttl,
                            grace_period=a.grace_period, metrics_port=a.metrics_port,
                            exit_when_idle=a.exit_when_idle, **engine)
    except UnsupportedModelError as e:  # its waiting jobs were failed with the reason
        logging.getLogger("worker").error("exiting: %s", e)
        sys.exit(1)
    except EngineSick as e:
        logging.getLogger("worker").error("exiting: %s; its jobs were handed back to the queue", e)
        sys.exit(EXIT_ENGINE_SICK)
    print(json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
