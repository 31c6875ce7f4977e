"""The Ray executor of a plan (`rlflow run`). Imports Ray; nothing in rlflow.schema or the compiler imports this."""
