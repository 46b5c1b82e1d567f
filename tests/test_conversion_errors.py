"""Bad input to `disentangled convert` / `push` / `export-transformers`: one clear line, a non-zero exit, nothing left behind."""

from __future__ import annotations

import io
import json
import pickle
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from conversion_sources import build_model

from disentangled import cli


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("error-source") / "tiny-v3"
    build_model("v3", "Model").save_pretrained(folder)
    return folder


def copy_of(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = cli.main([str(arg) for arg in argv])
    return code, stdout.getvalue(), capsys.readouterr().err


def expect_error(capsys, tmp_path, *argv, match: str, command: str = "convert") -> str:
    code, _, err = run_cli(capsys, command, *argv)
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("disentangled")]
    assert len(lines) == 1 and lines[0].startswith(f"disentangled {command}: error:"), err
    assert match in lines[0], lines[0]
    assert "Traceback" not in err
    return lines[0]


def nothing_written(parent: Path, name: str = "out") -> bool:
    return not (parent / name).exists() and not list(parent.glob(f".{name}.*"))


def test_nonexistent_folder(capsys, tmp_path):
    expect_error(capsys, tmp_path, tmp_path / "missing", tmp_path / "out", match="neither a folder nor a valid Hub")
    assert nothing_written(tmp_path)


def test_invalid_repo_id_as_source(capsys, tmp_path):
    expect_error(capsys, tmp_path, "not//a valid id", tmp_path / "out", match="neither a folder nor a valid Hub")


def test_hub_repo_not_in_the_offline_cache(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    expect_error(capsys, tmp_path, "nobody/no-such-deberta", tmp_path / "out", match="nobody/no-such-deberta")
    assert nothing_written(tmp_path)


def test_non_deberta_model_type_names_the_supported_ones(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "bert")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    line = expect_error(capsys, tmp_path, folder, tmp_path / "out", match="'bert' is not a DeBERTa")
    assert "deberta (DeBERTa v1)" in line and "deberta-v2" in line
    assert nothing_written(tmp_path)


def test_missing_weights(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="no weight file")
    assert nothing_written(tmp_path)


def test_missing_shard(capsys, tmp_path):
    folder = tmp_path / "sharded"
    build_model("v3", "Model").save_pretrained(folder, max_shard_size="100KB")
    next(folder.glob("model-00002-*.safetensors")).unlink()
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="is missing from")


def test_corrupt_safetensors(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="corrupt weight file model.safetensors")
    assert nothing_written(tmp_path)


def test_corrupt_bin(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "corrupt-bin")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated zip")
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="cannot read weight file pytorch_model.bin safely")


class _Payload:
    def __reduce__(self):
        return (print, ("the pickle ran code",))


def test_pickle_with_code_is_not_executed(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "evil")
    (folder / "model.safetensors").unlink()
    torch.save({"weight": torch.zeros(2), "payload": _Payload()}, folder / "pytorch_model.bin", pickle_module=pickle)
    code, out, err = run_cli(capsys, "convert", folder, tmp_path / "out")
    assert code != 0 and "weights_only=True" in err
    assert "the pickle ran code" not in out + err


def test_weights_that_do_not_fit_the_config(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "misfit")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="weights do not fit the config")
    assert nothing_written(tmp_path)


def test_missing_layer(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "deeper")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="missing from the checkpoint")


def test_non_empty_output_needs_force(capsys, tmp_path, source):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    expect_error(capsys, tmp_path, source, out, match="not empty; pass --force")
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces a model folder (one holding a config.json), never an arbitrary folder such as ~
    expect_error(capsys, tmp_path, source, out, "--force", match="not a model folder")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "convert", source, out, "--force")
    assert code == 0, err
    assert not (out / "keep.txt").exists() and json.loads((out / "config.json").read_text())["model_type"]
    assert not list(tmp_path.glob(".out.*"))


def test_output_never_replaces_the_source(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "checkpoint")
    before = sorted(p.name for p in folder.iterdir())
    for output in (folder, tmp_path):
        expect_error(capsys, tmp_path, folder, output, "--force", match="holds the source")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_shard_index_cannot_name_files_outside_the_checkpoint(capsys, tmp_path, source):
    folder = copy_of(source, tmp_path / "escaping")
    weights = next(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    index_name = "model.safetensors.index.json" if weights.suffix == ".safetensors" else "pytorch_model.bin.index.json"
    outside = tmp_path / ("outside" + weights.suffix)
    weights.rename(outside)
    (folder / index_name).write_text(json.dumps({"weight_map": {"anything": "../" + outside.name}}))
    expect_error(capsys, tmp_path, folder, tmp_path / "out", match="plain file names")


def test_invalid_push_target_fails_before_converting(capsys, tmp_path, source):
    expect_error(capsys, tmp_path, source, tmp_path / "out", "--push-to", "bad repo id!", match="invalid Hub repo id")
    assert nothing_written(tmp_path)


def test_failed_parity_exits_non_zero_and_leaves_nothing(capsys, tmp_path, source, monkeypatch):
    from disentangled.conversion import convert

    def broken(reference, ours, batch):
        return {"last_hidden_state": {"max_abs_diff": 0.5, "max_abs_reference": 3.0}}

    monkeypatch.setattr(convert, "compare", broken)
    expect_error(capsys, tmp_path, source, tmp_path / "out", match="parity check failed")
    assert nothing_written(tmp_path)


def test_no_verify_says_so(capsys, tmp_path, source):
    code, out, _ = run_cli(capsys, "convert", source, tmp_path / "out", "--no-verify")
    assert code == 0 and "WARNING: --no-verify" in out
    assert "Not verified" in (tmp_path / "out" / "README.md").read_text()


def test_push_rejects_bad_input(capsys, tmp_path, source):
    expect_error(capsys, tmp_path, source, "bad repo id!", match="invalid Hub repo id", command="push")
    expect_error(capsys, tmp_path, tmp_path / "absent", "me/model", match="does not exist", command="push")
    expect_error(capsys, tmp_path, source, "me/model", match="not a folder written by", command="push")


def test_export_rejects_a_folder_that_is_not_converted(capsys, tmp_path, source):
    expect_error(
        capsys,
        tmp_path,
        source,
        tmp_path / "hf",
        match="not a disentangled model folder",
        command="export-transformers",
    )
    assert nothing_written(tmp_path, "hf")


def test_enhanced_mask_decoder_needs_the_absolute_table(capsys, tmp_path):
    folder = tmp_path / "mlm"
    build_model("v3", "ForMaskedLM", legacy=False).save_pretrained(folder)  # transformers drops the table
    expect_error(
        capsys,
        tmp_path,
        folder,
        tmp_path / "out",
        "--enhanced-mask-decoder",
        match="deberta.embeddings.position_embeddings.weight",
    )
    assert nothing_written(tmp_path)


def test_enhanced_mask_decoder_needs_the_lm_predictions_head(capsys, tmp_path):
    folder = tmp_path / "legacy"
    build_model("v3", "ForMaskedLM").save_pretrained(folder)  # legacy cls.predictions
    expect_error(capsys, tmp_path, folder, tmp_path / "out", "--enhanced-mask-decoder", match="lm_predictions.lm_head")


def test_gdes_delta_without_the_merged_table_is_refused(capsys, tmp_path):
    folder = tmp_path / "delta-only"
    model = build_model("v3", "Model")
    state_dict = {f"deberta.{k}": v for k, v in model.state_dict().items()}
    state_dict["deberta.embeddings.word_embeddings._weight"] = state_dict.pop(
        "deberta.embeddings.word_embeddings.weight"
    )
    folder.mkdir()
    torch.save(state_dict, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    expect_error(
        capsys,
        tmp_path,
        folder,
        tmp_path / "out",
        match="embedding-sharing delta deberta.embeddings.word_embeddings._weight",
    )
    assert nothing_written(tmp_path)


def test_rtd_task_needs_the_rtd_head(capsys, tmp_path, source):
    expect_error(
        capsys, tmp_path, source, tmp_path / "out", "--task", "replaced-token-detection", match="mask_predictions"
    )


def test_generator_needs_its_files(capsys, tmp_path, source):
    expect_error(capsys, tmp_path, source, tmp_path / "out", "--generator", match="generator_config.json")
