"""Raw sources → processed, sharded datasets (plans are pure; Dask executes them)."""
