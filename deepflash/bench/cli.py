"""deepflash bench speed | accept | rings | memory | hybrid | agent | depth | residency | families | quant: each prints a table
and writes JSON."""

from __future__ import annotations

from . import accept, agent, depth, families, hybrid, memory, quant, residency, rings, speed


def register(sub) -> None:
    parser = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    suites = parser.add_subparsers(dest="suite", required=True)
    for module in (speed, accept, rings, memory, hybrid, agent, depth, residency, families, quant):
        module.register(suites)
