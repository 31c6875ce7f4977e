"""Control-plane policies (staleness control, routing, sync, migration, dispatch); shipped as rlflow.operators.

Everything here is pure Python: no Ray, no torch. The Ray runtime and the simulator drive the same code.
"""
