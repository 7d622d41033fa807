"""A CustomResourceDefinition's openAPIV3Schema as a JSON schema, for offline validation of the resources
(tests/project/test_kubernetes.py validates the KEDA ScaledObjects in deploy/kubernetes/ with it).

    git show <keda commit>:config/crd/bases/keda.sh_scaledobjects.yaml \
        | python scripts/crd_to_jsonschema.py v1alpha1 <keda commit> > tests/data/keda/scaledobject-keda-v1alpha1.json

What differs from JSON Schema is translated: ``nullable``, ``x-kubernetes-int-or-string``; unknown fields are
refused (kubectl's default strict field validation), unless the schema keeps them
(``x-kubernetes-preserve-unknown-fields``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def convert(node: Any) -> Any:
    if isinstance(node, list):
        return [convert(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: convert(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main(version: str, source: str) -> None:
    crd = yaml.safe_load(sys.stdin)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = convert(v["schema"]["openAPIV3Schema"])
    names = crd["spec"]["names"]
    schema["$schema"] = "http://json-schema.org/draft-07/schema#"
    schema["$comment"] = (f"{names['kind']} {crd['spec']['group']}/{version}: the openAPIV3Schema of KEDA's CRD "
                          f"{crd['metadata']['name']} (github.com/kedacore/keda at {source}, Apache-2.0), converted by "
                          "scripts/crd_to_jsonschema.py")
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
