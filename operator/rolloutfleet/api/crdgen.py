"""Turn the pydantic models into CustomResourceDefinitions (the only way CRDs are made).

Called by ``rolloutfleet crds`` (which writes ``crds/``), by the chart sync and by the drift test. Owns
the structural-schema rules Kubernetes imposes on CRD schemas: no ``$ref`` (inlined), no ``title``,
``anyOf`` only for int-or-string, nullable optionals folded into "not required", and
``x-kubernetes-preserve-unknown-fields`` only where a model asks for it.
"""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import yaml

from rolloutfleet.api import common, fleet, revision

JSON = dict[str, Any]

# Keys of pydantic's JSON schema that structural schemas reject or that we do not want on the wire.
_DROP_KEYS = frozenset({"title", "$defs"})
_NULLABLE = "x-rolloutfleet-nullable"

# `kubectl get rolloutfleet-all -A` lists both kinds. A category must equal no resource name: with the
# category `rolloutfleet`, `kubectl get rolloutfleet NAME` in a namespace without that object fell back to
# the category and failed ("you must specify only one resource", not "not found"). No kind's singular,
# plural or short name may be this word
# (tests/unit/api/test_crds.py; tests/integration/chart/test_crd_names.py runs kubectl).
CATEGORY = "rolloutfleet-all"


def _resolve(node: Any, defs: JSON) -> Any:
    """Inline every ``$ref`` (siblings of a ``$ref``, like descriptions, win over the target's)."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve(_merged(target, siblings), defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


_RULES = "x-kubernetes-validations"


def _merged(base: JSON, over: JSON) -> JSON:
    """``base`` updated with ``over``, except CEL rules, which add up: a model's own rules (e.g. a source is
    a path or a push) and a field's rules on it (e.g. immutable) must all hold."""
    out = dict(base)
    out.update(over)
    if _RULES in base and _RULES in over:
        out[_RULES] = [*base[_RULES], *[r for r in over[_RULES] if r not in base[_RULES]]]
    return out


def _is_null(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"


def _structural(node: Any) -> Any:
    """Rewrite a resolved JSON schema node into a Kubernetes structural schema node."""
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS}
    if "anyOf" in node:
        all_branches = node.pop("anyOf")
        branches = [b for b in all_branches if not _is_null(b)]
        if len(branches) < len(all_branches):
            node[_NULLABLE] = True  # read (and removed) by _add_object_defaults
        if node.get("default", ...) is None:
            del node["default"]
        types = sorted(b.get("type", "") for b in branches)
        if len(branches) == 1:
            node = _merged(branches[0], node)  # description/default of the field win
        elif types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
            for branch in branches:  # keep per-branch constraints where the schema allows them
                for key in ("pattern", "minimum", "maximum"):
                    if key in branch:
                        node[key] = branch[key]
        else:
            raise ValueError(f"unsupported union in CRD schema: {branches}")
    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    # OpenAPI v3.0 (what CRDs use) has boolean exclusive bounds; the models only use ge/le.
    if "exclusiveMinimum" in node or "exclusiveMaximum" in node:
        raise ValueError("use ge/le, not gt/lt, in CRD models (OpenAPI v3.0 bounds)")
    if node.get("additionalProperties") is False:
        # Structural schemas forbid `additionalProperties: false`; the API server prunes unknown fields.
        del node["additionalProperties"]
    if node.get("type") == "object" and "additionalProperties" in node:
        extra = node["additionalProperties"]
        if extra is True or extra == {}:
            node.pop("additionalProperties")
            node["x-kubernetes-preserve-unknown-fields"] = True
    if node.get("x-kubernetes-preserve-unknown-fields"):
        node["type"] = "object"
        node.pop("additionalProperties", None)
    if "default" in node and node["default"] is None:
        del node["default"]
    node = {k: v for k, v in node.items() if k not in _DROP_KEYS}
    ordered = {key: node[key] for key in ("type", "description") if key in node}
    ordered.update(sorted((k, v) for k, v in node.items() if k not in ordered))
    return {key: _structural(value) for key, value in ordered.items()}


def schema_of(model: type[pydantic.BaseModel]) -> JSON:
    """The structural OpenAPI v3 schema of a model, camelCase, for a CRD version."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved = _resolve(raw, raw.get("$defs", {}))
    schema: JSON = _structural(resolved)
    _add_object_defaults(schema)
    return schema


def _add_object_defaults(schema: JSON) -> None:
    """Give optional nested objects ``default: {}`` so the API server fills their fields' defaults.

    pydantic emits no default for ``default_factory`` fields; without ``{}`` Kubernetes would only default
    fields of objects the user wrote.
    """
    properties: JSON = schema.get("properties", {})
    required = set(schema.get("required", []))
    for name, prop in properties.items():
        nullable = prop.pop(_NULLABLE, False)
        if prop.get("type") == "object" and "properties" in prop:
            _add_object_defaults(prop)
            nested_required = prop.get("required", [])
            # Optional (None-able) objects mean "absent"; only always-present objects get filled in.
            if name not in required and "default" not in prop and not nested_required and not nullable:
                prop["default"] = {}
        elif prop.get("type") == "array" and isinstance(prop.get("items"), dict):
            _add_object_defaults(prop["items"])


def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: list[str],
    model: type[pydantic.BaseModel],
    columns: list[JSON],
    scale: bool,
) -> JSON:
    full = schema_of(model)
    properties = full["properties"]
    root: JSON = {
        "type": "object",
        "description": full.get("description", ""),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": properties["spec"],
            # Status is the operator's to write; defaulting it would make every new object look observed.
            "status": {k: v for k, v in properties["status"].items() if k != "default"},
        },
    }
    if "x-kubernetes-validations" in full:
        # Root rules: the only place CEL sees metadata.name (and the stored status, for transition rules).
        root["x-kubernetes-validations"] = full["x-kubernetes-validations"]
    subresources: JSON = {"status": {}}
    if scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{common.GROUP}"},
        "spec": {
            "group": common.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short_names,
                "categories": [CATEGORY],
            },
            "versions": [
                {
                    "name": common.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def custom_resource_definitions() -> dict[str, JSON]:
    """Every CRD of the project, keyed by the file name it is written to."""
    return {
        f"{common.GROUP}_{fleet.PLURAL}.yaml": _crd(
            kind=fleet.KIND,
            plural=fleet.PLURAL,
            singular=fleet.SINGULAR,
            short_names=fleet.SHORT_NAMES,
            model=fleet.RolloutFleet,
            columns=fleet.PRINTER_COLUMNS,
            scale=True,
        ),
        f"{common.GROUP}_{revision.PLURAL}.yaml": _crd(
            kind=revision.KIND,
            plural=revision.PLURAL,
            singular=revision.SINGULAR,
            short_names=revision.SHORT_NAMES,
            model=revision.WeightRevision,
            columns=revision.PRINTER_COLUMNS,
            scale=False,
        ),
    }


HEADER = "# GENERATED by `rolloutfleet crds` from the pydantic models in rolloutfleet.api. Do not edit.\n"


def render(crd: JSON) -> str:
    """YAML text of one CRD, stable across runs (a drift test compares it byte for byte)."""
    return HEADER + yaml.safe_dump(crd, sort_keys=False, width=120, allow_unicode=True)
