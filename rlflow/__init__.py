"""rlflow: asynchronous RL post-training of language models from a declarative pipeline."""

__version__ = "0.1.0"
