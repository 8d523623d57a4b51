"""The prepared dataset: validated, tokenized conversations in one Arrow dir.

Columns: `sample_id` int64 (unique), `input_ids` list<int32>, `loss_mask` list<uint8> (1 on
tokens the drafter learns to predict: the target's responses), `length` int32. The dir is
written to a temporary name and renamed; `dflash_prepared.json` in it holds the fingerprint,
counts and source. Rank 0 prepares; the other ranks wait for it.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from dflash.atomic import read_json, write_json_atomic
from dflash.config import DataConfig, ModelConfig
from dflash.data.synthetic import generate_synthetic, random_conversations
from dflash.target.load import causal_lm_of, target_info_of

log = logging.getLogger(__name__)

PREPARED_MARKER = "dflash_prepared.json"
REQUIRED_COLUMNS = ("input_ids", "loss_mask")


class BadSample(ValueError):
    """A sample or file of the source data is malformed; the message names it."""


def read_source(path: str | Path) -> datasets.Dataset:
    """Open prepared source data: an Arrow dir (`datasets.save_to_disk`), `.parquet` or
    `.jsonl`/`.json`. Raises BadSample naming the file when it is missing, of an unknown kind or
    lacks a required column."""
    path = Path(path)
    if not path.exists():
        raise BadSample(f"data file {path} does not exist (config key `data.path`)")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            raise BadSample(f"{path} holds splits {list(loaded)}: point data.path at one of them")
        dataset = loaded
    elif path.suffix == ".parquet":
        dataset = datasets.Dataset.from_parquet(str(path))
    elif path.suffix in (".jsonl", ".json"):
        dataset = datasets.Dataset.from_json(str(path))
    else:
        raise BadSample(f"{path}: expected an Arrow dir, a .parquet or a .jsonl file")
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise BadSample(f"{path} lacks column(s) {missing} (it has {dataset.column_names}); "
                        f"dflash needs {list(REQUIRED_COLUMNS)} and optionally sample_id")
    return dataset


def validate(dataset: datasets.Dataset, vocab_size: int, where: str) -> tuple[datasets.Dataset, str]:
    """Check every sample and return (the dataset in the prepared schema, its fingerprint).

    Raises BadSample naming `where` and the sample id for: an empty sequence, a `loss_mask` of
    another length than `input_ids`, a mask value other than 0/1, a token id outside
    [0, vocab_size), a duplicate sample id."""
    has_ids = "sample_id" in dataset.column_names
    digest = hashlib.sha256()
    seen: set[int] = set()
    row = 0
    for chunk in dataset.select_columns([*REQUIRED_COLUMNS, *(["sample_id"] if has_ids else [])]).iter(1024):
        for k, (ids, mask) in enumerate(zip(chunk["input_ids"], chunk["loss_mask"])):
            sample_id = int(chunk["sample_id"][k]) if has_ids else row + k
            name = f"{where}: sample id {sample_id}"
            if sample_id in seen:
                raise BadSample(f"{name} appears twice")
            seen.add(sample_id)
            ids_arr, mask_arr = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)
            if ids_arr.size == 0:
                raise BadSample(f"{name} has an empty input_ids")
            if mask_arr.shape != ids_arr.shape:
                raise BadSample(f"{name} has {ids_arr.size} input_ids but {mask_arr.size} loss_mask values")
            if ((mask_arr != 0) & (mask_arr != 1)).any():
                raise BadSample(f"{name} has loss_mask values other than 0/1")
            bad = (ids_arr < 0) | (ids_arr >= vocab_size)
            if bad.any():
                raise BadSample(f"{name} has token id {int(ids_arr[bad][0])} at position "
                                f"{int(np.argmax(bad))}, outside the target vocabulary [0, {vocab_size})")
            digest.update(np.int64(sample_id).tobytes() + ids_arr.astype(np.int32).tobytes()
                          + mask_arr.astype(np.uint8).tobytes())
        row += len(chunk["input_ids"])

    def to_schema(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        return {"sample_id": batch["sample_id"] if has_ids else indices,
                "input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"],
                "length": [len(ids) for ids in batch["input_ids"]]}

    features = datasets.Features({
        "sample_id": datasets.Value("int64"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("uint8")),
        "length": datasets.Value("int32")})
    prepared = dataset.map(to_schema, batched=True, with_indices=True, features=features,
                           remove_columns=dataset.column_names, desc="prepare")
    return prepared, digest.hexdigest()


def is_prepared(prepared_dir: str | Path) -> bool:
    return (Path(prepared_dir) / PREPARED_MARKER).exists()


def save_prepared(dataset: datasets.Dataset, fingerprint: str, prepared_dir: str | Path,
                  source: dict[str, Any]) -> None:
    """Write the prepared dataset atomically (temporary dir, then rename). Rank 0 only."""
    prepared_dir = Path(prepared_dir)
    tmp = prepared_dir.with_name(prepared_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    write_json_atomic(tmp / PREPARED_MARKER, {
        "fingerprint": fingerprint, "num_samples": len(dataset),
        "num_tokens": int(np.sum(dataset["length"])), "source": source})
    if prepared_dir.exists():
        shutil.rmtree(prepared_dir)
    tmp.rename(prepared_dir)
    log.info("prepared %d samples (fingerprint %s) at %s", len(dataset), fingerprint[:12], prepared_dir)


def load_prepared(prepared_dir: str | Path) -> tuple[datasets.Dataset, dict[str, Any]]:
    """(the prepared dataset, its `dflash_prepared.json`)."""
    prepared_dir = Path(prepared_dir)
    if not is_prepared(prepared_dir):
        raise FileNotFoundError(f"{prepared_dir} holds no prepared dataset: run stage=prepare")
    return datasets.load_from_disk(str(prepared_dir)), read_json(prepared_dir / PREPARED_MARKER)


def ensure_prepared(cfg: DataConfig, model: ModelConfig, device: torch.device) -> None:
    """Prepare `cfg`'s data into `cfg.prepared_dir` unless it is there already. Synthetic data is
    generated by the target. Rank 0 only. Raises BadSample for bad input, and ValueError when
    `prepared_dir` holds data prepared from another source."""
    source = {k: v for k, v in asdict(cfg).items() if k != "prepared_dir"}
    info = target_info_of(model)
    if cfg.source == "synthetic":  # the responses are the target's own
        if model.init == "random":
            raise ValueError("data=synthetic generates responses with the target, which needs a checkpoint: "
                             "with model.init=random use data=random_tokens")
        source["target"] = {"path": info.path, "config_sha256": info.config_sha256}
    if is_prepared(cfg.prepared_dir):
        previous = read_json(Path(cfg.prepared_dir) / PREPARED_MARKER)["source"]
        changed = sorted(k for k in source.keys() | previous.keys() if source.get(k) != previous.get(k))
        if changed:
            key = changed[0]
            raise ValueError(f"{cfg.prepared_dir} was prepared with data.{key}={previous.get(key)!r}, "
                             f"this run has data.{key}={source.get(key)!r}: use another run_name or "
                             "data.prepared_dir")
        return
    vocab_size = info.vocab_size
    if cfg.source == "synthetic":
        lm = causal_lm_of(model, device)
        dataset, where = generate_synthetic(cfg, lm, vocab_size), "synthetic data"
        del lm
    elif cfg.source == "random":
        dataset, where = random_conversations(cfg, vocab_size), "random data"
    else:
        dataset, where = read_source(cfg.path), str(cfg.path)
    prepared, fingerprint = validate(dataset, vocab_size, where)
    save_prepared(prepared, fingerprint, cfg.prepared_dir, source)
