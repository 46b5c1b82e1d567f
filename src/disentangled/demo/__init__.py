"""The demo: `disentangled demo`, the whole job of docs/getting-started.md on a built-in stand-in for a Hub model.

- `command.py`: the command (tokenizer, pretraining, export, conversion, then the remote half);
- `remote.py`: the second half, run by path in a fresh process where the package is hidden (remote code only);
- `data.py`: small built-in datasets (text for SentencePiece and pretraining, labelled tasks, a split of Python's
  documentation), which the tests, the pretraining command and the studies also read.

Exports no names: the job is the command.
"""
