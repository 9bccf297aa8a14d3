"""What a user would write instead of shardflow, with DuckDB or Polars: one short script per
engine and stage, read as the specification of what the stage computes (docs/preprocessing.md,
"Against DuckDB and Polars"). Each runs as its own process:

    python -m lab.bench.peers.<engine> preprocess OUT RAW.parquet ...
    python -m lab.bench.peers.<engine> ingest OUT EXPORT.csv ...

and prints one JSON line of what it wrote (see :mod:`lab.bench.peers.spec`), which the bench
compares with shardflow's own result.
"""
