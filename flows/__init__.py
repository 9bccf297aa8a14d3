"""The CLI and the Prefect flows: wiring of the library packages, nothing more."""
