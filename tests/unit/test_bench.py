"""stage=bench's CPU smoke mode: the table's shape (no timing assertions), and which batches it runs."""

import json
from pathlib import Path

import numpy as np
from conftest import compose_config, small_overrides

from dflash.config import BENCH_VARIANTS
from dflash.data.batching import plan_batches
from dflash.main import run_stages
from dflash.stages.bench import format_table, new_shape_batches, timed_batches

KEYS = {"variant", "tokens/s", "samples/s", "MFU", "MFU w/o drain", "drain s", "GPU busy", "write MB/s", "bytes/token",
        "peak GiB", "padding", "writer wait", "x baseline"}


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
    assert isinstance(report["new_shape_extra_s"], float)  # a duration difference: no sign asserted
    assert not (Path(cfg.run_dir) / "bench" / "rank0").exists()  # the written states are removed
    table = format_table(report["rows"])
    assert table.count("\n") == len(BENCH_VARIANTS) + 1 and "padded_fp8" in table


def test_new_shape_batches_have_batch_sizes_not_met_before():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 5000), 16, 4096).astype(np.int64)
    plan = plan_batches(np.arange(len(lengths)), lengths, 12000, 256)
    timed = timed_batches(plan, 16)
    fresh = new_shape_batches(plan, timed, 8)
    sizes = [len(batch.sample_ids) for batch in fresh]
    assert len(fresh) == 8 and len(set(sizes)) == 8
    assert not set(sizes) & {len(batch.sample_ids) for batch in timed}
    assert new_shape_batches(plan, timed, 0) == []
