"""The planner: layouts of values over tiles, strategies per node, exchanges between layouts, the memory plan."""
