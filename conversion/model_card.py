"""README.md of a converted folder: the top-level `model_card.md` template rendered with huggingface_hub's ModelCard."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import transformers

from .sources import Source

EXAMPLE_TEXT = "Paris is the capital of France."
TAGS = ["custom_code", "deberta", "disentangled-attention"]


def template_text() -> str:
    """The template, shipped in the package (src/disentangled/model_card.md links to the top-level file)."""
    return (resources.files("disentangled") / "model_card.md").read_text(encoding="utf-8")


def render_model_card(
    source: Source,
    checkpoint,
    figures: dict | None,
    *,
    dtype: str = "float32",
    repo_id: str | None = None,
    batch_lengths: str = "",
):
    from huggingface_hub import ModelCard, ModelCardData

    from disentangled import __version__

    from .convert import TASKS, TOLERANCE, TRANSFORMERS_PREFIX

    head = TASKS[checkpoint.task]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag=head.pipeline_tag,
        tags=list(TAGS),
        base_model=source.repo_id,
        license=source.license,
    )
    model_name = Path(repo_id).name if repo_id else "model"
    rows = [
        {
            "name": name,
            "diff": f"{f['max_abs_diff']:.2e}",
            "tolerance": f"{TOLERANCE * max(1.0, f['max_abs_reference']):.1e}",
        }
        for name, f in (figures or {}).items()
    ]
    source_link = (
        f"[{source.repo_id}](https://huggingface.co/{source.repo_id})" if source.repo_id else "a local checkpoint"
    )
    card = ModelCard.from_template(
        card_data,
        template_str=template_text(),
        model_name=model_name,
        source_description=f"[{source.repo_id}](https://huggingface.co/{source.repo_id})"
        if source.repo_id
        else "A DeBERTa checkpoint",
        repo_id=repo_id or "path/to/this/folder",
        auto_class=head.auto_class,
        class_name="Disentangled" + head.suffix,
        task=checkpoint.task,
        legacy=checkpoint.config.get("legacy") if checkpoint.task == "masked-lm" else None,
        has_tokenizer=bool(source.tokenizer_files),
        example_text=EXAMPLE_TEXT,
        source_link=source_link,
        source_revision=source.revision,
        source_layout="Microsoft DeBERTa" if source.layout == "microsoft" else "transformers",
        source_model_type=checkpoint.model_type,
        dtype=dtype,
        converter_version=f"disentangled {__version__}",
        transformers_version=transformers.__version__,
        parity_rows=rows,
        reference_class=TRANSFORMERS_PREFIX[checkpoint.model_type]
        + (head.suffix if checkpoint.has_transformers_class else "Model"),
        enhanced_mask_decoder=checkpoint.enhanced_mask_decoder,
        head_reference=None
        if checkpoint.has_transformers_class
        else (
            "Microsoft's replaced-token-detection head on that encoder's output"
            if checkpoint.task == "replaced-token-detection"
            else "the Enhanced Mask Decoder run through transformers' own last DeBERTa-v2 layer (twice, with "
            "`query_states`) and the MLM head"
        ),
        batch_lengths=batch_lengths,
    )
    return card


def write_model_card(folder: Path, source: Source, checkpoint, figures: dict | None, **kwargs) -> Path:
    card = render_model_card(source, checkpoint, figures, **kwargs)
    path = Path(folder) / "README.md"
    card.save(path)
    return path
