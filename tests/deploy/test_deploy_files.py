"""The deploy files validate offline, and cannot drift from the CLI.

    deploy/kubernetes/**.yaml ─ built-in kinds: kubernetes-validate, strict, Kubernetes 1.32
                              ─ DaskCluster, MPIJob, TrainJob, ClusterTrainingRuntime:
                                jsonschema against schemas/*.json (derived
                                from the operators' published CRDs, make_crd_schemas.py), their
                                pods against the same Kubernetes 1.32 definitions
    deploy/compose.yaml       ─ docker-compose config -q (Debian's 1.29; `make test` installs it)
    every `shardflow ...`     ─ flows.cli.build_parser().parse_args

Each check is also run on a copy with one field broken, and must fail there.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from flows.cli import build_parser
from flows.commands.server import POOL

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# The oldest Kubernetes that the MPI operator release the manifests target (v0.8.2) is tested
# on; kubernetes-validate 1.37.0 bundles the schemas of 1.25 to 1.37.
KUBERNETES_VERSION = "1.32.0"
CRD_SCHEMAS = {
    ("kubernetes.dask.org/v1", "DaskCluster"): "daskcluster-v1.json",
    ("kubeflow.org/v2beta1", "MPIJob"): "mpijob-v2beta1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-v1alpha1.json",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): (
        "clustertrainingruntime-v1alpha1.json"
    ),
}
IMAGE = "registry.example.com/shardflow:0.1.0"
# The Prefect server's database: PostgreSQL's own image, Debian's major version (the one the
# PostgreSQL-backed flow test runs against: tests/flows/test_prefect_postgres.py).
POSTGRES_IMAGE = "postgres:15"


class InvalidManifest(Exception):
    pass


def _definitions() -> Registry:
    contents = schema_contents(
        f"kubernetes-json-schema/v{KUBERNETES_VERSION}-local-strict/_definitions.json",
        KUBERNETES_VERSION,
    )
    return Registry().with_resource(contents["$id"], Resource.from_contents(contents))


REGISTRY = _definitions()


def validate_manifest(doc: dict[str, Any]) -> None:
    """Raise InvalidManifest naming the field, for any kind: an unknown kind or apiVersion
    is an error too (kubernetes-validate only warns)."""
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    crd = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        validator = jsonschema.Draft202012Validator(schema, registry=REGISTRY)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            where = ".".join(str(p) for p in errors[0].absolute_path)
            raise InvalidManifest(f"{name}: {where}: {errors[0].message}")
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise InvalidManifest(f"{name}: {where}: {exc.message}") from exc
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise InvalidManifest(f"{name}: {exc.message}") from exc


def manifest_files(root: Path = KUBERNETES_DIR) -> list[Path]:
    return sorted(root.rglob("*.yaml"))


def load_manifests(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate_file(path: Path) -> None:
    for doc in load_manifests(path):
        validate_manifest(doc)


def all_manifests(root: Path = KUBERNETES_DIR) -> list[dict[str, Any]]:
    return [doc for path in manifest_files(root) for doc in load_manifests(path)]


def containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every container and init container of every pod spec inside ``node``."""
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            if isinstance(node.get(key), list):
                yield from node[key]
        for value in node.values():
            yield from containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from containers(item)


def compose_services(path: Path = COMPOSE) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["services"]
    return services


def command_lines(
    root: Path = KUBERNETES_DIR, compose: Path = COMPOSE
) -> list[tuple[str, list[str]]]:
    """(where, argv) of every container's command + args in the deploy files."""
    found = []
    for doc in all_manifests(root):
        for container in containers(doc):
            argv = [*container.get("command", []), *container.get("args", [])]
            found.append((f"{doc['kind']}/{doc['metadata'].get('name')}:{container['name']}", argv))
    for name, service in compose_services(compose).items():
        found.append((f"compose:{name}", list(service.get("command", []))))
    return found


def parse_shardflow_commands(lines: list[tuple[str, list[str]]]) -> list[str]:
    """The subcommand of every ``shardflow ...`` line, each parsed by the CLI's own parser;
    InvalidManifest names the first that does not parse."""
    parser = build_parser()
    parsed = []
    for where, argv in lines:
        if argv[:1] != ["shardflow"]:
            continue
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit as exc:
            raise InvalidManifest(f"{where}: `{' '.join(argv)}` does not parse") from exc
        parsed.append(args.command)
    return parsed


def docker_compose(path: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose is not installed: `make test` installs Debian's package")
    return subprocess.run(
        ["docker-compose", "-f", str(path), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def broken_copy(source: Path, tmp_path: Path, old: str, new: str) -> Path:
    """``source`` copied into ``tmp_path`` (same relative place) with ``old`` replaced once."""
    text = source.read_text()
    assert old in text, f"{source.name} no longer contains {old!r}: update this test"
    copy = tmp_path / source.relative_to(ROOT)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(old, new, 1))
    return copy


# -- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_kubernetes_manifest_validates(path: Path) -> None:
    validate_file(path)


def test_every_kind_the_admin_applies_is_there() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in all_manifests()}
    assert kinds >= {
        ("v1", "Namespace"),
        ("v1", "PersistentVolumeClaim"),
        ("v1", "ConfigMap"),
        ("v1", "Secret"),
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("batch/v1", "Job"),
        ("kubernetes.dask.org/v1", "DaskCluster"),
        ("kubeflow.org/v2beta1", "MPIJob"),
        ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
    }


BROKEN_MANIFESTS = [
    pytest.param(
        "30-prefect.yaml", "apiVersion: apps/v1", "apiVersion: apps/v2", "schema for kind",
        id="deployment-apiVersion",
    ),
    pytest.param(
        "30-prefect.yaml", "containerPort: 4200", 'containerPort: "4200"', "is not of type",
        id="container-port-string",
    ),
    pytest.param(
        "30-prefect.yaml", "readinessProbe:", "readinessProbes:", "readinessProbes",
        id="unknown-container-field",
    ),
    pytest.param(
        "10-storage.yaml", "storage: 200Gi", "storage: [200Gi]", "storage",
        id="pvc-quantity-list",
    ),
    pytest.param(
        "25-prefect-postgres.yaml", "containerPort: 5432", 'containerPort: "5432"',
        "is not of type", id="statefulset-port-string",
    ),
    pytest.param(
        "25-prefect-postgres.yaml", "secretKeyRef:", "secretKeyRefs:", "secretKeyRefs",
        id="statefulset-unknown-env-field",
    ),
    pytest.param(
        "40-dask.yaml", "containerPort: 8786", 'containerPort: "8786"', "is not of type",
        id="daskcluster-port-string",
    ),
    pytest.param(
        "40-dask.yaml", "  worker:\n    replicas: 2", "  workers:\n    replicas: 2", "workers",
        id="daskcluster-unknown-field",
    ),
    pytest.param(
        "jobs/train-mpijob.yaml", "apiVersion: kubeflow.org/v2beta1", "apiVersion: kubeflow.org/v1",
        "schema for kind", id="mpijob-apiVersion",
    ),
    pytest.param(
        "jobs/train-mpijob.yaml", "mpiImplementation: OpenMPI", "mpiImplementation: OpenMpi",
        "OpenMpi", id="mpijob-implementation",
    ),
    pytest.param(
        "jobs/train-mpijob.yaml", "Launcher:\n      replicas: 1", "Launcher:\n      replicas: 2",
        "1 was expected", id="mpijob-two-launchers",
    ),
    pytest.param(
        "jobs/train-mpijob.yaml", "restartPolicy: OnFailure", "restartPolicy: Always",
        "Always", id="mpijob-restart-policy",
    ),
    pytest.param(
        "jobs/train-mpijob.yaml", "containerPort: 22", 'containerPort: "22"', "is not of type",
        id="mpijob-pod-port-string",
    ),
    pytest.param(
        "jobs/train-trainjob.yaml", "  runtimeRef:", "  runtime:", "runtime",
        id="trainjob-no-runtimeRef",
    ),
    pytest.param(
        "jobs/train-trainjob.yaml", "numNodes: 2", "numNodes: two", "is not of type",
        id="trainjob-nodes-string",
    ),
    pytest.param(
        "jobs/train-runtime.yaml", "mpiImplementation: OpenMPI", "mpiImplementation: MPICH",
        "MPICH", id="runtime-implementation",
    ),
    pytest.param(
        "jobs/train-runtime.yaml", "containerPort: 22", 'containerPort: "22"', "is not of type",
        id="runtime-pod-port-string",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "old", "new", "message"), BROKEN_MANIFESTS)
def test_a_broken_manifest_fails(
    tmp_path: Path, name: str, old: str, new: str, message: str
) -> None:
    copy = broken_copy(KUBERNETES_DIR / name, tmp_path, old, new)
    with pytest.raises(InvalidManifest, match=re.escape(message)):
        validate_file(copy)


def test_every_image_is_the_one_image() -> None:
    """Every shardflow container runs the one image; the database, PostgreSQL's."""
    kubernetes = {c["image"] for doc in all_manifests() for c in containers(doc)}
    compose = {service["image"] for service in compose_services().values()}
    assert kubernetes == compose == {IMAGE, POSTGRES_IMAGE}
    postgres = [
        c["name"] for doc in all_manifests() for c in containers(doc) if c["image"] != IMAGE
    ]
    assert postgres == ["postgres"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    """A Kubernetes container's env: name → value, or the valueFrom it names."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_prefect_server_runs_on_the_postgresql_deployed_beside_it() -> None:
    """Compose and Kubernetes: the server's PREFECT_SERVER_DATABASE_* name the PostgreSQL
    service, its user, database and password; nothing points it at SQLite."""
    services = compose_services()
    server = services["prefect-server"]["environment"]
    database = services["prefect-postgres"]["environment"]
    assert server["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert server["PREFECT_SERVER_DATABASE_HOST"] == "prefect-postgres"
    assert services["prefect-server"]["depends_on"]["prefect-postgres"] == {
        "condition": "service_healthy"
    }
    assert (server["PREFECT_SERVER_DATABASE_USER"], server["PREFECT_SERVER_DATABASE_NAME"]) == (
        database["POSTGRES_USER"],
        database["POSTGRES_DB"],
    )
    assert server["PREFECT_SERVER_DATABASE_PASSWORD"] == database["POSTGRES_PASSWORD"]

    docs = {(d["kind"], d["metadata"].get("name")): d for d in all_manifests()}
    (k8s_server,) = docs["Deployment", "prefect-server"]["spec"]["template"]["spec"]["containers"]
    statefulset = docs["StatefulSet", "prefect-postgres"]
    (k8s_database,) = statefulset["spec"]["template"]["spec"]["containers"]
    env, db_env = _env(k8s_server), _env(k8s_database)
    service = docs["Service", "prefect-postgres"]
    assert env["PREFECT_SERVER_DATABASE_DRIVER"] == "postgresql+asyncpg"
    assert env["PREFECT_SERVER_DATABASE_HOST"] == (
        f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    )
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert int(env["PREFECT_SERVER_DATABASE_PORT"]) == service["spec"]["ports"][0]["port"]
    assert (env["PREFECT_SERVER_DATABASE_USER"], env["PREFECT_SERVER_DATABASE_NAME"]) == (
        db_env["POSTGRES_USER"],
        db_env["POSTGRES_DB"],
    )
    assert env["PREFECT_SERVER_DATABASE_PASSWORD"] == db_env["POSTGRES_PASSWORD"]
    assert env["PREFECT_SERVER_DATABASE_PASSWORD"]["secretKeyRef"]["name"] == "prefect-postgres"
    for where in (server, env):
        assert "PREFECT_API_DATABASE_CONNECTION_URL" not in where
        assert "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in where


def test_each_dask_worker_has_its_own_local_directory() -> None:
    (cluster,) = [doc for doc in all_manifests() if doc["kind"] == "DaskCluster"]
    pod = cluster["spec"]["worker"]["spec"]
    (worker,) = pod["containers"]
    local = worker["args"][worker["args"].index("--local-directory") + 1]
    (mount,) = [m for m in worker["volumeMounts"] if m["mountPath"] == local]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume  # per pod, never shared

    scratch = {}
    for name, service in compose_services().items():
        if service.get("command", [])[:2] == ["dask", "worker"]:
            local = service["command"][service["command"].index("--local-directory") + 1]
            (volume,) = [v.split(":")[0] for v in service["volumes"] if v.endswith(f":{local}")]
            scratch[name] = volume
    assert len(scratch) == 2 and len(set(scratch.values())) == 2


# -- MPIJob and horovodrun ----------------------------------------------------------------


def test_mpijob_hostfile_is_what_horovodrun_reads(tmp_path: Path) -> None:
    """The MPI operator (OpenMPI implementation) writes one '%s slots=%d' line per worker
    (pkg/controller/mpi_job_controller.go, newConfigMap) to /etc/mpi/hostfile; horovodrun
    --hostfile must read it as those hosts and slots, and --np must use them all."""
    from horovod.runner.common.util import hosts

    (job,) = [doc for doc in all_manifests() if doc["kind"] == "MPIJob"]
    spec = job["spec"]
    assert spec["mpiImplementation"] == "OpenMPI"  # Intel and MPICH write HOST:N instead
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    workers, slots = spec["mpiReplicaSpecs"]["Worker"]["replicas"], spec["slotsPerWorker"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        "".join(f"{name}-worker-{i}.{name}.{namespace}.svc slots={slots}\n" for i in range(workers))
    )
    parsed = hosts.parse_hosts_and_slots(hosts.parse_host_files(str(hostfile)))
    assert parsed == (
        [f"{name}-worker-{i}.{name}.{namespace}.svc" for i in range(workers)],
        {f"{name}-worker-{i}.{name}.{namespace}.svc": slots for i in range(workers)},
    )

    (launcher,) = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(launcher["command"][1:])
    assert args.hostfile == "/etc/mpi/hostfile"
    assert args.num_ranks == workers * slots


def test_trainjob_hostfile_is_what_horovodrun_reads(tmp_path: Path) -> None:
    """Kubeflow Trainer v2's MPI plugin (v2.3.0, OpenMPI) writes one '%s slots=%d' line per node
    pod (pkg/runtime/framework/plugins/mpi, buildHostFileConfigMap), each named
    <trainjob>-<replicated job>-<job index>-<pod index>.<trainjob> (plugins/jobset); the launcher
    gets it only in a container named "node", and the TrainJob's command must run horovodrun on
    every slot."""
    from horovod.runner.common.util import hosts

    docs = all_manifests()
    (job,) = [doc for doc in docs if doc["kind"] == "TrainJob"]
    (runtime,) = [doc for doc in docs if doc["kind"] == "ClusterTrainingRuntime"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    mpi = runtime["spec"]["mlPolicy"]["mpi"]
    assert mpi["mpiImplementation"] == "OpenMPI" and not mpi["runLauncherAsNode"]
    name, nodes, slots = (
        job["metadata"]["name"],
        job["spec"]["trainer"]["numNodes"],
        mpi["numProcPerNode"],
    )
    names = [f"{name}-node-0-{i}.{name}" for i in range(nodes)]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots={slots}\n" for host in names))
    parsed = hosts.parse_hosts_and_slots(hosts.parse_host_files(str(hostfile)))
    assert parsed == (names, dict.fromkeys(names, slots))

    replicated = {r["name"]: r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    assert set(replicated) == {"node", "launcher"}
    launcher = replicated["launcher"]["template"]
    assert (
        launcher["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    )
    (container,) = launcher["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node"  # else no ssh keys and no hostfile
    args = build_parser().parse_args(job["spec"]["trainer"]["command"][1:])
    assert args.hostfile == "/etc/mpi/hostfile"
    assert args.num_ranks == nodes * slots


# -- Compose --------------------------------------------------------------------------------


def test_compose_file_validates() -> None:
    proc = docker_compose(COMPOSE)
    assert proc.returncode == 0, proc.stderr


def test_compose_cluster_has_its_parts() -> None:
    services = compose_services()
    commands = {name: service.get("command", []) for name, service in services.items()}
    assert commands["prefect-server"][:3] == ["prefect", "server", "start"]
    assert commands["prefect-worker"][:3] == ["prefect", "worker", "start"]
    assert commands["dask-scheduler"][:2] == ["dask", "scheduler"]
    assert sum(c[:2] == ["dask", "worker"] for c in commands.values()) == 2
    trainer = build_parser().parse_args(commands["trainer"][1:])
    assert (trainer.command, trainer.hosts, trainer.num_ranks) == ("train", "localhost:2", 2)
    for name, service in services.items():
        if name not in ("prefect-server", "prefect-postgres"):
            assert service["environment"]["SHARDFLOW_HOME"] == "/shardflow", name
            assert service["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
            assert "shardflow-home:/shardflow" in service["volumes"], name


BROKEN_COMPOSE = [
    pytest.param("    shm_size: 1gb", "    shm_sizes: 1gb", "shm_sizes", id="unknown-key"),
    pytest.param(
        "condition: service_healthy", "condition: service_up", "service_up", id="bad-condition"
    ),
    pytest.param("      retries: 12", "      retries: twelve", "twelve", id="retries-string"),
]


@pytest.mark.parametrize(("old", "new", "message"), BROKEN_COMPOSE)
def test_a_broken_compose_file_fails(tmp_path: Path, old: str, new: str, message: str) -> None:
    proc = docker_compose(broken_copy(COMPOSE, tmp_path, old, new))
    assert proc.returncode != 0
    assert message in proc.stderr


# -- The CLI, the image -------------------------------------------------------------------


def test_every_shardflow_command_parses() -> None:
    parsed = parse_shardflow_commands(command_lines())
    assert sorted(set(parsed)) == ["deploy", "ingest", "preprocess", "run", "train"]


@pytest.mark.parametrize(
    ("source", "old", "new"),
    [
        pytest.param("kubernetes/jobs/train-mpijob.yaml", "- --hostfile", "- --host-file",
                     id="mpijob-flag"),
        pytest.param("kubernetes/jobs/preprocess.yaml", "- fashion-mnist", "- fashion_mnist",
                     id="job-dataset"),
        pytest.param("compose.yaml", '"--hosts", "localhost:2",\n              "--epochs"',
                     '"--nodes", "localhost:2",\n              "--epochs"', id="compose-flag"),
    ],
)  # fmt: skip
def test_a_command_the_cli_does_not_take_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, old: str, new: str
) -> None:
    for path in [*manifest_files(), COMPOSE]:
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy)
    broken_copy(ROOT / "deploy" / source, tmp_path, old, new)
    with pytest.raises(InvalidManifest, match="does not parse"):
        parse_shardflow_commands(
            command_lines(tmp_path / "deploy" / "kubernetes", tmp_path / "deploy" / "compose.yaml")
        )
    assert "error:" in capsys.readouterr().err


def test_prefect_workers_poll_the_pool_shardflow_deploy_creates() -> None:
    pools = [
        argv[argv.index("--pool") + 1]
        for _, argv in command_lines()
        if argv[:3] == ["prefect", "worker", "start"]
    ]
    assert pools and set(pools) == {POOL}


def test_dockerfile_builds_horovod_as_the_makefile_does() -> None:
    dockerfile = DOCKERFILE.read_text()
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^HOROVOD_VERSION := (\S+)$", makefile, re.M)
    assert version and f"horovod=={version[1]}" in dockerfile
    env = re.search(r"^HOROVOD_ENV := (.*?[^\\])$", makefile, re.M | re.S)
    assert env
    flags = re.findall(r"\w+=\S+", env[1])
    assert flags and all(flag in dockerfile for flag in flags)
    assert dockerfile.splitlines().count("FROM python:3.11-slim-bookworm") == 1
    assert "-c requirements/lock.txt" in dockerfile
