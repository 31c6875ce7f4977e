"""Hugging Face progress bars off for a block, then back as they were: no "Loading weights" bar in every actor's log.

Re-enabling only what was enabled matters: with HF_HUB_DISABLE_PROGRESS_BARS=1 (set by `rlflow run` for its
workers) huggingface_hub warns on every enable_progress_bars() call, once per actor.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def no_progress_bars():
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
