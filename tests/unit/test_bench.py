"""stage=bench's CPU smoke mode: the table's shape (no timing assertions)."""

import json
from pathlib import Path

from conftest import compose_config, small_overrides
from dflash.config import BENCH_VARIANTS
from dflash.main import run_stages
from dflash.stages.bench import format_table

KEYS = {"variant", "tokens/s", "samples/s", "MFU", "MFU w/o drain", "drain s", "GPU busy", "write MB/s", "bytes/token", "peak GiB",
        "padding", "writer wait", "x baseline"}


def test_bench_smoke_reports_every_variant(prepared_root):
    cfg = compose_config(small_overrides(prepared_root, "bench") + ["stage=bench", "bench=smoke",
                                                                    f"bench.variants={list(BENCH_VARIANTS)}"])
    run_stages(cfg)
    report = json.loads((Path(cfg.run_dir) / "bench.json").read_text())
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == list(BENCH_VARIANTS)
    assert all(set(row) == KEYS for row in rows.values())
    assert rows["baseline"]["x baseline"] == 1.0
    assert rows["padded"]["bytes/token"] > 1.9 * rows["padded_fp8"]["bytes/token"]
    assert rows["padded"]["bytes/token"] >= 5 * 128 * 2  # 5 layers x hidden 128 x bf16
    assert 0 < report["fp8_relative_error"] < 0.05
    assert report["layer_ids"] == [1, 3, 5, 7, 9] and report["flops_per_token"] > 0
    assert report["first_pass_s"] > 0 and report["compiled"] is False  # CPU: eager unless forced
    assert not (Path(cfg.run_dir) / "bench" / "rank0").exists()  # the written states are removed
    table = format_table(report["rows"])
    assert table.count("\n") == len(BENCH_VARIANTS) + 1 and "padded_fp8" in table
