"""Parameter classes: compile a step at the cost of its structure, not its parameter count.

A frontier model's optimizer step touches tens of thousands of matrices that
fall into a handful of *classes*: params of one group with the same tensor
layouts and the same state layout, for which the step runs the same program.
classify.py finds the classes; stamp.py traces a representative of each
(and a second member, to prove the program is per-parameter) and records
which members share each representative's program.
"""
