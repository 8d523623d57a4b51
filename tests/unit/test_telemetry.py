"""Progress records: the first batch (compilation) is kept apart from the steady-state rate."""

from dflash.telemetry import ProgressMeter, RankProgress, read_progress, steady_tokens_per_s, summarize


def test_steady_rate_leaves_out_the_first_batch():
    record = {"elapsed_s": 10.0, "warmup_s": 4.0, "tokens_done": 700, "warmup_tokens": 100}
    assert steady_tokens_per_s(record) == 100.0
    assert steady_tokens_per_s({**record, "elapsed_s": 4.0}) == 0.0  # nothing after the first batch yet


def test_meter_records_the_first_batch_and_totals(tmp_path):
    meter = ProgressMeter(tmp_path, RankProgress(rank=0, launch_id="L", planned_samples=5, planned_tokens=50),
                          interval_s=0.0)
    for samples, tokens in ((2, 30), (3, 20)):
        meter.update(samples, tokens, tokens + 2, bytes_written=0, queue_depth=1, compute_wait_s=0.0)
    meter.close(bytes_written=123, compute_wait_s=0.5)
    (record,) = read_progress(tmp_path, "L", world_size=1)
    assert record["warmup_tokens"] == 30 and 0 <= record["warmup_s"] <= record["elapsed_s"]
    assert record["tokens_done"] == 50 and record["finished"] and record["compute_wait_s"] == 0.5
    metrics = summarize([record], world_size=1)
    assert metrics["extract/steady_throughput(tokens/s)"] == steady_tokens_per_s(record)
    assert metrics["extract/padding(fraction)"] == 1 - 50 / 54
