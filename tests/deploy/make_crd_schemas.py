"""Regenerate ``schemas/*.json``: the JSON schemas of the custom resources in
deploy/kubernetes/, derived from the CRDs their operators publish.

    python tests/deploy/make_crd_schemas.py MPI_OPERATOR_YAML DASKCLUSTER_CRD_YAML
    python tests/deploy/make_crd_schemas.py trainer TRAINJOBS_CRD_YAML RUNTIMES_CRD_YAML

The last two are kubeflow/trainer's ``manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml``
and ``..._clustertrainingruntimes.yaml`` (Kubeflow Trainer v2: TrainJob, ClusterTrainingRuntime).

MPI_OPERATOR_YAML is kubeflow/mpi-operator's ``deploy/v2beta1/mpi-operator.yaml`` and
DASKCLUSTER_CRD_YAML dask/dask-kubernetes'
``dask_kubernetes/operator/deployment/helm/dask-kubernetes-operator/crds/daskcluster.yaml``
(the commits used are in each schema's ``$comment``). Each CRD's ``openAPIV3Schema`` is kept
with three changes:

- embedded pods refer to the pinned Kubernetes version's own definitions (kubernetes-validate's
  strict ``_definitions.json``), so a container is checked exactly as in a Deployment;
- every object with declared properties refuses others: ``kubectl apply`` validates custom
  resources strictly by default (``--validate=strict``) and rejects unknown fields;
- MPIJob gets the operator's admission rules (``pkg/apis/kubeflow/validation``), which a
  CRD cannot express: Launcher and Worker replica specs, one launcher, the restart and clean-pod
  policies it accepts.

Descriptions are dropped to keep the files small. In the Trainer v2 schemas the runtime's
pod templates refer to Kubernetes' PodTemplateSpec the same way; a TrainJob's
``runtimePatches`` (a partial pod spec, unused here) are kept as free objects; the CEL rules
(``x-kubernetes-validations``) are not checked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent / "schemas"
# The $id of kubernetes-validate's _definitions.json.
K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items() if key != "description"}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _crd_version(path: Path, kind: str, version: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "CustomResourceDefinition":
            if doc["spec"]["names"]["kind"] != kind:
                continue
            for served in doc["spec"]["versions"]:
                if served["name"] == version:
                    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]
                    return schema
    raise SystemExit(f"{path}: no CRD for {kind} {version}")


def _envelope(schema: dict[str, Any], api_version: str, kind: str, source: str) -> dict[str, Any]:
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$comment"] = source
    props = schema["properties"]
    props["apiVersion"] = {"const": api_version}
    props["kind"] = {"const": kind}
    props["metadata"] = {"$ref": K8S_DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


def mpijob(path: Path, source: str) -> dict[str, Any]:
    schema = _crd_version(path, "MPIJob", "v2beta1")
    spec = schema["properties"]["spec"]
    replica = spec["properties"]["mpiReplicaSpecs"]["additionalProperties"]
    replica["properties"]["template"] = {"$ref": K8S_DEFS + "io.k8s.api.core.v1.PodTemplateSpec"}
    schema = _strict(schema)
    spec = schema["properties"]["spec"]
    # The operator's admission rules (validation.go).
    replica = spec["properties"]["mpiReplicaSpecs"]["additionalProperties"]
    replica["properties"]["restartPolicy"]["enum"] = ["Never", "OnFailure"]
    replica["properties"]["replicas"]["minimum"] = 1
    replica["required"] = ["replicas", "restartPolicy", "template"]
    specs = spec["properties"]["mpiReplicaSpecs"]
    specs["propertyNames"] = {"enum": ["Launcher", "Worker"]}
    specs["required"] = ["Launcher"]
    # In allOf, not beside additionalProperties: a sibling "properties" would exempt Launcher
    # from the replica schema.
    specs["allOf"] = [{"properties": {"Launcher": {"properties": {"replicas": {"const": 1}}}}}]
    run_policy = spec["properties"]["runPolicy"]
    run_policy["properties"]["cleanPodPolicy"]["enum"] = ["None", "Running", "All"]
    run_policy["required"] = ["cleanPodPolicy"]
    spec["properties"]["slotsPerWorker"]["minimum"] = 0
    spec["properties"]["sshAuthMountPath"]["minLength"] = 1
    # types.go: +kubebuilder:validation:Enum:AtStartup;WaitForWorkersReady (the marker's
    # missing '=' keeps it out of the generated CRD; these are the only values it handles).
    spec["properties"]["launcherCreationPolicy"]["enum"] = ["AtStartup", "WaitForWorkersReady"]
    return _envelope(schema, "kubeflow.org/v2beta1", "MPIJob", source)


def daskcluster(path: Path, source: str) -> dict[str, Any]:
    schema = _crd_version(path, "DaskCluster", "v1")
    for part in ("scheduler", "worker"):
        schema["properties"]["spec"]["properties"][part]["properties"]["spec"] = {
            "$ref": K8S_DEFS + "io.k8s.api.core.v1.PodSpec"
        }
    return _envelope(_strict(schema), "kubernetes.dask.org/v1", "DaskCluster", source)


TRAINER_SOURCE = (
    "kubeflow/trainer v2.3.0 (658725bdae5c7e3a0854d93ac6ff492e109a22ab) "
    "manifests/base/crds/trainer.kubeflow.org_{}.yaml; regenerate with "
    "tests/deploy/make_crd_schemas.py trainer"
)
TRAINER_API = "trainer.kubeflow.org/v1alpha1"


def trainjob(path: Path) -> dict[str, Any]:
    schema = _crd_version(path, "TrainJob", "v1alpha1")
    patches = schema["properties"]["spec"]["properties"].get("runtimePatches")
    if patches is not None:
        patches["items"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    schema = _strict(schema)
    return _envelope(schema, TRAINER_API, "TrainJob", TRAINER_SOURCE.format("trainjobs"))


def clustertrainingruntime(path: Path) -> dict[str, Any]:
    schema = _crd_version(path, "ClusterTrainingRuntime", "v1alpha1")
    jobset = schema["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    job = jobset["properties"]["replicatedJobs"]["items"]["properties"]["template"]
    job["properties"]["spec"]["properties"]["template"] = {
        "$ref": K8S_DEFS + "io.k8s.api.core.v1.PodTemplateSpec"
    }
    schema = _strict(schema)
    return _envelope(
        schema,
        TRAINER_API,
        "ClusterTrainingRuntime",
        TRAINER_SOURCE.format("clustertrainingruntimes"),
    )


def main(argv: list[str]) -> None:
    if argv[:1] == ["trainer"]:
        jobs, runtimes = (Path(arg) for arg in argv[1:])
        trainer = {
            "trainjob-v1alpha1.json": trainjob(jobs),
            "clustertrainingruntime-v1alpha1.json": clustertrainingruntime(runtimes),
        }
        for name, schema in trainer.items():
            (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        return
    mpi_yaml, dask_yaml = (Path(arg) for arg in argv)
    outputs = {
        "mpijob-v2beta1.json": mpijob(
            mpi_yaml,
            "kubeflow/mpi-operator v0.8.2 (caa3c47fc42eb762635f78045ec0fcd1a89eb038) "
            "deploy/v2beta1/mpi-operator.yaml + pkg/apis/kubeflow/validation/validation.go; "
            "regenerate with tests/deploy/make_crd_schemas.py",
        ),
        "daskcluster-v1.json": daskcluster(
            dask_yaml,
            "dask/dask-kubernetes 1daa175f33554549a65530a26300f46368083e7e "
            "dask_kubernetes/operator/deployment/helm/dask-kubernetes-operator/crds/"
            "daskcluster.yaml; regenerate with tests/deploy/make_crd_schemas.py",
        ),
    }
    for name, schema in outputs.items():
        (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
