"""Activation checkpointing by the names transformers uses now.

transformers 5 renamed gradient checkpointing to activation checkpointing (`activation_checkpointing_enable`, the
`--activation_checkpointing` training argument); the old names warn that they go away in v6. transformers 4.57 has
only the old ones. The tests use the new names where they exist and fail on the old names' FutureWarning
(`NO_OLD_NAMES`).
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments

NEW_NAMES = "activation_checkpointing" in {field.name for field in dataclasses.fields(TrainingArguments)}
FLAG = "--activation_checkpointing" if NEW_NAMES else "--gradient_checkpointing"
NO_OLD_NAMES = pytest.mark.filterwarnings("error:.*gradient_checkpointing.*:FutureWarning")


def enable_checkpointing(model, use_reentrant: bool) -> None:
    if NEW_NAMES:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
