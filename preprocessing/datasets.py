"""Every dataset shardflow knows, declared once: how to ingest it, how to plan its
preprocessing, its default output format and model, and how to make a synthetic copy.

    DATASETS["sdss"] ─ ingest: CasJobs exports (--source) or SkyServer SQL
                     ├ plan:   preprocessing.sdss.plan_sdss_job (features, quarantine, splits)
                     ├ format: parquet          model: dnn
                     └ synth:  calibrated CasJobs-style exports

    dataset(name) ─▶ Dataset ─ ingest(catalog, request, runner=...)   ─▶ raw version
                             └ preprocess(catalog, options, runner=...) ─▶ processed version
                               (the latest raw version ─ plan ─ driver.run_job ─ commit)

The CLI's choices, the stage functions, the Prefect flows and their deployments all read this
table; nothing else names datasets. The edge (a CLI command, a flow run) looks a name up once
and hands the :class:`Dataset` down. Sources and planners are imported when called, so that
reading the table costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from data_catalog import Catalog, Manifest
from data_catalog.errors import ConfigError, ShardflowError
from preprocessing.config import JobOptions
from preprocessing.driver import Job, OnProgress, Progress, RunnerFactory, run_job

OnUsage = Callable[[dict[str, Any]], None]
"""Hears the workers' and the driver's peak RSS and CPU seconds once a job's tasks are done."""


@dataclass(frozen=True, kw_only=True)
class SkyServerOptions:
    """Where and what to query when SDSS is fetched from SkyServer rather than exports."""

    url: str = "https://skyserver.sdss.org"
    """SkyServer base URL (a mirror, or a local server in tests)."""
    data_release: int = 17
    limit: int | None = None
    """At most this many rows; None: all that match."""
    concurrency: int = 1
    """Queries in flight at once: SkyServer is a shared public service, so one by default."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError("url", f"{self.url!r} is not an http(s) URL")
        if not isinstance(self.data_release, int) or self.data_release < 1:
            raise ConfigError("data_release", f"must be a positive number, got {self.data_release}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ConfigError("limit", f"must be at least 1, got {self.limit}")
        if not isinstance(self.concurrency, int) or not 1 <= self.concurrency <= 8:
            raise ConfigError("concurrency", f"must be between 1 and 8, got {self.concurrency}")


@dataclass(frozen=True, kw_only=True)
class IngestRequest:
    """Where to fetch a dataset's raw files from."""

    source: str | None = None
    """A directory, glob, archive or URL; None: the dataset's default source."""
    skyserver: SkyServerOptions = field(default_factory=SkyServerOptions)
    """sdss without ``source``: the SkyServer query."""
    work_dir: Path | None = None
    """Where unfinished work waits for a rerun (the download cache, under ``downloads/``)."""


@dataclass(frozen=True, kw_only=True)
class SynthRequest:
    """A synthetic copy of a dataset, marked synthetic, for scale tests."""

    out: Path
    rows: int
    """Rows in all (images: training rows)."""
    test_rows: int | None = None
    """Images: test rows (default: a dataset-specific share of ``rows``)."""
    files: int = 1
    """sdss: export files."""
    format: str = "csv"
    """sdss: csv or fits."""
    source: str | None = None
    """Images: the pool of real images to draw on."""
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Dataset:
    """What shardflow knows of one dataset."""

    name: str
    kind: str
    """"images" or "tabular"."""
    default_format: str
    """Output format of preprocessing when none is asked for."""
    default_model: str
    """Model trained when none is asked for."""
    source_help: str
    """What ``--source`` takes, for help texts."""
    plan_ingest: Callable[[Catalog, IngestRequest], Job]
    """The ingest job of a request (lists the source; reads no data)."""
    plan: Callable[[Catalog, Manifest, JobOptions], Job]
    """The preprocessing job of a raw version."""
    reads: Callable[[Job], set[str]]
    """Where the raw files are that a planned preprocessing job's tasks read (catalog URLs):
    each is verified against the raw manifest before any is used."""
    synth: Callable[[SynthRequest], list[Path]]

    def plan_preprocessing(
        self, catalog: Catalog, options: JobOptions, raw: Manifest | None = None
    ) -> Job:
        """The job that processes ``raw`` (default: the latest raw version of this dataset;
        reads manifests only); ``options.format`` None means this dataset's default."""
        raw = raw or self.latest_raw(catalog)
        return self.plan(
            catalog, raw, replace(options, format=options.format or self.default_format)
        )

    def latest_raw(self, catalog: Catalog) -> Manifest:
        raw = catalog.get(self.name)
        if raw.kind != "raw":
            raise ShardflowError(f"{self.name}@{raw.version} is {raw.kind}, expected a raw version")
        return raw

    def ingest(
        self,
        catalog: Catalog,
        request: IngestRequest,
        *,
        runner: RunnerFactory,
        work_root: Path | None = None,
        progress: Progress = lambda _msg: None,
        on_progress: OnProgress | None = None,
        on_usage: OnUsage | None = None,
    ) -> Manifest:
        """Fetch and check the raw files ``request`` names into a raw version: one task per
        input file on ``runner``'s workers. The same bytes make the same version, which is
        returned without a second commit."""
        return run_job(
            catalog,
            self.plan_ingest(catalog, request),
            runner=runner,
            work_root=work_root,
            progress=progress,
            on_progress=on_progress,
            on_usage=on_usage,
        )

    def preprocess(
        self,
        catalog: Catalog,
        *,
        options: JobOptions,
        runner: RunnerFactory,
        work_root: Path | None = None,
        progress: Progress = lambda _msg: None,
        on_progress: OnProgress | None = None,
        on_usage: OnUsage | None = None,
    ) -> Manifest:
        """Turn the latest raw version of this dataset into a processed version
        ("<name>-processed", its parent the raw version).

        Returns the existing version, doing no work, when the same raw version was already
        processed with the same parameters and code.
        """
        from preprocessing import input_check

        raw = self.latest_raw(catalog)
        try:
            job = self.plan_preprocessing(catalog, options, raw)
        except (OSError, ValueError):
            # A raw file the planner read (an SDSS Parquet footer) did not parse: damage is
            # named as such, any other failure keeps its own message.
            input_check.refuse_if_damaged(catalog, raw)
            raise
        return run_job(
            catalog,
            input_check.verified(catalog, raw, job, self.reads(job)),
            runner=runner,
            work_root=work_root,
            progress=progress,
            on_progress=on_progress,
            on_usage=on_usage,
        )


# --- ingest ----------------------------------------------------------------------------------


def _downloads(request: IngestRequest) -> Path | None:
    return request.work_dir / "downloads" if request.work_dir else None


def _ingest_idx(name: str) -> Callable[[Catalog, IngestRequest], Job]:
    def plan(catalog: Catalog, request: IngestRequest) -> Job:
        from preprocessing.sources import mnist

        return mnist.plan_ingest(name, source=request.source, cache=_downloads(request))

    return plan


def _ingest_cifar10(catalog: Catalog, request: IngestRequest) -> Job:
    from preprocessing.sources import cifar10

    if request.source is None:
        raise ConfigError(
            "source", "is needed for cifar10: a directory of batches, a .tar.gz or its URL"
        )
    return cifar10.plan_ingest(request.source, cache=_downloads(request))


def _ingest_sdss(catalog: Catalog, request: IngestRequest) -> Job:
    if request.source is not None:
        from preprocessing.sources import exports

        return exports.plan_ingest(request.source, catalog)
    from preprocessing.sources import sdss

    return sdss.plan_skyserver_ingest(
        skyserver_url=request.skyserver.url,
        data_release=request.skyserver.data_release,
        limit=request.skyserver.limit,
        concurrency=request.skyserver.concurrency,
    )


# --- plan ------------------------------------------------------------------------------------


def _plan_images(catalog: Catalog, raw: Manifest, options: JobOptions) -> Job:
    from preprocessing.images import plan_job

    return plan_job(catalog, raw, options)


def _plan_sdss(catalog: Catalog, raw: Manifest, options: JobOptions) -> Job:
    from preprocessing.sdss import plan_sdss_job

    return plan_sdss_job(catalog, raw, options)


def _images_read(job: Job) -> set[str]:
    from preprocessing.images import ImageJob

    assert isinstance(job, ImageJob)
    return {path for part in job.parts for path in part.paths}


def _sdss_read(job: Job) -> set[str]:
    """The raw files of the pieces the job scans: an earlier version's pieces are not read."""
    from preprocessing.sdss import SdssJob

    assert isinstance(job, SdssJob)
    kept = {str(record["key"]) for record in job.kept("scan", {})}
    return {piece.path for piece in job.pieces if piece.key not in kept}


# --- synth -----------------------------------------------------------------------------------


def _synth_idx(name: str, default_pool: str | None) -> Callable[[SynthRequest], list[Path]]:
    def synth(request: SynthRequest) -> list[Path]:
        from preprocessing.sources.synth_images import write_image_set

        pool = request.source or default_pool
        if pool is None:
            raise ConfigError("source", f"is needed for {name}: a folder of real IDX files")
        return write_image_set(
            name,
            Path(pool),
            request.out,
            train_rows=request.rows,
            test_rows=request.test_rows or max(1, request.rows // 6),
            seed=request.seed,
        )

    return synth


def _synth_cifar10(request: SynthRequest) -> list[Path]:
    from preprocessing.sources.synth_images import write_cifar10_set

    if request.source is None:
        raise ConfigError("source", "is needed for cifar10: real CIFAR-10 batches to draw on")
    return write_cifar10_set(
        request.source,
        request.out,
        train_rows=request.rows,
        test_rows=request.test_rows or max(1, request.rows // 5),
        seed=request.seed,
    )


def _synth_sdss(request: SynthRequest) -> list[Path]:
    from preprocessing.sources.synth import write_sdss_exports

    if request.format not in ("csv", "fits"):
        raise ConfigError("format", f"must be csv or fits for sdss, got {request.format!r}")
    return write_sdss_exports(
        request.out,
        rows=request.rows,
        files=request.files,
        fmt="csv" if request.format == "csv" else "fits",
        seed=request.seed,
    )


# --- the table -------------------------------------------------------------------------------

DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
_IDX_SOURCE = (
    "a directory or URL (file://, http(s)://, s3://...) holding train-images-idx3-ubyte, "
    "train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each raw or .gz"
)

DATASETS: dict[str, Dataset] = {
    "mnist": Dataset(
        name="mnist",
        kind="images",
        default_format="parquet",
        default_model="cnn",
        source_help=_IDX_SOURCE + " (default: the upstream mirrors, digests checked)",
        plan_ingest=_ingest_idx("mnist"),
        plan=_plan_images,
        reads=_images_read,
        synth=_synth_idx("mnist", None),
    ),
    "fashion-mnist": Dataset(
        name="fashion-mnist",
        kind="images",
        default_format="parquet",
        default_model="cnn",
        source_help=_IDX_SOURCE
        + f" (default: Debian's dataset-fashion-mnist in {DEBIAN_FASHION_MNIST}, else upstream)",
        plan_ingest=_ingest_idx("fashion-mnist"),
        plan=_plan_images,
        reads=_images_read,
        synth=_synth_idx("fashion-mnist", DEBIAN_FASHION_MNIST),
    ),
    "cifar10": Dataset(
        name="cifar10",
        kind="images",
        # A Petastorm dataset for the colour images (an ndarray field per image, read with
        # make_reader); plain Parquet for the small greyscale sets, whose batch reader path is
        # the fastest we have.
        default_format="petastorm",
        default_model="cnn",
        source_help="a directory of binary or python batches, a .tar.gz, or its URL (required)",
        plan_ingest=_ingest_cifar10,
        plan=_plan_images,
        reads=_images_read,
        synth=_synth_cifar10,
    ),
    "sdss": Dataset(
        name="sdss",
        kind="tabular",
        default_format="parquet",
        default_model="dnn",
        source_help="a directory or glob of CasJobs exports (CSV, FITS, VOTable); without it, "
        "SkyServer is queried",
        plan_ingest=_ingest_sdss,
        plan=_plan_sdss,
        reads=_sdss_read,
        synth=_synth_sdss,
    ),
}
NAMES = tuple(DATASETS)


def dataset(name: str) -> Dataset:
    """The registry entry of ``name``, or a one-line error listing the known ones."""
    try:
        return DATASETS[name]
    except KeyError:
        raise ShardflowError(f"unknown dataset {name!r}; known: {', '.join(NAMES)}") from None
