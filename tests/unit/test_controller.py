from services.controller import archive_previous_run


def test_previous_run_is_moved_aside_not_reused(tmp_path):
    out = tmp_path / "runs" / "r"
    assert archive_previous_run(out) is None
    (out / "replay").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    moved = archive_previous_run(out)
    assert not out.exists() and (moved / "metrics.jsonl").read_text() == "{}\n"
    assert moved.name.startswith("r.")
