"""How many positions a Hugging Face model has, read from its config.json: what compile checks model.max_model_len
against (rlflow/component_checks.py) and what bounds a judge's prompts (stages/judge_generate.py). No torch here."""

from __future__ import annotations

#: config.json keys that give a model's positions, in the order transformers' configs use them
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_positions(config) -> tuple[int, str] | None:
    """(positions, the config key that says so) of a Hugging Face config, or None when it does not say."""
    for cfg in (config, (config or {}).get("text_config") if isinstance(config, dict) else None):
        for key in POSITION_KEYS if isinstance(cfg, dict) else ():
            if isinstance(cfg.get(key), int) and cfg[key] > 0:
                return cfg[key], key
    return None
