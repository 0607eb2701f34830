"""The target, beneath every stage: the chip description and the one cost model (ARCHITECTURE.md).

chip.py        the Chip, loaded from a data file (the built-in ones in tremula/chips/*.toml)
cost.py        cycles of compute, copies, exchange, sync and host transfers, as pure functions of a Chip
cost_terms.py  the same priced for the planner's and the codelets' counts and kinds
overheads.py   bytes of code, vertex state and exchange code per tile (and the exchange code of timetable chunks)
step_cost.py   the price of one BSP step (the codelets register their vertices' cycle formulas there)

It imports nothing of tremula but `errors`; everything else imports it.
"""
