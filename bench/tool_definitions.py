"""Labelled tool definitions (OpenAI `tools` entries) for the injection guardrail: benign ones
read out of toolsets shipped on PyPI, and attacks planted in a tool's definition.

The input guardrails judge every string of a request's `tools` (orchestrator/api/
input_pieces.py): a detector that flags ordinary tool descriptions refuses ordinary agent
requests. These are the definitions bench/quality.py measures that on, and bench/
train_injection.py trains on (the `train` sources only).

Benign, each source a whole toolset (split by source, never by sentence: a held-out source
measures what the heads do on a toolset they never saw). Read with `ast` from the installed or
downloaded packages, never imported (their runtimes are not dependencies):
- train: LangChain's community tools (`langchain-community==0.4.2`, MIT: each BaseTool's
  `name`, `description` and its `args_schema` fields), AgentHarm's benign tools and tau2-bench's
  agent and user tools (both in `inspect-evals==0.26.0`, MIT).
- held out (`HELD_OUT`): AgentDojo's tools (in inspect-evals, MIT) and the MCP reference
  servers (`mcp-server-fetch`, `mcp-server-git`, `mcp-server-time`, MIT), parameters with the
  `title` pydantic writes into an MCP tool's input schema.
A tool becomes what a client sends: `{"type": "function", "function": {name, description,
parameters}}`, the parameters a JSON Schema (types from the annotations, `enum` from Literal
and enum classes, `required` for parameters without a default).

Attacks (`tool_definition_attacks`): mcp-guard-audit 0.13.1's (MIT) payloads whose vector is a
tool description, bastionsupply 0.11.1's (MIT) poisoned demo tools and agent card, and
tests/data/tool_definition_attacks.jsonl (written for this project: tool poisoning in
descriptions, parameter descriptions, enum values and defaults), each planted in an otherwise
benign held-out tool. Never trained on.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ATTACKS_FILE = ROOT / "tests" / "data" / "tool_definition_attacks.jsonl"
HELD_OUT = ("agentdojo", "mcp-servers")
TRAIN_SOURCES = ("langchain-community", "agentharm", "tau2")
MCP_SERVERS = ("mcp_server_fetch", "mcp_server_git", "mcp_server_time")


@dataclass(frozen=True)
class ToolDef:
    tool: dict[str, Any]  # an OpenAI `tools` entry
    source: str
    label: bool = False  # True: an attack is planted in it


def _pkg(name: str) -> Path:
    from bench.quality import package_dir

    return package_dir(name)


_JSON_TYPES = {
    "str": "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "list": "array",
    "List": "array",
    "tuple": "array",
    "dict": "object",
    "Dict": "object",
    "AnyUrl": "string",
}


def _schema(ann: ast.expr | None, enums: dict[str, list[str]]) -> dict[str, Any]:
    """The JSON Schema of an annotation, as far as its source says (a model class: object)."""
    if ann is None:
        return {"type": "string"}
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return _schema(ast.parse(ann.value, mode="eval").body, enums)
        except SyntaxError:
            return {"type": "string"}
    if isinstance(ann, ast.BinOp):  # X | None
        return _schema(ann.left, enums)
    if isinstance(ann, ast.Subscript):
        head = ann.value.id if isinstance(ann.value, ast.Name) else getattr(ann.value, "attr", "")
        inner = ann.slice
        if head in ("Optional", "Annotated", "Union"):
            first = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
            return _schema(first, enums)
        if head == "Literal":
            vals = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return {
                "type": "string",
                "enum": [v.value for v in vals if isinstance(v, ast.Constant)],
            }
        if head in ("list", "List", "tuple", "Sequence"):
            first = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
            return {"type": "array", "items": _schema(first, enums)}
        return {"type": _JSON_TYPES.get(head, "object")}
    name = ann.id if isinstance(ann, ast.Name) else getattr(ann, "attr", "")
    if name in enums:
        return {"type": "string", "enum": enums[name]}
    return {"type": _JSON_TYPES.get(name, "object")}


def _field_description(node: ast.expr | None, names: dict[str, str] | None = None) -> str | None:
    """`description=` of a pydantic Field(...) call in `node` (an Annotated or a default)."""
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "Field":
            for kw in sub.keywords:
                if kw.arg == "description":
                    return _text(kw.value, names)
    return None


def _text(node: ast.expr, names: dict[str, str] | None = None) -> str | None:
    """A string constant, an f-string (unknown names as themselves) or `+`/implicit
    concatenation; None when it is not text."""
    names = names or {}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                out.append(str(v.value))
            elif isinstance(v, ast.FormattedValue):
                inner = v.value
                key = inner.id if isinstance(inner, ast.Name) else ast.unparse(inner)
                out.append(names.get(key, key))
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left, names), _text(node.right, names)
        return a + b if a is not None and b is not None else None
    if isinstance(node, ast.Name):
        return names.get(node.id)
    return None


def _enums(tree: ast.Module) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Enum classes' member values, and `Enum.MEMBER` -> value, of a module."""
    enums: dict[str, list[str]] = {}
    members: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
            vals = []
            for st in node.body:
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Constant):
                    vals.append(str(st.value.value))
                    members[f"{node.name}.{st.targets[0].id}"] = str(st.value.value)  # type: ignore[attr-defined]
            enums[node.name] = vals
    return enums, members


def _constants(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            text = _text(node.value, out)
            if text is not None:
                out[node.targets[0].id] = text
    return out


def _google_doc(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) of a Google-style docstring."""
    doc = doc.strip()
    head = re.split(r"\n\s*(?:Args|Arguments|Returns|Raises|Example|Examples):", doc)[0]
    head = " ".join(head.replace(":param", "\n:param").split("\n:param")[0].split())
    params: dict[str, str] = {}
    m = re.search(
        r"\n\s*(?:Args|Arguments):\s*\n(.*?)(?:\n\s*\n|\n\s*[A-Z]\w+:\s*\n|\Z)", doc, re.S
    )
    if m:
        cur = None
        for line in m.group(1).splitlines():
            hit = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if hit and hit.group(1) != "None":
                cur = hit.group(1)
                params[cur] = hit.group(2).strip()
            elif cur and line.strip():
                params[cur] += " " + line.strip()
    for pm in re.finditer(r":param (\w+): (.+?)(?=\n\s*:|\Z)", doc, re.S):
        params[pm.group(1)] = " ".join(pm.group(2).split())
    return head, params


def _tool(
    name: str,
    description: str,
    params: list[tuple[str, dict[str, Any], str | None, bool]],
    titles: bool = False,
) -> dict[str, Any]:
    """An OpenAI tools entry; params are (name, schema, description, required)."""
    props: dict[str, Any] = {}
    for pname, schema, pdesc, _ in params:
        prop = dict(schema)
        if titles:  # what pydantic writes into an MCP tool's input schema
            prop = {"title": pname.replace("_", " ").title(), **prop}
        if pdesc:
            prop["description"] = pdesc
        props[pname] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": props}
    required = [p for p, _, _, req in params if req]
    if required:
        parameters["required"] = required
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def _args(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.arg, ast.expr | None]]:
    args = [a for a in fn.args.args if a.arg not in ("self", "run_manager", "cls")]
    defaults: list[ast.expr | None] = [None] * (len(args) - len(fn.args.defaults)) + list(
        fn.args.defaults
    )
    yield from zip(args, defaults, strict=True)
    yield from zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)


def inspect_tools(files: list[Path], source: str) -> list[ToolDef]:
    """inspect_ai `@tool` factories: the tool is the factory's name, its description and
    parameters the inner function's docstring and signature."""
    out = []
    for path in sorted(files):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        enums, _ = _enums(tree)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not any(
                "tool" in ast.unparse(d) for d in node.decorator_list
            ):
                continue
            inner = next(
                (n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
                None,
            )
            doc = ast.get_docstring(inner) if inner is not None else None
            if not doc:
                continue
            desc, pdocs = _google_doc(doc)
            params = [
                (a.arg, _schema(a.annotation, enums), pdocs.get(a.arg), d is None)
                for a, d in _args(inner)
            ]
            out.append(ToolDef(_tool(node.name, desc, params), source))
    return out


def agentdojo() -> list[ToolDef]:
    root = _pkg("inspect_evals") / "agentdojo" / "tools"
    return inspect_tools(list(root.glob("*.py")), "agentdojo")


def agentharm() -> list[ToolDef]:
    root = _pkg("inspect_evals") / "agentharm" / "benchmark" / "benign_tools"
    return inspect_tools(list(root.glob("*.py")), "agentharm")


def tau2() -> list[ToolDef]:
    root = _pkg("inspect_evals") / "tau2"
    files = [*root.glob("*/tools.py"), *root.glob("*/user_tools.py")]
    return inspect_tools(files, "tau2")


def _model_fields(
    cls: ast.ClassDef, enums: dict[str, list[str]]
) -> list[tuple[str, dict[str, Any], str | None, bool]]:
    out = []
    for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            desc = _field_description(st.value) or _field_description(st.annotation)
            required = st.value is None or (
                isinstance(st.value, ast.Call)
                and bool(st.value.args)
                and isinstance(st.value.args[0], ast.Constant)
                and st.value.args[0].value is Ellipsis
            )
            if st.target.id != "model_config":
                out.append((st.target.id, _schema(st.annotation, enums), desc, required))
    return out


def langchain_community() -> list[ToolDef]:
    """Each BaseTool subclass with a literal `name` and `description`; its parameters the
    fields of its `args_schema` class (found in any module of the package)."""
    root = _pkg("langchain_community") / "tools"
    trees = [(p, ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(root.rglob("*.py"))]
    models: dict[str, list[tuple[str, dict[str, Any], str | None, bool]]] = {}
    for _, tree in trees:
        enums, _ = _enums(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                "BaseModel" in ast.unparse(b) for b in node.bases
            ):
                models[node.name] = _model_fields(node, enums)
    out, seen = [], set()
    for _, tree in trees:
        consts = _constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs: dict[str, ast.expr] = {
                st.target.id: st.value
                for st in node.body
                if isinstance(st, ast.AnnAssign)
                and isinstance(st.target, ast.Name)
                and st.value is not None
            }
            name = _text(attrs["name"], consts) if "name" in attrs else None
            desc = _text(attrs["description"], consts) if "description" in attrs else None
            if not name or not desc or (name, desc) in seen:
                continue
            seen.add((name, desc))
            schema = attrs.get("args_schema")
            params = models.get(schema.id, []) if isinstance(schema, ast.Name) else []
            if not params:  # BaseTool's default: one string argument
                params = [("tool_input", {"type": "string"}, None, True)]
            out.append(ToolDef(_tool(name, " ".join(desc.split()), params), "langchain-community"))
    return out


def mcp_servers() -> list[ToolDef]:
    """The MCP reference servers' `@server.tool(name=..., description=...)` functions, their
    parameters' descriptions from `Annotated[..., Field(description=...)]`, with titles."""
    out = []
    for pkg in MCP_SERVERS:
        for path in sorted(_pkg(pkg).glob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            enums, members = _enums(tree)
            names = {**_constants(tree), "local_tz": "UTC"}
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for dec in node.decorator_list:
                    if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "tool"):
                        continue
                    kw = {k.arg: k.value for k in dec.keywords}
                    raw = kw.get("name")
                    if isinstance(raw, ast.Attribute) and raw.attr == "value":
                        name = members.get(ast.unparse(raw.value))
                    else:
                        name = _text(raw, names) if raw is not None else node.name
                    desc = _text(kw["description"], names) if "description" in kw else None
                    if not name or desc is None:
                        continue
                    params = [
                        (
                            a.arg,
                            _schema(a.annotation, enums),
                            _field_description(a.annotation, names),
                            d is None,
                        )
                        for a, d in _args(node)
                    ]
                    tool = _tool(name, " ".join(desc.split()), params, titles=True)
                    out.append(ToolDef(tool, "mcp-servers"))
    return out


def benign_tools() -> list[ToolDef]:
    """Every source's tools, each definition once (the first source keeps it)."""
    out, seen = [], set()
    for fn in (langchain_community, agentharm, tau2, agentdojo, mcp_servers):
        for t in fn():
            k = json.dumps(t.tool, sort_keys=True)
            if k not in seen:
                seen.add(k)
                out.append(t)
    return out


def tool_definition_attacks() -> list[ToolDef]:
    """Attacks planted in held-out benign tools: an attack's `where` says in which string
    (`description`, a parameter's `param_description`, an `enum` value, a `default`, or the
    tool `name`), `how` whether it replaces or follows the benign text."""
    hosts = [t.tool for t in benign_tools() if t.source in HELD_OUT]
    hosts = [t for t in hosts if t["function"]["parameters"]["properties"]]
    out = []
    for i, a in enumerate(attack_texts()):
        tool = json.loads(json.dumps(hosts[(i * 7) % len(hosts)]))
        fn = tool["function"]
        prop = next(iter(fn["parameters"]["properties"].values()))
        text, where = a["text"], a["where"]
        if where == "description":
            fn["description"] = f"{fn.get('description', '')} {text}".strip()
        elif where == "param_description":
            prop["description"] = f"{prop.get('description', '')} {text}".strip()
        elif where == "enum":
            prop["enum"] = [*prop.get("enum", ["default"]), text]
        elif where == "default":
            prop["default"] = text
        out.append(ToolDef(tool, a["source"], True))
    return out


def attack_texts() -> list[dict[str, str]]:
    """{text, where, source} of every attack: the packages' then tests/data's."""
    from bench.quality import package_dir

    out = []
    mg = package_dir("mcp_guard") / "payloads.py"
    for node in ast.walk(ast.parse(mg.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Payload":
            kw = {k.arg: k.value for k in node.keywords}
            text = _text(kw["text"], {"CANARY": "MCPGUARD-CANARY-7F3A"})
            if _text(kw["vector"]) == "tool description" and text:
                out.append({"text": text, "where": "description", "source": "mcp-guard-audit"})
    bs = package_dir("bastionsupply")
    card = json.loads((bs / "fixtures" / "poisoned-card.json").read_text(encoding="utf-8"))
    out.append({"text": card["description"], "where": "description", "source": "bastionsupply"})
    demo = ast.parse((bs / "demo.py").read_text(encoding="utf-8"))
    for node in ast.walk(demo):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "Tool"
            and len(node.args) > 1
        ):
            text = _text(node.args[1]) or ""
            if re.search(r"IMPORTANT|always cc", text):
                out.append({"text": text, "where": "description", "source": "bastionsupply"})
    for line in ATTACKS_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append({**row, "source": "tests/data (ours)"})
    return out
