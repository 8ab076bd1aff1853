"""A run's workdir, on a disk or a gs:// bucket, and everything that lives in it:
`storage` (paths and the writes that are atomic on each kind of place), `lock` (one
run per workdir), `checkpoint` (Orbax steps, resume, the saved run config) and
`record` (`metrics.jsonl`, W&B, the rows set aside on resume)."""
