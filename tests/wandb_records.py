"""Read the metrics of an offline W&B run from its `run-<id>.wandb` file (tests only).

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB-log records (crc32 [4], length [2], type [1], data) in 32 KiB blocks, each record's data
a `wandb_internal_pb2.Record` protobuf. wandb 0.31 ships no Python reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK_BYTES = 32768
HEADER_BYTES = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = HEADER_BYTES, b""
    while pos + 7 <= len(data):
        if BLOCK_BYTES - pos % BLOCK_BYTES < 7:  # block trailer padding
            pos += BLOCK_BYTES - pos % BLOCK_BYTES
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_run_group(run_dir: Path) -> str:
    """The W&B group of the offline run in `run_dir`."""
    (log_file,) = Path(run_dir).glob("run-*.wandb")
    for payload in _payloads(log_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.HasField("run"):
            return record.run.run_group
    return ""


def read_history(run_dir: Path) -> tuple[list[dict], dict]:
    """(history rows, summary) of the offline run in `run_dir` (a `wandb/offline-run-*` dir)."""
    (log_file,) = Path(run_dir).glob("run-*.wandb")
    rows, summary = [], {}
    for payload in _payloads(log_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.HasField("history"):
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif record.HasField("summary"):
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows, summary
