"""The long fault campaign: `make soak` (or `python -m benchmarks.soak --faults 30`).

Trains a small sharded MLP in a real kernel on CPU ranks while a seeded scheduler injects faults
(dead ranks, agent and kernel; stopped ranks; a rank raising mid-collective; the stop button
twice; ENOSPC during a save; damaged checkpoints), recovers from each as a user would, and prints
one table. It ends non-zero when a fault was not recovered from, a checkpoint was lost, LATEST
named an incomplete checkpoint, a process or file of a pool outlived the campaign, or the final
model and optimizer state differ from a fault-free run's. `tests/support/fault_campaign.py` says how.
"""

from __future__ import annotations

import argparse
import sys

from tests.support.fault_campaign import FAULT_KINDS, Campaign, summary_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=200, help="how many faults to inject (default 200)")
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks in the pool (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scheduler; a failure names it")
    parser.add_argument("--timeout", type=float, default=5.0, help="the pool's collective timeout in seconds")
    parser.add_argument("--kinds", default=",".join(FAULT_KINDS),
                        help=f"comma-separated fault kinds (default: all of {', '.join(FAULT_KINDS)})")
    args = parser.parse_args(argv)
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    if args.faults < 1 or args.ranks < 2:
        parser.error(f"--faults {args.faults} --ranks {args.ranks}: need at least 1 fault and 2 ranks")
    try:
        campaign = Campaign(seed=args.seed, num_faults=args.faults, num_ranks=args.ranks, kinds=kinds,
                            collective_timeout_s=args.timeout)
    except ValueError as error:
        parser.error(str(error))
    result = campaign.run()
    print(summary_table(result))
    failed = result.failures() or result.orphans or not result.state_matches
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
