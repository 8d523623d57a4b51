"""Bad input stops with an error naming the sample, file or config key, and nothing is marked
complete."""

import json
from pathlib import Path

import datasets
import pytest

from conftest import run_extract
from dflash.data.prepare import BadSample
from dflash.store.manifest import ManifestMismatch, read_manifest

GOOD = [{"sample_id": 10, "input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"sample_id": 11, "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def extract_file(root: Path, run_name: str, data_path: Path, extra=()):
    return run_extract(root, run_name, ["data=file", f"data.path={data_path}",
                                        f"data.prepared_dir={root}/{run_name}/prepared", *extra])


@pytest.mark.parametrize("bad_row, message", [
    ({"sample_id": 12, "input_ids": [], "loss_mask": []}, "sample id 12 has an empty input_ids"),
    ({"sample_id": 12, "input_ids": [1, 2, 3], "loss_mask": [0, 1]}, "sample id 12 has 3 input_ids but 2 loss_mask"),
    ({"sample_id": 12, "input_ids": [1, 1024, 3], "loss_mask": [0, 1, 1]},
     r"sample id 12 has token id 1024 at position 1, outside the target vocabulary \[0, 1024\)"),
    ({"sample_id": 12, "input_ids": [1, -1], "loss_mask": [0, 1]}, "sample id 12 has token id -1"),
    ({"sample_id": 12, "input_ids": [1, 2], "loss_mask": [0, 2]}, "sample id 12 has loss_mask values other than 0/1"),
    ({"sample_id": 10, "input_ids": [1, 2], "loss_mask": [0, 1]}, "sample id 10 appears twice"),
])
def test_bad_sample_is_named(prepared_root, tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "convs.jsonl", GOOD + [bad_row])
    with pytest.raises(BadSample, match=f"{path}: {message}"):
        extract_file(prepared_root, f"bad-{tmp_path.name}", path)
    assert read_manifest(Path(prepared_root) / f"bad-{tmp_path.name}" / "states") is None


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_missing_column_is_named(prepared_root, tmp_path, kind):
    rows = [{"sample_id": r["sample_id"], "input_ids": r["input_ids"]} for r in GOOD]
    dataset = datasets.Dataset.from_list(rows)
    path = {"jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet", "arrow": tmp_path / "d"}[kind]
    {"jsonl": lambda: write_jsonl(path, rows), "parquet": lambda: dataset.to_parquet(str(path)),
     "arrow": lambda: dataset.save_to_disk(str(path))}[kind]()
    with pytest.raises(BadSample, match=rf"{path} lacks column\(s\) \['loss_mask'\]"):
        extract_file(prepared_root, f"missing-{kind}", path)


def test_missing_file_names_the_key(prepared_root, tmp_path):
    with pytest.raises(BadSample, match="data.path"):
        extract_file(prepared_root, "nofile", tmp_path / "nope.jsonl")


def test_file_source_without_sample_ids_uses_row_numbers(prepared_root, tmp_path):
    rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in GOOD]
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    cfg = extract_file(prepared_root, "rownumbers", path)
    manifest = read_manifest(Path(cfg.run_dir) / "states")
    assert manifest["complete"] and manifest["num_samples"] == 2 and manifest["num_tokens"] == 7


@pytest.mark.parametrize("policy", ["skip", "truncate"])
def test_overlong_samples_are_counted_and_reported(prepared_root, tmp_path, policy, caplog):
    rows = GOOD + [{"sample_id": 12, "input_ids": list(range(1, 11)), "loss_mask": [0] * 5 + [1] * 5}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level("INFO"):
        cfg = extract_file(prepared_root, f"overlong-{policy}", path,
                           ["extract.max_length=6", f"extract.overlong={policy}"])
    manifest = read_manifest(Path(cfg.run_dir) / "states")
    assert manifest["complete"]
    if policy == "skip":
        assert manifest["num_samples"] == 2 and manifest["extraction"]["num_skipped_overlong"] == 1
        assert "1 overlong samples skipped" in caplog.text
    else:
        assert manifest["num_samples"] == 3 and manifest["num_tokens"] == 4 + 3 + 6
        assert manifest["extraction"]["num_truncated"] == 1
        assert "1 overlong samples truncated" in caplog.text


def test_layer_outside_the_target_names_the_key(prepared_root):
    with pytest.raises(ValueError, match=r"`extract.layer_ids`: ids \[12\] are outside the target's 12"):
        run_extract(prepared_root, "badlayer", ["extract.layer_ids=[1,12]"])


def test_run_dir_of_other_layers_is_refused(prepared_root):
    run_extract(prepared_root, "layers", ["extract.layer_ids=[1,2]"])
    with pytest.raises(ManifestMismatch, match=r"layer_ids=\[1, 2\], this run has layer_ids=\[1, 3\]"):
        run_extract(prepared_root, "layers", ["extract.layer_ids=[1,3]"])


def test_run_dir_of_another_target_is_refused(prepared_root):
    run_extract(prepared_root, "othertarget", ["extract.layer_ids=[1]"])
    with pytest.raises(ManifestMismatch, match="target.config_sha256"):
        run_extract(prepared_root, "othertarget", [
            "extract.layer_ids=[1]", "model.seed=1", "model.architecture.intermediate_size=128",
            f"data.prepared_dir={prepared_root}/othertarget/prepared"])


def test_embedded_target_of_another_architecture_is_refused(prepared_root):
    with pytest.raises(ValueError, match="another model.architecture.intermediate_size"):
        run_extract(prepared_root, "otherarch", ["model.architecture.intermediate_size=64"])


def test_prepared_dir_of_another_source_is_refused(prepared_root):
    with pytest.raises(ValueError, match="data.num_samples=48, this run has data.num_samples=50"):
        run_extract(prepared_root, "othersource", ["data.num_samples=50"])


def test_unwritable_output_dir(prepared_root, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a dir")
    with pytest.raises(OSError, match=f"cannot create the run dir {blocker}/x"):
        run_extract(prepared_root, "x", [f"output_root={blocker}",
                                         f"model.path={prepared_root}/models/tiny-qwen3_5-s0"])
