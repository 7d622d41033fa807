"""deploy/kubernetes/ checked offline (issue 47): every manifest file validates against the Kubernetes API
schemas (kubernetes-validate, strict: an unknown field is an error) and KEDA's CRD schemas (tests/data/keda/,
converted by scripts/crd_to_jsonschema.py); both overlays render with ``kubectl kustomize`` (skipped where
there is no kubectl) and the rendered objects validate and hang together: each worker Deployment has its
ScaledObject (to zero, on its own model's backlog at the API's Service) and its PodDisruptionBudget, a
termination grace that covers the worker's drain, and commands that parse as ``sluice`` commands."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from sluice.cli.main import cli
from sluice.worker.drain import FLUSH_AFTER_GRACE

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra) is absent")
import jsonschema  # noqa: E402 - kubernetes-validate's own dependency

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-demo", "gpu")
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes the manifests claim, and the newest schemas known
KEDA = ROOT / "tests" / "data" / "keda"
KEDA_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): KEDA / "scaledobject-keda-v1alpha1.json",
                ("keda.sh/v1alpha1", "TriggerAuthentication"): KEDA / "triggerauthentication-keda-v1alpha1.json"}
NAMESPACE = "sluice"
EXTERNAL_SECRET = "sluice-api-key"  # the gpu overlay's: created with kubectl (docs/deployment.md), never in git


def errors_of(doc: dict[str, Any]) -> list[str]:
    """Why ``doc`` is not a valid object of its kind, one line each (none: valid)."""
    schema_file = KEDA_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema_file is not None:
        validator = jsonschema.Draft7Validator(json.loads(schema_file.read_text()))
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    out = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            out.append(f"{version} {'/'.join(map(str, e.path))}: {str(e).splitlines()[0]}")
    return out


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files() -> list[Path]:
    """The files of base and overlays that kustomize reads as whole objects (its resources)."""
    out = []
    for k in sorted(KUBE.rglob("kustomization.yaml")):
        out += [k.parent / r for r in yaml.safe_load(k.read_text()).get("resources", []) if (k.parent / r).is_file()]
    return out


def patch_files() -> list[Path]:
    out = []
    for k in sorted(KUBE.rglob("kustomization.yaml")):
        out += [k.parent / p["path"] for p in yaml.safe_load(k.read_text()).get("patches", []) if "path" in p]
    return out


def base_objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for f in (KUBE / "base").glob("*.yaml")
            if f.name != "kustomization.yaml" for d in load_all(f)}


def merged(base: Any, patch: Any) -> Any:
    """A strategic-merge patch's effect, as far as these patches use it: maps merge, lists of named
    items merge by name, anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merged(base[k], v) if k in base else v for k, v in patch.items()}}
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) and "name" in i for i in base + patch):
        by_name = {i["name"]: i for i in base}
        out = [merged(by_name[i["name"]], i) if i["name"] in by_name else i for i in patch]
        return out + [i for i in base if i["name"] not in {p["name"] for p in patch}]
    return patch


def test_every_manifest_file_is_listed_and_validates() -> None:
    files = manifest_files()
    listed = {f.resolve() for f in files} | {f.resolve() for f in patch_files()}
    on_disk = {f.resolve() for f in KUBE.rglob("*.yaml") if f.name != "kustomization.yaml"}
    assert on_disk == listed, f"files no kustomization reads: {sorted(map(str, on_disk - listed))}"
    seen = 0
    for f in files:
        for doc in load_all(f):
            seen += 1
            assert not errors_of(doc), f"{f.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']}:\n" + \
                "\n".join(errors_of(doc))
    assert seen >= 10


def test_each_overlay_patch_validates_on_the_object_it_patches() -> None:
    base = base_objects()
    for f in patch_files():
        for patch in load_all(f):
            target = base[(patch["kind"], patch["metadata"]["name"])]
            doc = merged(target, patch)
            assert doc != target and not errors_of(doc), f"{f.relative_to(ROOT)}:\n" + "\n".join(errors_of(doc))


def test_the_schemas_refuse_what_kubectl_would() -> None:
    """The validation can fail: an unknown field, a wrong type, a missing required field."""
    base = base_objects()
    api = json.loads(json.dumps(base[("Deployment", "sluice-api")]))
    api["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/healthz"}
    assert errors_of(api)
    scaled = json.loads(json.dumps(base[("ScaledObject", "sluice-worker")]))
    scaled["spec"]["minReplicaCount"] = "zero"
    assert errors_of(scaled)
    del scaled["spec"]["minReplicaCount"], scaled["spec"]["scaleTargetRef"]
    assert any("scaleTargetRef" in e for e in errors_of(scaled))
    scaled = json.loads(json.dumps(base[("ScaledObject", "sluice-worker")]))
    scaled["spec"]["minReplicas"] = 0  # not KEDA's name
    assert errors_of(scaled)


def command_params(container: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``sluice`` subcommand a container runs, and its parsed parameters (it must parse)."""
    argv = container["command"] + container.get("args", [])
    assert argv[0] == "sluice", argv
    return argv[1], cli.commands[argv[1]].make_context(argv[1], argv[2:]).params


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def check_worker(objs: list[dict[str, Any]], deployment: dict[str, Any]) -> None:
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    sub, params = command_params(container)
    assert sub == "worker" and params["exit_when_idle"] is None  # a Deployment's pod that exits is restarted
    assert pod["spec"]["terminationGracePeriodSeconds"] >= params["grace_period"] + FLUSH_AFTER_GRACE + 5
    assert "replicas" not in deployment["spec"]  # KEDA's to set
    model = env_of(container)["SLUICE_MODEL"]
    labels = pod["metadata"]["labels"]
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"
            and o["spec"]["selector"]["matchLabels"].items() <= labels.items()]
    assert len(pdbs) == 1, name
    (scaled,) = [o for o in objs if o["kind"] == "ScaledObject" and o["spec"]["scaleTargetRef"]["name"] == name]
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["maxReplicaCount"] >= 1
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metadata"]["valueLocation"] == "backlog"
    url = urlsplit(trigger["metadata"]["url"])
    api_service = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "sluice-api")
    assert url.hostname == f"sluice-api.{api_service['metadata'].get('namespace', NAMESPACE)}.svc"
    assert url.port == api_service["spec"]["ports"][0]["port"] and url.path == "/v1/backlog"
    assert parse_qs(url.query) == {"model": [model]}, "the ScaledObject reads another model's backlog"
    auth = next(o for o in objs if o["kind"] == "TriggerAuthentication"
                and o["metadata"]["name"] == trigger["authenticationRef"]["name"])
    api_key = env_of(next(o for o in objs if o["kind"] == "Deployment"
                          and o["metadata"]["name"] == "sluice-api")["spec"]["template"]["spec"]["containers"][0])
    (ref,) = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "token" and trigger["metadata"]["authMode"] == "bearer"
    assert {"name": ref["name"], "key": ref["key"]} == api_key["SLUICE_API_KEY"]["secretKeyRef"]


def check_rendered(objs: list[dict[str, Any]], overlay: str) -> None:
    for o in objs:
        assert not errors_of(o), f"{overlay} {o['kind']}/{o['metadata']['name']}:\n" + "\n".join(errors_of(o))
        assert o["kind"] == "Namespace" or o["metadata"]["namespace"] == NAMESPACE
    workers = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != "sluice-api"]
    assert workers
    for w in workers:
        check_worker(objs, w)
    api = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "sluice-api")
    (container,) = api["spec"]["template"]["spec"]["containers"]
    assert command_params(container)[0] == "serve" and container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    (server,) = [o for o in objs if o["kind"] == "StatefulSet"]
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    opts = dict(zip(args[1::2], args[2::2], strict=False))
    assert opts["--appendonly"] == "yes" and opts["--maxmemory-policy"] == "noeviction"
    assert server["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    secrets = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    wanted = {r["name"] for o in objs if o["kind"] == "TriggerAuthentication" for r in o["spec"]["secretTargetRef"]}
    assert wanted - secrets <= {EXTERNAL_SECRET}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here to render the overlays (the files themselves are validated above)")
    out = subprocess.run([kubectl, "kustomize", str(KUBE / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_and_validates(overlay: str) -> None:
    objs = render(overlay)
    check_rendered(objs, overlay)
    gpus = [c["resources"].get("limits", {}).get("nvidia.com/gpu") for o in objs if o["kind"] == "Deployment"
            and o["metadata"]["name"] != "sluice-api" for c in o["spec"]["template"]["spec"]["containers"]]
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"
            and o["metadata"]["name"] != "sluice-api"]
    if overlay == "gpu":
        assert gpus == [1] * len(gpus)
        assert all(p["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in p["tolerations"]) for p in pods)
    else:
        assert gpus == [None] * len(gpus) and not any("nodeSelector" in p for p in pods)


def test_the_base_hangs_together_without_kubectl() -> None:
    """The same checks on the base's objects as written (what CI without kubectl sees)."""
    objs = list(base_objects().values())
    workers = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != "sluice-api"]
    assert workers
    for w in workers:
        check_worker(objs, w)


def test_the_docs_say_how_to_create_the_gpu_overlays_secret() -> None:
    readme = (ROOT / "docs" / "deployment.md").read_text()
    assert f"create secret generic {EXTERNAL_SECRET} --from-literal=SLUICE_API_KEY=" in readme
    assert "kubectl apply -k deploy/kubernetes/overlays/gpu" in readme
