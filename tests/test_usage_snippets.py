"""The converted model card's Usage block runs as it is, without a question, on transformers 5.x and 4.57.

The block is taken from the rendered card itself, the repo id replaced by a converted local folder, and run where the
package cannot be imported, with no stdin: a "Do you wish to run the custom code?" prompt would show in the output
(and in a terminal would wait for an answer). The README's and the manual's blocks are run by
tests/test_documented_commands.py.
"""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import transformers
from conversion_sources import hub_deberta_v3_base_case
from isolated import PYTHON_4_57, run_isolated, system_python
from spm_fixture import train_spm

from disentangled import cli

PROMPT = "Do you wish to run the custom code"
DONE = "SNIPPET DONE"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A Hub-layout DeBERTa-v3 MLM with its SentencePiece tokenizer, through `disentangled convert`."""
    root = tmp_path_factory.mktemp("snippets")
    case = hub_deberta_v3_base_case(root / "sources", train_spm(root / "_spm"))
    with redirect_stdout(io.StringIO()) as log:
        assert cli.main(["convert", str(case.source), str(root / "out")]) == 0, log.getvalue()
    return root / "out"


def python_block_after(text: str, heading: str) -> str:
    """The first ```python block after `heading`."""
    after = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.DOTALL)[1]


def card_snippet(folder: Path) -> str:
    code = python_block_after((folder / "README.md").read_text(), "## Usage")
    repo_id = re.search(r'from_pretrained\("([^"]+)"', code)[1]
    assert "AutoTokenizer.from_pretrained(" in code and "outputs = model(**inputs)" in code, code
    return code.replace(f'"{repo_id}"', repr(str(folder))) + "print(outputs.logits.shape)\n"


def run_snippet(python, code: str, tmp_path: Path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code + f"print({DONE!r})\n")
    result = run_isolated(python, script, [], env={"HF_HUB_OFFLINE": "1"}, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert PROMPT not in output, output[-3000:]
    assert DONE in result.stdout
    return result.stdout


def pythons() -> list:
    return [
        pytest.param(system_python(), id=f"transformers-{transformers.__version__}"),
        pytest.param(
            PYTHON_4_57,
            id="transformers-4.57",
            marks=pytest.mark.skipif(not PYTHON_4_57.exists(), reason=f"no transformers 4.57 at {PYTHON_4_57}"),
        ),
    ]


@pytest.mark.parametrize("python", pythons())
def test_model_card_usage_runs_without_a_question(converted, python, tmp_path):
    out = run_snippet(python, card_snippet(converted), tmp_path)
    assert "torch.Size([1, " in out  # the snippet ran the model on the tokenizer's ids


def test_the_check_sees_the_question(converted, tmp_path):
    """The bare call the card used to show prints the question on transformers 5: the check above can fail."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4.57 reads tokenizer_config.json first and never asks")
    bare = card_snippet(converted).replace(", trust_remote_code=True)\ninputs", ")\ninputs")
    assert "AutoTokenizer.from_pretrained(" + repr(str(converted)) + ")" in bare
    with pytest.raises(AssertionError, match=PROMPT):
        run_snippet(system_python(), bare, tmp_path)
