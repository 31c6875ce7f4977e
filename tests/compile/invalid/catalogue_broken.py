"""A module that fails while importing (its author's bug), for tests/compile/invalid/import_failed.yaml."""

raise RuntimeError("missing API key REWARD_SERVICE_TOKEN")
